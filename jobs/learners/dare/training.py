"""Training a DaRE forest from scratch: the state a fit (or a refit) starts from, every
tree grown from all records.
See docs/learners.md (DaRE)."""

from __future__ import annotations

import numpy as np

from jobs.learners.dare import builder, pools
from jobs.learners.dare.common import _U64
from jobs.learners.dare.costs import BatchPolicy, CostModel
from jobs.learners.dare.records import new_store
from jobs.learners.dare.state import ForestState, SplitRule
from jobs.learners.dare.values import new_domains, rerank
from jobs.learners.keyed import prf_u64


def tree_keys(random_state: int, n_trees: int) -> np.ndarray:
    """Each tree's key: every keyed choice in it derives from it (see
    :mod:`jobs.learners.dare.forest`)."""
    return np.array([prf_u64(int(random_state), "dare-tree", t) for t in range(n_trees)],
                    dtype=_U64)


def train(rule: SplitRule, ids: np.ndarray, X: np.ndarray, labels: np.ndarray,
          random_state: int, random_domain: float | None, policy: BatchPolicy) -> ForestState:
    """A forest grown on (ids, X, labels): unique ids, finite float64 features, labels of
    any comparable kind (the classes are their sorted distinct values)."""
    classes, yi = np.unique(labels, return_inverse=True)
    rec = new_store(ids, X, yi.astype(np.int32), classes)
    values, _ = rerank(rec, None)
    n, T, C, P = len(ids), rule.n_trees, len(classes), rule.n_sampled
    est_nodes = T * min(2 ** (rule.max_depth + 1), 2 * n + 1)
    ecap = max(1024, T * min(2 * n // rule.cache_min + 1, 2**rule.max_depth) * P
               * (rule.k + rule.buffer) // 2)
    nodes = pools.new_node_pool(max(64, est_nodes // 2), C, P)
    caches = pools.new_cache_pool(max(16, T * 16), P)
    st = ForestState(
        rule=rule, records=rec, value_index=values,
        value_domains=new_domains(rec, random_domain),
        tree_keys=tree_keys(random_state, T), nodes=nodes, caches=caches,
        entries=pools.new_entry_pool(ecap, C, rec.n_live),
        tables=pools.new_table_pool(max(1024, ecap // 4), C),
        layout=pools.new_layout(T, n, rec.capacity), counts=pools.new_counts(nodes, caches),
        costs=CostModel(policy, T, 0, n),
    )  # fmt: skip
    work = builder.build_trees(st, np.arange(T))
    pools.trim_pools(st)
    st.costs = CostModel(policy, T, work, n)
    return st
