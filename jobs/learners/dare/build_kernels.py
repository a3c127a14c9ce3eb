"""Compiled (numba) building of DaRE subtrees: the depth-first builder (:func:`build_subtrees`)
that fitting and every retrain after an update use, and the pool operations it shares with
deletions. ``ctr`` holds the pools' counters; a kernel that may run out of room checks
before it writes and returns 1, leaving its state resumable: the caller grows the pools
(:mod:`jobs.learners.dare.pools`) and calls again.
See docs/learners.md (DaRE)."""

from __future__ import annotations

import numpy as np
from numba import njit

from jobs.learners.dare.search_kernels import (
    _DENSE,
    GREEDY,
    LEAF,
    decide_one,
    drain_groups,
    value_groups,
)

CTR_NFREE, CTR_CFREE, CTR_EUSED, CTR_EGARB, CTR_HUSED, CTR_HGARB, CTR_SP = 0, 1, 2, 3, 4, 5, 6
CTR_NEED_E, CTR_NEED_H = 7, 8
CTR_AT_TREE, CTR_AT_NODE, CTR_NFLAG = 9, 10, 11  # where a resumable deletion stopped
CTR_WORK = 12  # records x levels the builder went through (its cost, for estimates)
CTR_LEN = 13

# a build task on the stack: (node, tree, path, depth, layout start, layout end, lo, hi)
_ND, _TREE, _PATH, _DEPTH, _START, _END, _LO, _HI = 0, 1, 2, 3, 4, 5, 6, 7


@njit(cache=True)
def bound_of(second):
    """What a greedy node keeps of its runner-up score: an upper bound on every other
    scored candidate's score, with room for rounding (a Gini score is computed with a
    relative error below 1e-15); +inf where no bound is known."""
    if second == -np.inf or second == np.inf:
        return second
    return second + 1e-9 * (abs(second) + 1.0)


@njit(cache=True)
def uncache_node(nd, nodes, caches, ctr):
    """Release node nd's cache row (its entries and group tables become garbage)."""
    cid = nodes.cid[nd]
    if cid < 0:
        return
    for ss in range(caches.attr.shape[1]):
        ctr[CTR_EGARB] += caches.length[cid, ss]
        ctr[CTR_HGARB] += caches.table_len[cid, ss]
        caches.attr[cid, ss] = -1
        caches.length[cid, ss] = 0
        caches.table_len[cid, ss] = 0
    nodes.cid[nd] = -1
    caches.free[ctr[CTR_CFREE]] = cid
    ctr[CTR_CFREE] += 1


@njit(cache=True)
def install_cache(cid, caches, entries, tables, lists, ctr, KB):
    """Write one node's lists (:class:`~jobs.learners.dare.search_kernels.NodeLists`) into
    cache row cid, appending its entries and group tables to the pools (room was checked
    by the caller)."""
    C = lists.left.shape[1]
    eu = ctr[CTR_EUSED]
    hu = ctr[CTR_HUSED]
    for ss in range(caches.attr.shape[1]):
        ctr[CTR_EGARB] += caches.length[cid, ss]
        ctr[CTR_HGARB] += caches.table_len[cid, ss]
        caches.attr[cid, ss] = lists.attr[ss]
        caches.all_pairs[cid, ss] = lists.all_pairs[ss]
        caches.cut_prio[cid, ss] = lists.cut_prio[ss]
        caches.cut_value[cid, ss] = lists.cut_value[ss]
        ln = lists.length[ss]
        caches.off[cid, ss] = eu
        caches.length[cid, ss] = ln
        for q in range(ln):
            entries.r1[eu] = lists.r1[ss * KB + q]
            entries.r2[eu] = lists.r2[ss * KB + q]
            for c in range(C):
                entries.left[c, eu] = lists.left[ss * KB + q, c]
            eu += 1
        hl = lists.table_len[ss]
        caches.table_off[cid, ss] = hu
        caches.table_len[cid, ss] = hl
        for q in range(hl):
            tables.rank[hu] = lists.table_rank[lists.table_off[ss] + q]
            for c in range(C):
                tables.cnt[hu, c] = lists.table_cnt[lists.table_off[ss] + q, c]
            hu += 1
    ctr[CTR_EUSED] = eu
    ctr[CTR_HUSED] = hu


@njit(cache=True)
def layout_rows(slot_at: np.ndarray, tree: np.ndarray, s: np.ndarray, e: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """The live records of nodes with layout ranges [s[i], e[i]) of tree[i]: CSR (rows,
    off). One pass to count, one to fill: a node high in a tree holds most records."""
    m = tree.shape[0]
    off = np.zeros(m + 1, np.int64)
    for i in range(m):
        c = 0
        for q in range(s[i], e[i]):
            if slot_at[tree[i], q] >= 0:
                c += 1
        off[i + 1] = off[i] + c
    rows = np.empty(off[m], np.int64)
    for i in range(m):
        j = off[i]
        for q in range(s[i], e[i]):
            sl = slot_at[tree[i], q]
            if sl >= 0:
                rows[j] = sl
                j += 1
    return rows, off


@njit(cache=True)
def gather_rows(slot_at, t, s, e, out, at):
    """Append the live records of tree t's layout range [s, e) (a node's) to out[at:];
    returns the new end."""
    for q in range(s, e):
        sl = slot_at[t, q]
        if sl >= 0:
            out[at] = sl
            at += 1
    return at


@njit(cache=True)
def _free_below(rt, nodes, caches, ctr, dfs):
    """Free every node below rt (and their caches)."""
    top = 0
    if nodes.kind[rt] != LEAF:
        dfs[0] = nodes.left[rt]
        dfs[1] = nodes.right[rt]
        top = 2
    while top > 0:
        top -= 1
        u = dfs[top]
        if nodes.kind[u] != LEAF:
            dfs[top] = nodes.left[u]
            dfs[top + 1] = nodes.right[u]
            top += 2
        uncache_node(u, nodes, caches, ctr)
        nodes.used[u] = False
        nodes.kind[u] = LEAF
        nodes.left[u] = -1
        nodes.right[u] = -1
        nodes.free[ctr[CTR_NFREE]] = u
        ctr[CTR_NFREE] += 1


@njit(cache=True)
def _push(stack, sp, nd, tree, path, depth, s, e, lo, hi):
    stack[sp, _ND] = nd
    stack[sp, _TREE] = tree
    stack[sp, _PATH] = path
    stack[sp, _DEPTH] = depth
    stack[sp, _START] = s
    stack[sp, _END] = e
    stack[sp, _LO] = lo
    stack[sp, _HI] = hi
    return sp + 1


@njit(cache=True)
def prepare_rebuild(roots: np.ndarray, nodes, caches, layout, ctr: np.ndarray,
                    rows: np.ndarray, stack: np.ndarray) -> int:
    """Free everything below each root (and the roots' caches), gather each root's live
    records from the layout into `rows` and push the roots as build tasks on `stack`.
    Returns the number of records gathered."""
    dfs = np.empty(256, np.int64)
    m = 0
    sp = ctr[CTR_SP]
    for i in range(roots.shape[0]):
        rt = roots[i]
        _free_below(rt, nodes, caches, ctr, dfs)
        uncache_node(rt, nodes, caches, ctr)
        lo = m
        m = gather_rows(layout.slot_at, nodes.tree[rt], nodes.start[rt], nodes.end[rt], rows, m)
        sp = _push(stack, sp, rt, nodes.tree[rt], nodes.path[rt], nodes.depth[rt],
                   nodes.start[rt], nodes.end[rt], lo, m)
    ctr[CTR_SP] = sp
    return m


@njit(cache=True)
def build_subtrees(stack: np.ndarray, ctr: np.ndarray, rows: np.ndarray, nodes, caches,
                   entries, tables, recs, layout, rule, tab: np.ndarray, w, lists,
                   cnt: np.ndarray) -> int:
    """Grow the subtrees of the tasks on `stack`, depth first, from their records (ranges
    of `rows`, partitioned in place): every node is :func:`decide_one` of its records;
    greedy nodes with at least cache_min records keep their lists; leaves place their
    records in the layout. Returns 0 when done, 1 when a pool is short (the caller grows
    the pools, ctr[CTR_NEED_H] says how many group table entries, and calls again).

    One loop, not steps: with the split search it is a fit's time (and a retrain's), and
    splitting it cost a tenth of that."""
    n_tree, n_depth, n_path, n_kind, n_why = (nodes.tree, nodes.depth, nodes.path, nodes.kind,
                                              nodes.why)
    n_left, n_right, n_attr, n_thr = nodes.left, nodes.right, nodes.attr, nodes.thr
    n_r1, n_r2, n_draw, n_n, n_cnt = nodes.r1, nodes.r2, nodes.draw, nodes.n, nodes.cnt
    n_s, n_e, n_cid, n_used = nodes.start, nodes.end, nodes.cid, nodes.used
    nfree, n_bound, n_sattr = nodes.free, nodes.bound, nodes.sampled
    cfree = caches.free
    s_attr = lists.attr
    samp, pos = layout.slot_at, layout.pos
    rank, X = recs.rank, recs.X
    P, cache_min, hist_ratio = rule.n_sampled, rule.cache_min, rule.hist_ratio
    KB = rule.k + rule.buffer
    C = cnt.shape[0]
    ecap = entries.r1.shape[0]
    hcap = tables.rank.shape[0]
    sp = ctr[CTR_SP]
    while sp > 0:
        nd = stack[sp - 1, _ND]
        tree = stack[sp - 1, _TREE]
        path = stack[sp - 1, _PATH]
        depth = stack[sp - 1, _DEPTH]
        s = stack[sp - 1, _START]
        e = stack[sp - 1, _END]
        lo = stack[sp - 1, _LO]
        hi = stack[sp - 1, _HI]
        n = hi - lo
        need_h = P * (n // hist_ratio + 1)
        if (ctr[CTR_NFREE] < 2 or ctr[CTR_CFREE] < 1 or ctr[CTR_EUSED] + P * KB > ecap
                or ctr[CTR_HUSED] + need_h > hcap):
            ctr[CTR_SP] = sp
            ctr[CTR_NEED_E] = P * KB
            ctr[CTR_NEED_H] = need_h
            return 1
        sp -= 1
        d = decide_one(rows, lo, hi, tree, path, depth, True, recs, rule, tab, w, lists, cnt)
        kind, why, attr, thr, r1, r2 = d.kind, d.why, d.attr, d.thr, d.r1, d.r2
        ctr[CTR_WORK] += n
        n_used[nd] = True
        n_tree[nd] = tree
        n_depth[nd] = depth
        n_path[nd] = path
        n_n[nd] = n
        for c in range(C):
            n_cnt[nd, c] = cnt[c]
        n_s[nd] = s
        n_e[nd] = e
        n_kind[nd] = kind
        n_why[nd] = why
        n_attr[nd] = attr
        n_thr[nd] = thr
        n_r1[nd] = r1
        n_r2[nd] = r2
        n_draw[nd] = d.draw
        n_cid[nd] = -1
        if kind == GREEDY:
            n_bound[nd] = bound_of(d.second)
            for ss in range(P):
                n_sattr[nd, ss] = s_attr[ss]
        if kind == GREEDY and n >= cache_min:
            cid = cfree[ctr[CTR_CFREE] - 1]
            ctr[CTR_CFREE] -= 1
            install_cache(cid, caches, entries, tables, lists, ctr, KB)
            n_cid[nd] = cid
        if kind == LEAF:
            n_left[nd] = -1
            n_right[nd] = -1
            for i in range(n):
                sl = rows[lo + i]
                samp[tree, s + i] = sl
                pos[tree, sl] = s + i
            for q in range(s + n, e):
                samp[tree, q] = -1
            continue
        i = lo
        j = hi - 1
        while i <= j:
            sl = rows[i]
            go = rank[sl, attr] <= r1 if kind == GREEDY else X[attr, sl] <= thr
            if go:
                i += 1
            else:
                rows[i] = rows[j]
                rows[j] = sl
                j -= 1
        nl = i - lo
        nf = ctr[CTR_NFREE]
        lk = nfree[nf - 1]
        rk = nfree[nf - 2]
        ctr[CTR_NFREE] = nf - 2
        n_used[lk] = True
        n_used[rk] = True
        n_left[nd] = lk
        n_right[nd] = rk
        stack[sp, _ND] = rk
        stack[sp, _TREE] = tree
        stack[sp, _PATH] = (path << 1) | 1
        stack[sp, _DEPTH] = depth + 1
        stack[sp, _START] = s + nl
        stack[sp, _END] = e
        stack[sp, _LO] = lo + nl
        stack[sp, _HI] = hi
        sp += 1
        stack[sp, _ND] = lk
        stack[sp, _TREE] = tree
        stack[sp, _PATH] = path << 1
        stack[sp, _DEPTH] = depth + 1
        stack[sp, _START] = s
        stack[sp, _END] = s + nl
        stack[sp, _LO] = lo
        stack[sp, _HI] = lo + nl
        sp += 1
    ctr[CTR_SP] = 0
    return 0


@njit(cache=True)
def node_tables(todo: np.ndarray, nodes, caches, tables, recs, layout, ctr: np.ndarray,
                hist_ratio: int, w) -> int:
    """(Re)compute the value group tables of the cached slots of nodes `todo` from their
    records (after loading a saved forest, which does not store them). Returns 1 if the
    group table pool is short (nothing written for the node it stopped at; call again
    with the remaining nodes, from ctr[CTR_SP]).

    A node's slots of few values are counted in one pass over its records, each
    record's ranks read once for all of them (a pass per slot missed the cache once per
    record and slot: 100 s at 10^6 rows); the others are counted by sorting, per slot.
    A node's sampled attributes are distinct, so each slot has its own counts."""
    C = w.g_cnt.shape[1]
    P = caches.attr.shape[1]
    rows = np.empty(max(layout.slot_at.shape[1], 1), np.int64)
    # every attribute's dense counts side by side: value q of attribute a at voff[a] + q
    dense = np.zeros(recs.voff[-1] * C, np.int64)
    dtot = np.zeros(recs.voff[-1], np.int64)
    few = np.empty(P, np.int64)  # the node's attributes counted densely
    for i in range(ctr[CTR_SP], todo.shape[0]):
        nd = todo[i]
        cid = nodes.cid[nd]
        if cid < 0:
            continue
        if ctr[CTR_HUSED] + P * (nodes.n[nd] // hist_ratio + 1) > tables.rank.shape[0]:
            ctr[CTR_SP] = i
            ctr[CTR_NEED_H] = P * (nodes.n[nd] // hist_ratio + 1)
            return 1
        m = gather_rows(layout.slot_at, nodes.tree[nd], nodes.start[nd], nodes.end[nd], rows, 0)
        n_few = 0
        for ss in range(P):
            ctr[CTR_HGARB] += caches.table_len[cid, ss]
            caches.table_len[cid, ss] = 0
            a = caches.attr[cid, ss]
            if a >= 0 and recs.voff[a + 1] - recs.voff[a] <= _DENSE * m:
                few[n_few] = a
                n_few += 1
        if n_few > 0:
            for j in range(m):
                r = rows[j]
                yr = recs.y[r]
                for k in range(n_few):
                    q = recs.voff[few[k]] + np.int64(recs.rank[r, few[k]])
                    dense[q * C + yr] += 1
                    dtot[q] += 1
        for ss in range(P):
            a = caches.attr[cid, ss]
            if a < 0:
                continue
            nv = recs.voff[a + 1] - recs.voff[a]
            if nv <= _DENSE * m:
                ng = drain_groups(dense, dtot, recs.voff[a], nv, C, w.g_rank, w.g_cnt)
            else:
                ng = value_groups(rows, 0, m, a, recs.rank, recs.y, nv, C, w.keys, w.tmp,
                                  w.dense, w.dense_tot, w.g_rank, w.g_cnt)
            if ng * hist_ratio > m:
                continue
            hu = ctr[CTR_HUSED]
            caches.table_off[cid, ss] = hu
            caches.table_len[cid, ss] = ng
            for g in range(ng):
                tables.rank[hu + g] = w.g_rank[g]
                for c in range(C):
                    tables.cnt[hu + g, c] = w.g_cnt[g, c]
            ctr[CTR_HUSED] = hu + ng
    ctr[CTR_SP] = todo.shape[0]
    return 0
