"""Growing DaRE subtrees from their records: whole trees at a fit, the outermost changed
subtrees after an update, the caches that greedy nodes keep and the value group tables a
loaded forest rebuilds (the compiled builder is :mod:`jobs.learners.dare.build_kernels`).
See docs/learners.md (DaRE)."""

from __future__ import annotations

import numpy as np

from jobs.learners.dare import build_kernels as bk
from jobs.learners.dare import pools
from jobs.learners.dare import search_kernels as sk
from jobs.learners.dare.common import _ranges, score_table
from jobs.learners.dare.split_search import CandidateLists
from jobs.learners.dare.state import ForestState


def scratch(st: ForestState, maxn: int) -> tuple[sk.SearchScratch, sk.NodeLists, np.ndarray,
                                                 np.ndarray]:
    """Scratch buffers of the compiled split search for nodes of up to maxn records
    (kept on the state between calls; not part of the model): work, one node's lists,
    class counts, a record buffer."""
    maxn = max(maxn, st.layout.slot_at.shape[1])
    rule, C = st.rule, st.n_classes
    KB = rule.k + rule.buffer
    key = (C, st.n_features, rule.n_sampled, KB, rule.hist_ratio)
    nvals = st.values.nvals_max
    wk = st.scratch
    if wk is None or wk[0] != key or wk[1] < maxn or wk[2] < nvals:
        maxn = max(maxn, wk[1] if wk is not None and wk[0] == key else 0)
        w, lists = sk.make_work(maxn, nvals, st.n_features, C, rule.n_sampled, KB,
                                rule.hist_ratio)
        wk = (key, maxn, nvals, w, lists, np.zeros(C, dtype=np.int64),
              np.empty(max(maxn, 1), dtype=np.int64))
        st.scratch = wk
    return wk[3], wk[4], wk[5], wk[6]


def node_rows(st: ForestState, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Live records of each node (CSR rows, off), from the layout ranges."""
    nd = st.nodes
    return bk.layout_rows(st.layout.slot_at, nd.tree[nodes].astype(np.int64),
                          nd.start[nodes].astype(np.int64), nd.end[nodes].astype(np.int64))


def install_caches(st: ForestState, nodes: np.ndarray, lists: CandidateLists,
                   sel: np.ndarray) -> None:
    """Store the lists of rows `sel` of `lists` on `nodes` (parallel to sel)."""
    if len(nodes) == 0:
        return
    pools.uncache(st, nodes)
    cids = pools.alloc_caches(st, len(nodes))
    ln = lists.length[sel]
    tot = int(ln.sum())
    start = pools.alloc_entries(st, tot)
    src = _ranges(lists.off[sel].ravel(), ln.ravel())
    dst = np.arange(start, start + tot)
    e, cc = st.entries, st.caches
    e.r1[dst] = lists.e_r1[src]
    e.r2[dst] = lists.e_r2[src]
    e.left[:, dst] = lists.e_left[src].T
    cc.attr[cids] = lists.slot_attr[sel]
    cc.off[cids] = start + (np.cumsum(ln.ravel()) - ln.ravel()).reshape(ln.shape)
    cc.length[cids] = ln
    cc.all_pairs[cids] = lists.all_pairs[sel]
    cc.cut_prio[cids] = lists.cut_prio[sel]
    cc.cut_value[cids] = lists.cut_value[sel]
    hl = lists.table_len[sel]
    htot = int(hl.sum())
    pools.reserve_tables(st, htot)
    used = st.counts.tables_used
    hsrc = _ranges(lists.table_off[sel].ravel(), hl.ravel())
    hdst = np.arange(used, used + htot)
    st.tables.rank[hdst] = lists.t_rank[hsrc]
    st.tables.cnt[hdst] = lists.t_cnt[hsrc]
    cc.table_off[cids] = used + (np.cumsum(hl.ravel()) - hl.ravel()).reshape(hl.shape)
    cc.table_len[cids] = hl
    st.counts.tables_used += htot
    st.nodes.cid[nodes] = cids


def grow_subtrees(st: ForestState, stack: np.ndarray, ctr: np.ndarray, rows: np.ndarray) -> int:
    """Run the compiled builder on the tasks of `stack` until it is done, growing the
    pools whenever it stops short of room (it resumes where it stopped). Returns its
    work (records x levels), the unit of the batch cost estimate."""
    sp = int(ctr[bk.CTR_SP])
    n_max = int((stack[:sp, 7] - stack[:sp, 6]).max(initial=0))
    tab = score_table(st.rule.gini, n_max + 2)
    w, lists, cnt, _rbuf = scratch(st, n_max)
    while True:
        pools.full_free_lists(st)
        if not bk.build_subtrees(stack, ctr, rows, st.nodes, st.caches, st.entries, st.tables,
                                 st.record_arrays(), st.layout, st.rule, tab, w, lists, cnt):
            break
        sp, work = int(ctr[bk.CTR_SP]), int(ctr[bk.CTR_WORK])
        need_e, need_h = int(ctr[bk.CTR_NEED_E]), int(ctr[bk.CTR_NEED_H])
        pools.put_counters(st, ctr)
        pools.grow_nodes(st, max(2, len(st.nodes.tree) // 2))
        pools.grow_caches(st, max(1, len(st.caches.attr) // 2))
        pools.reserve_entries(st, max(need_e, len(st.entries.r1) // 4))
        pools.reserve_tables(st, max(need_h, len(st.tables.rank) // 4))
        ctr = pools.counters(st)
        ctr[bk.CTR_SP] = sp
        ctr[bk.CTR_WORK] = work
    pools.put_counters(st, ctr)
    return int(ctr[bk.CTR_WORK])


def build_trees(st: ForestState, trees: np.ndarray) -> int:
    """Grow whole trees from the live records (compiled, depth first, a chunk of trees
    at a time so that the record buffer stays small). Returns the build work."""
    live = np.flatnonzero(st.records.alive[: st.records.n_slots]).astype(np.int64)
    nl = len(live)
    work = 0
    chunk = max(1, 1_000_000 // max(1, nl))
    for t0 in range(0, len(trees), chunk):
        tr = trees[t0 : t0 + chunk].astype(np.int64)
        m = len(tr)
        roots = pools.alloc_nodes(st, m)
        st.layout.root[tr] = roots
        stack = np.zeros((m + st.rule.max_depth + 4, 8), dtype=np.int64)
        stack[:m, 0] = roots
        stack[:m, 1] = tr
        stack[:m, 2] = 1
        stack[:m, 5] = st.layout.slot_at.shape[1]
        stack[:m, 6] = np.arange(m) * nl
        stack[:m, 7] = np.arange(1, m + 1) * nl
        ctr = pools.counters(st)
        ctr[bk.CTR_SP] = m
        work += grow_subtrees(st, stack, ctr, np.tile(live, m))
    return work


def rebuild(st: ForestState, nodes: np.ndarray) -> tuple[int, int]:
    """Retrain the subtrees rooted at `nodes` from their live records (compiled: the
    old subtrees are freed, the new ones grown depth first). Returns (records, build
    work)."""
    if len(nodes) == 0:
        return 0, 0
    nodes = np.asarray(nodes, dtype=np.int64)
    nd = st.nodes
    width = int((nd.end[nodes].astype(np.int64) - nd.start[nodes]).sum())
    rows = np.empty(max(width, 1), dtype=np.int64)
    stack = np.zeros((len(nodes) + st.rule.max_depth + 4, 8), dtype=np.int64)
    ctr = pools.counters(st)
    pools.full_free_lists(st)
    m = bk.prepare_rebuild(nodes, st.nodes, st.caches, st.layout, ctr, rows, stack)
    return int(m), grow_subtrees(st, stack, ctr, rows)


def ensure_tables(st: ForestState) -> None:
    """A loaded forest's value group tables, built by its first update (delete and add
    call this first; a fit builds its own)."""
    if st.tables_stale:
        rebuild_tables(st)


def rebuild_tables(st: ForestState) -> None:
    """Recompute every cached slot's value group table from the node's records (a
    saved forest does not store them: they are a function of the records)."""
    pools.clear_tables(st)
    st.tables_stale = False
    nd = st.nodes
    todo = np.flatnonzero(nd.used & (nd.cid >= 0)).astype(np.int64)
    w = scratch(st, st.records.capacity)[0]
    ctr = pools.counters(st)
    while True:
        pools.full_free_lists(st)
        if not bk.node_tables(todo, st.nodes, st.caches, st.tables, st.record_arrays(),
                              st.layout, ctr, st.rule.hist_ratio, w):
            break
        at, need = int(ctr[bk.CTR_SP]), int(ctr[bk.CTR_NEED_H])
        pools.put_counters(st, ctr)
        pools.reserve_tables(st, need)
        ctr = pools.counters(st)
        ctr[bk.CTR_SP] = at
    pools.put_counters(st, ctr)


def below(st: ForestState, nodes: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """Whether each node lies strictly below one of the roots."""
    out = np.zeros(len(nodes), dtype=bool)
    if len(roots) == 0 or len(nodes) == 0:
        return out
    nd = st.nodes
    t = nd.tree[nodes]
    dep = nd.depth[nodes].astype(np.int64)
    pa = nd.path[nodes]
    for rt, rd, rp in zip(nd.tree[roots].tolist(), nd.depth[roots].tolist(),
                          nd.path[roots].tolist(), strict=True):
        m = (t == rt) & (dep > rd)
        out[m] |= (pa[m] >> (dep[m] - rd)) == rp
    return out


def outermost(st: ForestState, nodes: np.ndarray) -> np.ndarray:
    """Drop nodes that lie below another node of the set."""
    nodes = np.unique(nodes)
    if len(nodes) <= 1:
        return nodes
    return nodes[~below(st, nodes, nodes)]
