"""Deleting records from a DaRE forest, exactly: incrementally (the compiled walk of
:mod:`jobs.learners.dare.delete_kernels`, then the outermost changed subtrees retrained
once) or, where that is estimated to cost more, by a refit (:mod:`jobs.learners.dare.costs`).
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jobs.learners.dare import build_kernels as bk
from jobs.learners.dare import builder, pools, training
from jobs.learners.dare import delete_kernels as dk
from jobs.learners.dare.common import RANDOM, score_table
from jobs.learners.dare.labels import drop_empty_classes
from jobs.learners.dare.state import ForestState
from jobs.learners.dare.values import update_domains


def delete(st: ForestState, rids: np.ndarray, stats: dict[str, Any], random_state: int
           ) -> ForestState:
    """Delete the live records `rids` (at least one live record stays); returns the
    forest (a new one where the batch refits) and fills `stats` for the report."""
    m = len(rids)
    refit, said = st.costs.plan(m, st.records.n_live)
    stats.update(said)
    if refit:
        gone = set(rids.tolist())
        keep = [i for i in st.records.slot if i not in gone]
        stats.update(mode="refit", subtrees_retrained=st.rule.n_trees, records_retrained=len(keep))
        return _refit(st, keep, random_state)
    work = _delete_slots(st, [st.records.slot.pop(i) for i in rids.tolist()], stats)
    st.costs.learn(m, work, st.records.n_live)
    drop_empty_classes(st)
    return st


def _refit(st: ForestState, keep_ids: list[str], random_state: int) -> ForestState:
    """A forest trained on the records `keep_ids` alone, that remembers what deletions
    were measured to retrain."""
    rec = st.records
    sl = np.array([rec.slot[i] for i in keep_ids], dtype=np.int64)
    fresh = training.train(st.rule, np.array(keep_ids, dtype=object), rec.X[:, sl].T.copy(),
                           rec.classes[rec.y[sl]], random_state, st.domains.fixed,
                           st.costs.policy)
    fresh.costs = st.costs.refitted(fresh.costs.work, fresh.costs.n)
    return fresh


def _delete_slots(st: ForestState, slots: list[int], stats: dict[str, Any]) -> int:
    """Delete records (slots) one after the other from the counts and caches, then
    retrain the outermost changed nodes once. Returns the build work retrained."""
    stop = len(slots) == 1
    dirty = np.zeros(1 if stop else len(st.nodes.tree), dtype=bool)
    extra: list[np.ndarray] = []
    roots = np.zeros(0, dtype=np.int64)
    for r in slots:
        roots = _delete_one(st, r, stats, dirty, extra, stop)
    if not stop:
        nd = st.nodes
        roots = dk.outermost(st.layout.root, dirty, nd.kind, nd.left, nd.right)
    if extra:
        roots = builder.outermost(st, np.concatenate([roots, *extra]))
    records, work = builder.rebuild(st, roots)
    stats["subtrees_retrained"] += len(roots)
    stats["records_retrained"] += records
    return work


def _forget_record(st: ForestState, r: int, extra: list[np.ndarray]) -> np.ndarray:
    """Take record r out of the store's counts and the layout; where it alone held an
    attribute's largest |value|, re-derive the random-node domains (random nodes on a
    moved one are appended to `extra`). Returns which attributes' domains moved."""
    rec = st.records
    c = int(rec.y[r])
    rec.alive[r] = False
    rec.n_live -= 1
    rec.class_n[c] -= 1
    st.layout.slot_at[np.arange(st.rule.n_trees), st.layout.pos[:, r]] = -1
    domchg = np.zeros(st.n_features, dtype=bool)
    if st.rule.d_rmax > 0:
        dom = st.domains
        at = np.flatnonzero(np.abs(rec.X[:, r]) >= dom.absmax)
        if at.size:  # the domain moves only when the last record at the largest |x| goes
            dom.absmax_n[at] -= 1
            at = at[dom.absmax_n[at] <= 0]
        if at.size:
            moved = update_domains(dom, rec, at)
            if moved.size:
                domchg[moved] = True
                nd = st.nodes
                used = np.flatnonzero(nd.used & (nd.kind == RANDOM))
                extra.append(used[np.isin(nd.attr[used], moved)])
    return domchg


def _delete_one(st: ForestState, r: int, stats: dict[str, Any], dirty: np.ndarray,
                extra: list[np.ndarray], stop: bool) -> np.ndarray:
    """Remove record r from the counts, caches and value tables of the nodes on its
    paths, WITHOUT retraining (compiled: :func:`delete_kernels.delete_record`): each node
    is re-evaluated against its stored split, and a tree's walk ends at the first node
    whose canonical state now differs, or (in a batch) that is already marked dirty.
    Random nodes whose stream domain changed are appended to `extra`.

    Deferring the retraining is exact: a node's counts, caches and layout range follow
    its records, and records are routed by the stored splits, so the nodes above the
    first changed one of each path are right; that one, and every node marked dirty by
    a batch, is retrained from its live records once, at the end, which gives its
    canonical subtree whatever happened below it.

    With `stop` (a deletion on its own) returns the changed nodes; in a batch they are
    marked in `dirty`."""
    c = int(st.records.y[r])
    domchg = _forget_record(st, r, extra)
    flagged = np.empty(st.rule.n_trees, dtype=np.int64)
    counts = np.zeros(2, dtype=np.int64)
    w, lists, cnt, rbuf = builder.scratch(st, st.records.capacity)
    tab = score_table(st.rule.gini, int(st.records.n_live) + 2)
    ctr = pools.counters(st)
    ctr[bk.CTR_AT_NODE] = -1
    while True:
        pools.full_free_lists(st)
        m = dk.delete_record(r, c, stop, domchg, dirty, flagged, st.nodes, st.caches,
                             st.entries, st.tables, st.record_arrays(), st.layout,
                             st.global_order(), st.rule, tab, w, lists, cnt, rbuf, ctr, counts)
        if m >= 0:
            break
        # short of room at one node: make it and resume there
        keep = ctr[bk.CTR_AT_TREE : bk.CTR_NFLAG + 1].copy()
        need_e, need_h = int(ctr[bk.CTR_NEED_E]), int(ctr[bk.CTR_NEED_H])
        pools.put_counters(st, ctr)
        pools.reserve_entries(st, max(need_e, len(st.entries.r1) // 8))
        pools.reserve_tables(st, max(need_h, len(st.tables.rank) // 8))
        ctr = pools.counters(st)
        ctr[bk.CTR_AT_TREE : bk.CTR_NFLAG + 1] = keep
    pools.put_counters(st, ctr)
    stats["nodes_touched"] += int(counts[dk.STAT_NODES])
    stats["caches_recomputed"] += int(counts[dk.STAT_CACHES])
    return flagged[:m]
