"""Compiled (numba) deletion of one record from a DaRE forest (:mod:`jobs.learners.dare.forest`).

:func:`delete_record` walks the record's path in every tree, updates the counts, the
cached candidate lists and value group tables, and re-checks every node on the path
against its stored split; it never retrains (the caller rebuilds the outermost changed
nodes with :func:`jobs.learners.dare.build_kernels.build_subtrees`). Where a node must be
re-derived from its records it calls the same
:func:`~jobs.learners.dare.search_kernels.decide_one` as training, and a cached node's
candidates are re-scored with the same :func:`~jobs.learners.dare.search_kernels.score1`,
so an update makes a retrain's choices bit for bit.

Ties. A cached slot on an attribute with few distinct values in its node (at most one per
``hist_ratio`` records when the cache was built) keeps the node's value group table: the
class counts of every value the node holds, in value order. The deleted record's group,
its neighbours and their counts are then a binary search away; without the table they
are counted from the records that share the value, which on a tied attribute is most of
the node (or of the training set).

The pools and records are the named tuples of :mod:`jobs.learners.dare.state` (``order``
is its :class:`~jobs.learners.dare.state.GlobalOrder`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from jobs.learners.dare.build_kernels import (
    CTR_AT_NODE,
    CTR_AT_TREE,
    CTR_EGARB,
    CTR_EUSED,
    CTR_HGARB,
    CTR_HUSED,
    CTR_LEN,
    CTR_NEED_E,
    CTR_NEED_H,
    CTR_NFLAG,
    bound_of,
    gather_rows,
    install_cache,
    uncache_node,
)
from jobs.learners.dare.search_kernels import (
    _S32,
    _TAG_THR,
    GREEDY,
    LEAF,
    RANDOM,
    W_DEPTH,
    W_PURE,
    W_SMALL,
    decide_one,
    h2,
    midpoint,
    mix,
    score1,
)

__all__ = ["CTR_LEN", "STAT_CACHES", "STAT_NODES", "delete_record"]

STAT_NODES, STAT_CACHES = 0, 1


class _Touching(NamedTuple):
    """The live listed pairs of a slot that touch the deleted value w: A = (prev, w),
    B = (w, next) (entry, -1: not listed) and their positions among the live entries
    (the first k are the scored ones)."""

    a: int
    b: int
    a_pos: int
    b_pos: int


class _Scratch(NamedTuple):
    """Class count rows of one deletion: w's group, its neighbours, score rows."""

    gw: np.ndarray
    gp: np.ndarray
    gn: np.ndarray
    left_row: np.ndarray  # (1, C)
    right_row: np.ndarray


@njit(cache=True)
def _group_counts(g, nd, a, q, nodes, order, recs, layout):
    """g[:] = class counts of node nd's live records whose `a` value has rank q: from the
    node's layout range or the value's run in the global order, whichever is shorter."""
    g[:] = 0
    t, s, e = nodes.tree[nd], nodes.start[nd], nodes.end[nd]
    ro = order.roff[a] + q
    if e - s < order.rstart[ro + 1] - order.rstart[ro]:
        for p_ in range(s, e):
            sl = layout.slot_at[t, p_]
            if sl >= 0 and recs.rank[sl, a] == q:
                g[recs.y[sl]] += 1
        return
    for i in range(order.rstart[ro], order.rstart[ro + 1]):
        sl = order.gorder[a, i]
        if order.alive[sl]:
            ps = layout.pos[t, sl]
            if ps >= s and ps < e:
                g[recs.y[sl]] += 1


@njit(cache=True)
def _group_of(g, ht, q, nd, a, nodes, order, recs, layout, tables):
    """g[:] = class counts of node nd's value group of rank q: row ht of its value group
    table where it keeps one (ht >= 0), else counted from its records."""
    if ht >= 0:
        for cc in range(g.shape[0]):
            g[cc] = tables.cnt[ht, cc]
    else:
        _group_counts(g, nd, a, q, nodes, order, recs, layout)


@njit(cache=True)
def _valid(g1, g2):
    """A pair of adjacent value groups is valid unless both are pure with the same label."""
    n1 = 0
    l1 = -1
    n2 = 0
    l2 = -1
    for c in range(g1.shape[0]):
        if g1[c] > 0:
            n1 += 1
            l1 = c
        if g2[c] > 0:
            n2 += 1
            l2 = c
    return not (n1 == 1 and n2 == 1 and l1 == l2)


@njit(cache=True)
def _neighbour(nd, a, wr, up, nodes, order, recs, layout):
    """Rank of the nearest value of `a` among node nd's live records strictly above (up)
    or below wr; -1 if none. Scans the node's layout range or walks the attribute's
    global order, whichever is shorter (same answer)."""
    t, s, e, n = nodes.tree[nd], nodes.start[nd], nodes.end[nd], nodes.n[nd]
    gorder = order.gorder
    G = gorder.shape[1]
    if (e - s) <= 2 * G // max(n, 1) + 16:
        res = -1
        for q in range(s, e):
            sl = layout.slot_at[t, q]
            if sl >= 0:
                rk = np.int64(recs.rank[sl, a])
                if up:
                    if rk > wr and (res < 0 or rk < res):
                        res = rk
                elif rk < wr and rk > res:
                    res = rk
        return res
    ro = order.roff[a] + wr
    if up:
        for i in range(order.rstart[ro + 1], G):
            sl = gorder[a, i]
            if order.alive[sl]:
                ps = layout.pos[t, sl]
                if ps >= s and ps < e:
                    return np.int64(recs.rank[sl, a])
    else:
        for i in range(order.rstart[ro] - 1, -1, -1):
            sl = gorder[a, i]
            if order.alive[sl]:
                ps = layout.pos[t, sl]
                if ps >= s and ps < e:
                    return np.int64(recs.rank[sl, a])
    return -1


@njit(cache=True)
def _prio(sk, vmix, va, r):
    return np.int64(mix(sk ^ vmix[va + r]) >> _S32)


@njit(cache=True)
def _scan_entries(off, ln, wr, c, entries):
    """Decrement the left counts of the listed pairs at or above w's rank wr (record of
    class c left their left side) and find the pairs that touch w."""
    A = -1
    B = -1
    live = 0
    posA = 0
    posB = 0
    for E_ in range(off, off + ln):
        r1 = entries.r1[E_]
        if r1 < 0:
            continue
        if r1 >= wr:
            entries.left[c, E_] -= 1
        if entries.r2[E_] == wr:
            A = E_
            posA = live
        if r1 == wr:
            B = E_
            posB = live
        live += 1
    return _Touching(A, B, posA, posB)


@njit(cache=True)
def _table_group(rank, hoff, hl, wr):
    """Row of value rank wr in a value group table (present: the record was in the node)."""
    lo = hoff
    hi = hoff + hl - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if rank[mid] < wr:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _drop_table_group(tables, hp, hoff, hl):
    """Remove row hp from a value group table (w's value vanished from the node), so
    that its neighbours become adjacent."""
    C = tables.cnt.shape[1]
    for q in range(hp, hoff + hl - 1):
        tables.rank[q] = tables.rank[q + 1]
        for cc in range(C):
            tables.cnt[q, cc] = tables.cnt[q + 1, cc]


@njit(cache=True)
def _drop_invalid(tp, hp, k, nd, a, nodes, entries, tables, recs, layout, order, sc):
    """w's group survives (counts in sc.gw): the pairs touching it can only turn invalid.
    Returns whether one of the scored pairs died."""
    touched = False
    if tp.a >= 0:
        _group_of(sc.gp, hp - 1 if hp >= 0 else -1, entries.r1[tp.a], nd, a, nodes, order,
                  recs, layout, tables)
        if not _valid(sc.gp, sc.gw):
            entries.r1[tp.a] = -1
            touched |= tp.a_pos < k
    if tp.b >= 0:
        _group_of(sc.gn, hp + 1 if hp >= 0 else -1, entries.r2[tp.b], nd, a, nodes, order,
                  recs, layout, tables)
        if not _valid(sc.gw, sc.gn):
            entries.r1[tp.b] = -1
            touched |= tp.b_pos < k
    return touched


@njit(cache=True)
def _next_above(bnext, hp, hoff, hl, nd, a, wr, nodes, order, recs, layout, tables):
    """Rank of the node's next value above the vanished w (B's upper value if it was
    listed); -1 if none."""
    if bnext >= 0:
        return bnext
    if hp >= 0:
        return tables.rank[hp] if hp < hoff + hl else -1
    return _neighbour(nd, a, wr, True, nodes, order, recs, layout)


@njit(cache=True)
def _pair_valid(prev, nxt, hp, nd, a, nodes, order, recs, layout, tables, sc):
    """Whether (prev, nxt), adjacent once w vanished, is a valid pair (their groups in
    sc.gp and sc.gn)."""
    _group_of(sc.gp, hp - 1 if hp >= 0 else -1, prev, nd, a, nodes, order, recs, layout,
              tables)
    _group_of(sc.gn, hp if hp >= 0 else -1, nxt, nd, a, nodes, order, recs, layout, tables)
    return _valid(sc.gp, sc.gn)


@njit(cache=True)
def _left_of(g, prev, B, hp, hoff, nd, a, nodes, entries, recs, layout, tables):
    """g[:] = left class counts of the pair (prev, next): B's (its left side is the same
    records), the table's groups up to prev, or counted from the node's records."""
    C = g.shape[0]
    if B >= 0:
        for cc in range(C):
            g[cc] = entries.left[cc, B]
    elif hp >= 0:
        g[:] = 0
        for q in range(hoff, hp):
            for cc in range(C):
                g[cc] += tables.cnt[q, cc]
    else:
        g[:] = 0
        t = nodes.tree[nd]
        for q in range(nodes.start[nd], nodes.end[nd]):
            sl = layout.slot_at[t, q]
            if sl >= 0 and recs.rank[sl, a] <= prev:
                g[recs.y[sl]] += 1


@njit(cache=True)
def _insert_pair(cid, ss, prev, nxt, h, v, sk, va, g, caches, entries, recs, ctr):
    """Copy slot ss's live entries to a fresh segment at the end of the entry pool (the
    caller made room), the pair (prev, nxt) with left counts g at its priority position
    (h, v). Returns its position among the live entries."""
    off = caches.off[cid, ss]
    ln = caches.length[cid, ss]
    er1, er2, eleft = entries.r1, entries.r2, entries.left
    C = g.shape[0]
    nb = 0
    for E_ in range(off, off + ln):
        if er1[E_] >= 0:
            eh = _prio(sk, recs.vmix, va, er1[E_])
            if eh < h or (eh == h and recs.vals[va + er1[E_]] < v):
                nb += 1
    start = ctr[CTR_EUSED]
    d = start
    j = 0
    for E_ in range(off, off + ln):
        if er1[E_] < 0:
            continue
        if j == nb:
            d += 1
        er1[d] = er1[E_]
        er2[d] = er2[E_]
        for cc in range(C):
            eleft[cc, d] = eleft[cc, E_]
        d += 1
        j += 1
    di = start + nb
    er1[di] = prev
    er2[di] = nxt
    for cc in range(C):
        eleft[cc, di] = g[cc]
    ctr[CTR_EUSED] = start + j + 1
    ctr[CTR_EGARB] += ln
    caches.off[cid, ss] = start
    caches.length[cid, ss] = j + 1
    return nb


@njit(cache=True)
def _insert_merged(nd, nk, cid, ss, a, wr, B, bnext, hp, hoff, hl, k, nodes, caches,
                   entries, tables, recs, layout, order, ctr, sc):
    """w's value vanished and no listed pair ended at it: the merged pair (prev, next)
    that was not listed may now be valid and under the slot's cut-off; if so it is
    inserted at its priority position. Returns whether it lands among the scored ones."""
    if hp >= 0:
        prev = tables.rank[hp - 1] if hp > hoff else -1
    else:
        prev = _neighbour(nd, a, wr, False, nodes, order, recs, layout)
    if prev < 0:
        return False
    va = recs.voff[a]
    sk = h2(nk ^ _TAG_THR, np.uint64(a))
    h = _prio(sk, recs.vmix, va, prev)
    v = recs.vals[va + prev]
    cp = caches.cut_prio[cid, ss]
    if not (caches.all_pairs[cid, ss] or h < cp or (h == cp and v <= caches.cut_value[cid, ss])):
        return False
    nxt = _next_above(bnext, hp, hoff, hl, nd, a, wr, nodes, order, recs, layout, tables)
    if nxt < 0:
        return False
    if not _pair_valid(prev, nxt, hp, nd, a, nodes, order, recs, layout, tables, sc):
        return False
    _left_of(sc.gp, prev, B, hp, hoff, nd, a, nodes, entries, recs, layout, tables)
    return _insert_pair(cid, ss, prev, nxt, h, v, sk, va, sc.gp, caches, entries, recs,
                        ctr) < k


@njit(cache=True)
def _cached_repair(nd, nk, r, c, k, nodes, caches, entries, tables, recs, layout, order, ctr,
                   sc):
    """Incremental update of cached greedy node nd's lists after record r (class c) left
    it (the record is already dead and out of the layout, the node's counts already
    decremented).

    Per slot: decrement the left counts of cached pairs at or above r's value w and, in
    the value group table, w's count; repair the pairs (prev, w) and (w, next), and when
    w's value group vanished from the node consider the merged pair (prev, next) under the
    slot's cut-off (inserted at its priority position into a fresh copy of the segment at
    the end of the entry pool, for which the caller made room).

    Returns (changed, r2): changed if a slot's first k live pairs, the ones scored, are
    not the same pairs as before (one of them died, or a pair was inserted among them; a
    pair that only moved its upper value keeps its left counts, so it is the same
    candidate); r2 >= 0 is the stored split's new upper value if its pair moved it."""
    cid = nodes.cid[nd]
    touched = False
    best_r2 = -1
    for ss in range(caches.attr.shape[1]):
        a = caches.attr[cid, ss]
        if a < 0:
            continue
        wr = np.int64(recs.rank[r, a])
        tp = _scan_entries(caches.off[cid, ss], caches.length[cid, ss], wr, c, entries)
        hl = caches.table_len[cid, ss]
        hoff = caches.table_off[cid, ss]
        hp = -1
        if hl > 0:
            hp = _table_group(tables.rank, hoff, hl, wr)
            tables.cnt[hp, c] -= 1
            for cc in range(sc.gw.shape[0]):
                sc.gw[cc] = tables.cnt[hp, cc]
        else:
            sc.gw[:] = 0
            ro = order.roff[a] + wr
            if order.rstart[ro + 1] - order.rstart[ro] > 1:
                _group_counts(sc.gw, nd, a, wr, nodes, order, recs, layout)
        if sc.gw.sum() > 0:
            touched |= _drop_invalid(tp, hp, k, nd, a, nodes, entries, tables, recs, layout,
                                     order, sc)
            continue
        if hl > 0:
            _drop_table_group(tables, hp, hoff, hl)
            hl -= 1
            caches.table_len[cid, ss] = hl
            ctr[CTR_HGARB] += 1
        # w's group vanished: (prev, w) becomes (prev, next); (w, next) disappears
        bnext = -1
        if tp.b >= 0:
            bnext = entries.r2[tp.b]
            entries.r1[tp.b] = -1
            touched |= tp.b_pos < k
        if tp.a >= 0:
            nxt = _next_above(bnext, hp, hoff, hl, nd, a, wr, nodes, order, recs, layout,
                              tables)
            prev = entries.r1[tp.a]
            if nxt >= 0 and _pair_valid(prev, nxt, hp, nd, a, nodes, order, recs, layout,
                                        tables, sc):
                entries.r2[tp.a] = nxt
                if a == nodes.attr[nd] and prev == nodes.r1[nd]:
                    best_r2 = nxt
            else:
                entries.r1[tp.a] = -1
                touched |= tp.a_pos < k
            continue
        if caches.all_pairs[cid, ss] and tp.b < 0:
            continue
        touched |= _insert_merged(nd, nk, cid, ss, a, wr, tp.b, bnext, hp, hoff, hl, k,
                                  nodes, caches, entries, tables, recs, layout, order, ctr, sc)
    return touched, best_r2


@njit(cache=True)
def _cached_score(nd, nodes, caches, entries, rule, tab, sc):
    """Re-score the first k live pairs of each slot of cached node nd.

    Returns a status (0 same split, 1 same split with a new v2, 2 best split changed, 3
    the cache must be recomputed: a slot holds fewer than k pairs and not every valid
    one), the new r2 and the runner-up score (status 0 and 1)."""
    k, msl, gini = rule.k, rule.min_samples_leaf, rule.gini
    Lb, Rb = sc.left_row, sc.right_row
    C = nodes.cnt.shape[1]
    cid = nodes.cid[nd]
    n = nodes.n[nd]
    best_sc = -np.inf
    second = -np.inf
    best = -1
    battr = -1
    for ss in range(caches.attr.shape[1]):
        a = caches.attr[cid, ss]
        if a < 0:
            continue
        off = caches.off[cid, ss]
        nval = 0
        for E_ in range(off, off + caches.length[cid, ss]):
            if entries.r1[E_] >= 0:
                nval += 1
        if (nval < k and not caches.all_pairs[cid, ss]) or nval == 0:
            return 3, -1, np.inf  # (whatever was scored so far is moot)
        taken = 0
        for E_ in range(off, off + caches.length[cid, ss]):
            if taken >= k:
                break
            if entries.r1[E_] < 0:
                continue
            taken += 1
            nl = np.int64(0)
            for cc in range(C):
                Lb[0, cc] = entries.left[cc, E_]
                nl += Lb[0, cc]
            nr = np.int64(n) - nl
            if nl >= msl and nr >= msl:
                for cc in range(C):
                    Rb[0, cc] = np.int64(nodes.cnt[nd, cc]) - Lb[0, cc]
                s_ = score1(Lb, 0, Rb, 0, nl, nr, gini, tab)
                if s_ > best_sc:
                    second = best_sc
                    best_sc = s_
                    best = E_
                    battr = a
                elif s_ > second:
                    second = s_
    if best >= 0 and battr == nodes.attr[nd] and entries.r1[best] == nodes.r1[nd]:
        if not gini:
            second = np.inf
        return (1 if entries.r2[best] != nodes.r2[nd] else 0), np.int64(entries.r2[best]), second
    return 2, -1, np.inf


@njit(cache=True)
def _groups_unchanged(nd, r, c, nodes, recs, layout):
    """Whether the valid pairs of every attribute sampled at uncached node nd are the same
    after record r (class c) left it: true unless the record's value group, on some
    sampled attribute, vanished from the node or became pure (the only ways a pair can
    appear, disappear or merge). Counts the groups from the node's records."""
    t, s, e = nodes.tree[nd], nodes.start[nd], nodes.end[nd]
    for ss in range(nodes.sampled.shape[1]):
        a = nodes.sampled[nd, ss]
        if a < 0:
            continue
        wr = np.int64(recs.rank[r, a])
        other = -1  # a class other than c seen in w's group; -2: two of them
        same = False  # a record of class c seen in w's group
        for q in range(s, e):
            sl = layout.slot_at[t, q]
            if sl >= 0 and recs.rank[sl, a] == wr:
                lab = recs.y[sl]
                if lab == c:
                    same = True
                elif other == -1:
                    other = lab
                elif other != lab:
                    other = -2
            if same and other != -1:
                break  # not pure: unchanged
        if other == -1 and not same:
            return False  # vanished
        if not same and other >= 0:
            return False  # only one other class left: the group turned pure
    return True


@njit(cache=True)
def _split_score(nd, nxt, c, nodes, rule, tab, sc):
    """Score of greedy node nd's stored split from its children's counts, after record r
    (class c, on its way to child nxt, whose counts are not yet decremented) left it;
    -inf if a side now holds fewer than msl records."""
    Lb, Rb = sc.left_row, sc.right_row
    C = nodes.cnt.shape[1]
    lk = nodes.left[nd]
    nl = np.int64(0)
    for cc in range(C):
        Lb[0, cc] = nodes.cnt[lk, cc]
    if nxt == lk:
        Lb[0, c] -= 1
    for cc in range(C):
        nl += Lb[0, cc]
        Rb[0, cc] = np.int64(nodes.cnt[nd, cc]) - Lb[0, cc]
    nr = np.int64(nodes.n[nd]) - nl
    if nl < rule.min_samples_leaf or nr < rule.min_samples_leaf:
        return -np.inf
    return score1(Lb, 0, Rb, 0, nl, nr, rule.gini, tab)


@njit(cache=True)
def _drift(b):
    """A greedy node's bound on its other candidates' scores after one more deletion: a
    Gini score (sum L_c^2 / n_l + sum R_c^2 / n_r) grows by less than 1 when a record
    leaves (on its side: (n_l - 2) / n_l at most), plus room for rounding."""
    if b == -np.inf or b == np.inf:
        return b
    return b + 1.0 + 1e-9 * (abs(b) + 1.0)


@njit(cache=True)
def _set_r2(nd, r2, nodes, recs):
    """Same split, new upper value: move the threshold to the new midpoint."""
    va = recs.voff[nodes.attr[nd]]
    nodes.r2[nd] = r2
    nodes.thr[nd] = midpoint(recs.vals[va + nodes.r1[nd]], recs.vals[va + r2])


@njit(cache=True)
def _greedy_changed(nd, nxt, r, c, nodes, caches, entries, tables, recs, layout, order, rule,
                    tab, w, lists, cnt, rbuf, ctr, stats, sc):
    """Update greedy node nd (not pure, not too small) after record r (class c, on its way
    to child nxt) left it; returns whether its canonical split now differs from the stored
    one.

    A node whose other candidates' scores are bounded (nodes.bound: the runner-up at the
    last full scoring, plus what the deletions since can have added) keeps its split
    without re-scoring when the candidates are the same pairs as then and the split still
    beats the bound; otherwise a cached node re-scores its lists, an uncached one is
    re-derived from its records (and a cache that ran short is recomputed)."""
    P = rule.n_sampled
    KB = rule.k + rule.buffer
    n = nodes.n[nd]
    cid = nodes.cid[nd]
    if cid >= 0 and n < rule.cache_min:
        for ss in range(P):  # the cache's attributes are the node's sampled ones
            nodes.sampled[nd, ss] = caches.attr[cid, ss]
        uncache_node(nd, nodes, caches, ctr)
        cid = -1
    bound = _drift(nodes.bound[nd])
    nodes.bound[nd] = np.inf
    if cid >= 0:
        nk = h2(recs.tree_keys[nodes.tree[nd]], np.uint64(nodes.path[nd]))
        touched, nr2 = _cached_repair(nd, nk, r, c, rule.k, nodes, caches, entries, tables,
                                      recs, layout, order, ctr, sc)
        if not touched and bound < np.inf and _split_score(nd, nxt, c, nodes, rule, tab,
                                                           sc) > bound:
            if nr2 >= 0:
                _set_r2(nd, nr2, nodes, recs)
            nodes.bound[nd] = bound
            return False
        st, nr2, second = _cached_score(nd, nodes, caches, entries, rule, tab, sc)
        if st == 0 or st == 1:
            if st == 1:
                _set_r2(nd, nr2, nodes, recs)
            nodes.bound[nd] = bound_of(second)
            return False
        if st == 2:
            return True
        stats[STAT_CACHES] += 1
    elif bound < np.inf and _groups_unchanged(nd, r, c, nodes, recs, layout) and _split_score(
            nd, nxt, c, nodes, rule, tab, sc) > bound:
        nodes.bound[nd] = bound
        return False
    m = gather_rows(nd, nodes, layout, rbuf, 0)
    d = decide_one(rbuf, 0, m, nodes.tree[nd], nodes.path[nd], nodes.depth[nd], cid >= 0,
                   recs, rule, tab, w, lists, cnt)
    flag = True
    if d.kind == GREEDY and d.attr == nodes.attr[nd] and d.r1 == nodes.r1[nd]:
        flag = False
        if d.r2 != nodes.r2[nd]:
            _set_r2(nd, d.r2, nodes, recs)
        nodes.bound[nd] = bound_of(d.second)
        for ss in range(P):
            nodes.sampled[nd, ss] = lists.attr[ss]
    if cid >= 0 and d.kind == GREEDY and m >= rule.cache_min:
        # a cache is a function of the node's records alone: install it even where the
        # split changed (correct if it flips back)
        install_cache(cid, caches, entries, tables, lists, ctr, KB)
    return flag


@njit(cache=True)
def outermost(root: np.ndarray, dirty: np.ndarray, kind: np.ndarray, left: np.ndarray,
              right: np.ndarray) -> np.ndarray:
    """The dirty nodes with no dirty ancestor (each tree walked down to its first ones)."""
    out = np.empty(dirty.shape[0], np.int64)
    m = 0
    stack = np.empty(256, np.int64)
    for t in range(root.shape[0]):
        stack[0] = root[t]
        top = 1
        while top > 0:
            top -= 1
            u = stack[top]
            if dirty[u]:
                out[m] = u
                m += 1
            elif kind[u] != LEAF:
                stack[top] = left[u]
                stack[top + 1] = right[u]
                top += 2
    return out[:m]


@njit(cache=True)
def _short_of_room(nd, nodes, caches, entries, tables, rule, ctr):
    """Whether the entry or group table pool may not hold what updating cached greedy
    node nd writes (its rewritten segments and a recomputed cache); says how much."""
    cid = nodes.cid[nd]
    if nodes.kind[nd] != GREEDY or cid < 0:
        return False
    P = rule.n_sampled
    need_e = P * (rule.k + rule.buffer)
    for ss in range(P):
        need_e += caches.length[cid, ss] + 1
    need_h = P * (nodes.n[nd] // rule.hist_ratio + 1)
    if (ctr[CTR_EUSED] + need_e > entries.r1.shape[0]
            or ctr[CTR_HUSED] + need_h > tables.rank.shape[0]):
        ctr[CTR_NEED_E] = need_e
        ctr[CTR_NEED_H] = need_h
        return True
    return False


@njit(cache=True)
def _leaf_changed(nd, nodes, recs, layout, rule, tab, w, lists, cnt, rbuf):
    """Whether leaf nd (its counts already decremented) must now split. A leaf's reason
    follows its counts; one that was constant or too small to split is re-derived."""
    n = nodes.n[nd]
    if nodes.why[nd] <= W_PURE:
        if nodes.depth[nd] >= rule.max_depth:
            nodes.why[nd] = W_DEPTH
        elif n < 2 * rule.min_samples_leaf:
            nodes.why[nd] = W_SMALL
        else:
            nodes.why[nd] = W_PURE
        return False
    m = gather_rows(nd, nodes, layout, rbuf, 0)
    d = decide_one(rbuf, 0, m, nodes.tree[nd], nodes.path[nd], nodes.depth[nd], False, recs,
                   rule, tab, w, lists, cnt)
    if d.kind == LEAF:
        nodes.why[nd] = d.why
        return False
    return True


@njit(cache=True)
def _random_changed(nd, nxt, domchg, nodes):
    """Whether random node nd's draw no longer stands: a side emptied (the record goes to
    nxt, whose counts are not yet decremented), it fell back, or its domain moved."""
    lk = nodes.left[nd]
    rk = nodes.right[nd]
    nl = nodes.n[lk] - (1 if nxt == lk else 0)
    nr = nodes.n[rk] - (1 if nxt == rk else 0)
    return nl == 0 or nr == 0 or nodes.draw[nd] < 0 or domchg[nodes.attr[nd]]


@njit(cache=True)
def delete_record(r: int, c: int, stop: bool, domchg: np.ndarray, dirty: np.ndarray,
                  flagged: np.ndarray, nodes, caches, entries, tables, recs, layout, order,
                  rule, tab: np.ndarray, w, lists, cnt: np.ndarray, rbuf: np.ndarray,
                  ctr: np.ndarray, stats: np.ndarray) -> int:
    """Remove record r (class c; already dead and out of the layout) from the counts, caches
    and value tables of the nodes on its paths, WITHOUT retraining: each node is
    re-evaluated against its stored split, and a tree's walk ends at the first node whose
    canonical state now differs (random nodes on an attribute with domchg set differ): the
    caller retrains it from its records, so nothing below it needs updating.

    stop (a deletion on its own): flagged[:m] gets those nodes. Otherwise (one record of a
    batch) dirty[node] is set for them, and the walk also ends at a node already dirty: it
    is retrained once, after the batch, whatever the rest of the batch does to it.

    Returns m (the number of flagged nodes; 0 without stop), or -1 when the entry or group
    table pool is short for the next node (ctr[CTR_NEED_E], ctr[CTR_NEED_H] say how much
    room to make): the walk stops before touching that node and resumes there
    (ctr[CTR_AT_TREE], ctr[CTR_AT_NODE]) when called again with the same ctr."""
    C = nodes.cnt.shape[1]
    T = layout.root.shape[0]
    sc = _Scratch(np.zeros(C, np.int64), np.zeros(C, np.int64), np.zeros(C, np.int64),
                  np.zeros((1, C), np.int64), np.zeros((1, C), np.int64))
    nflag = ctr[CTR_NFLAG]
    for t in range(ctr[CTR_AT_TREE], T):
        nd = layout.root[t]
        if ctr[CTR_AT_NODE] >= 0:
            nd = ctr[CTR_AT_NODE]
            ctr[CTR_AT_NODE] = -1
        while True:
            if not stop and dirty[nd]:
                # its parent reads its counts (a random node's empty child, a greedy
                # node's split score): they follow the records; nothing else does
                nodes.n[nd] -= 1
                nodes.cnt[nd, c] -= 1
                break
            if _short_of_room(nd, nodes, caches, entries, tables, rule, ctr):
                ctr[CTR_AT_TREE] = t
                ctr[CTR_AT_NODE] = nd
                ctr[CTR_NFLAG] = nflag
                return -1
            kind = nodes.kind[nd]
            nxt = -1
            if kind != LEAF:
                a = nodes.attr[nd]
                go = (recs.rank[r, a] <= nodes.r1[nd] if kind == GREEDY
                      else recs.X[a, r] <= nodes.thr[nd])
                nxt = nodes.left[nd] if go else nodes.right[nd]
            nodes.n[nd] -= 1
            nodes.cnt[nd, c] -= 1
            n = nodes.n[nd]
            stats[STAT_NODES] += 1
            if kind == LEAF:
                flag = _leaf_changed(nd, nodes, recs, layout, rule, tab, w, lists, cnt, rbuf)
            elif nodes.cnt[nd].max() == n or n < 2 * rule.min_samples_leaf:
                flag = True
            elif kind == RANDOM:
                flag = _random_changed(nd, nxt, domchg, nodes)
            else:
                flag = _greedy_changed(nd, nxt, r, c, nodes, caches, entries, tables, recs,
                                       layout, order, rule, tab, w, lists, cnt, rbuf, ctr,
                                       stats, sc)
            if flag:
                if stop:
                    flagged[nflag] = nd
                    nflag += 1
                else:
                    dirty[nd] = True
                break
            if nxt < 0:
                break
            nd = nxt
    ctr[CTR_AT_TREE] = T
    ctr[CTR_NFLAG] = nflag
    return nflag
