"""Answering queries with a DaRE forest: routing them to leaves (``x <= thr`` to the
left), the leaves' class frequencies, and the cells of the input space the leaves are.
See docs/learners.md (DaRE)."""

from __future__ import annotations

import numpy as np

from jobs.learners.dare.common import LEAF
from jobs.learners.dare.state import ForestState


def leaf_of(st: ForestState, Xq: np.ndarray, trees: np.ndarray) -> np.ndarray:
    """Leaf node of each (tree, query row), following the served thresholds."""
    nd = st.nodes
    nq = Xq.shape[0]
    node = np.repeat(st.layout.root[trees][:, None], nq, axis=1)
    qi = np.broadcast_to(np.arange(nq), node.shape)
    for _ in range(st.rule.max_depth + 1):
        internal = nd.kind[node] != LEAF
        if not internal.any():
            break
        a = nd.attr[node]
        go = Xq[qi, np.maximum(a, 0)] <= nd.thr[node]
        node = np.where(internal, np.where(go, nd.left[node], nd.right[node]), node)
    return node


def scores(st: ForestState, Xq: np.ndarray) -> np.ndarray:
    """Mean over trees of the leaf class frequencies, shape (n, n_classes)."""
    T = st.rule.n_trees
    out = np.zeros((Xq.shape[0], st.n_classes))
    step = max(1, 100_000 // max(1, Xq.shape[0]))
    for t0 in range(0, T, step):
        leaf = leaf_of(st, Xq, np.arange(t0, min(T, t0 + step)))
        cnt = st.nodes.cnt[leaf].astype(np.float64)
        nn = np.maximum(st.nodes.n[leaf], 1).astype(np.float64)
        out += (cnt / nn[..., None]).sum(axis=0)
    return out / T


def leaves(st: ForestState) -> dict[str, np.ndarray]:
    """Every leaf of every tree with its cell of the input space (see
    :meth:`jobs.learners.dare.forest.DaREForest.leaves`)."""
    nd = st.nodes
    cur = st.layout.root[: st.rule.n_trees].astype(np.int64)
    lo = np.full((len(cur), st.n_features), -np.inf)
    hi = np.full((len(cur), st.n_features), np.inf)
    out_n, out_lo, out_hi = [], [], []
    while cur.size:
        leaf = nd.kind[cur] == LEAF
        out_n.append(cur[leaf])
        out_lo.append(lo[leaf])
        out_hi.append(hi[leaf])
        cur, lo, hi = cur[~leaf], lo[~leaf], hi[~leaf]
        if not cur.size:
            break
        a = nd.attr[cur].astype(np.int64)
        thr = nd.thr[cur]
        r = np.arange(len(cur))
        lhi = hi.copy()
        lhi[r, a] = np.minimum(hi[r, a], thr)
        rlo = lo.copy()
        rlo[r, a] = np.maximum(lo[r, a], thr)
        cur = np.concatenate([nd.left[cur], nd.right[cur]]).astype(np.int64)
        lo = np.concatenate([lo, rlo])
        hi = np.concatenate([lhi, hi])
    node = np.concatenate(out_n)
    order = np.lexsort((nd.path[node], nd.tree[node]))
    node = node[order]
    return {
        "node": node,
        "tree": nd.tree[node].astype(np.int64),
        "path": nd.path[node].astype(np.int64),
        "depth": nd.depth[node].astype(np.int64),
        "counts": nd.cnt[node].astype(np.int64),
        "n": nd.n[node].astype(np.int64),
        "lo": np.concatenate(out_lo)[order],
        "hi": np.concatenate(out_hi)[order],
    }
