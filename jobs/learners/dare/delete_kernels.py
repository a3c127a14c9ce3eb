"""Compiled (numba) deletion of one record from a DaRE forest: :func:`delete_record` walks the
record's path in every tree, updates counts, cached candidates and value group tables, and
re-checks each node against its stored split, with the same ``decide_one`` and ``score1``
as training, so an update makes a retrain's choices bit for bit. It never retrains: the
caller rebuilds the outermost changed nodes (:mod:`jobs.learners.dare.build_kernels`).
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

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


@njit(cache=True)
def _group_counts(g, tree, s, e, a, q, roff, rstart, gorder, pos, alive, y, samp, rank):
    """g[:] = class counts of the node's live records whose `a` value has rank q: from the
    node's layout range [s, e) or the value's run in the global order, whichever is
    shorter."""
    g[:] = 0
    ro = roff[a] + q
    if e - s < rstart[ro + 1] - rstart[ro]:
        for p_ in range(s, e):
            sl = samp[tree, p_]
            if sl >= 0 and rank[sl, a] == q:
                g[y[sl]] += 1
        return
    for i in range(rstart[ro], rstart[ro + 1]):
        sl = gorder[a, i]
        if alive[sl]:
            ps = pos[tree, sl]
            if ps >= s and ps < e:
                g[y[sl]] += 1


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
def _neighbour(tree, s, e, n, a, wr, up, samp, rank, roff, rstart, gorder, pos, alive):
    """Rank of the nearest value of `a` among the node's live records strictly above (up) or
    below wr; -1 if none. Scans the node's layout range or walks the attribute's global
    order, whichever is shorter (same answer)."""
    G = gorder.shape[1]
    if (e - s) <= 2 * G // max(n, 1) + 16:
        res = -1
        for q in range(s, e):
            sl = samp[tree, q]
            if sl >= 0:
                rk = np.int64(rank[sl, a])
                if up:
                    if rk > wr and (res < 0 or rk < res):
                        res = rk
                elif rk < wr and rk > res:
                    res = rk
        return res
    ro = roff[a] + wr
    if up:
        for i in range(rstart[ro + 1], G):
            sl = gorder[a, i]
            if alive[sl]:
                ps = pos[tree, sl]
                if ps >= s and ps < e:
                    return np.int64(rank[sl, a])
    else:
        for i in range(rstart[ro] - 1, -1, -1):
            sl = gorder[a, i]
            if alive[sl]:
                ps = pos[tree, sl]
                if ps >= s and ps < e:
                    return np.int64(rank[sl, a])
    return -1


@njit(cache=True)
def _prio(sk, vmix, va, r):
    return np.int64(mix(sk ^ vmix[va + r]) >> _S32)


@njit(cache=True)
def _scan_entries(off, ln, wr, c, er1, er2, eleft):
    """Decrement the left counts of a slot's live pairs at or above w's rank wr (a record
    of class c left their left side) and find the pairs that touch w: A = (prev, w) and
    B = (w, next) (entry, -1: not listed) with their positions among the live entries
    (the first k are the scored ones)."""
    A = -1
    B = -1
    live = 0
    posA = 0
    posB = 0
    for E_ in range(off, off + ln):
        r1 = er1[E_]
        if r1 < 0:
            continue
        if r1 >= wr:
            eleft[c, E_] -= 1
        if er2[E_] == wr:
            A = E_
            posA = live
        if r1 == wr:
            B = E_
            posB = live
        live += 1
    return A, B, posA, posB


@njit(cache=True)
def _table_row(hr, hoff, hl, wr):
    """Row of value rank wr in a value group table (present: the record was in the node)."""
    lo = hoff
    hi = hoff + hl - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if hr[mid] < wr:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(cache=True)
def _drop_invalid(A, B, posA, posB, k, hp, gw, gp, gn, er1, er2, hc, tree, s, e, a, roff, rstart,
                  gorder, pos, alive, y, samp, rank):
    """w's group survives (its counts in gw): the listed pairs touching it, A = (prev, w)
    and B = (w, next), can only turn invalid. Their neighbour groups come from the value
    group table's rows around hp where the slot keeps one (hp >= 0), else counted. Returns
    whether one of the scored pairs (the first k) died."""
    touched = False
    if A >= 0:
        if hp >= 0:
            for cc in range(gp.shape[0]):
                gp[cc] = hc[hp - 1, cc]
        else:
            _group_counts(gp, tree, s, e, a, er1[A], roff, rstart, gorder, pos, alive, y, samp,
                          rank)
        if not _valid(gp, gw):
            er1[A] = -1
            touched |= posA < k
    if B >= 0:
        if hp >= 0:
            for cc in range(gn.shape[0]):
                gn[cc] = hc[hp + 1, cc]
        else:
            _group_counts(gn, tree, s, e, a, er2[B], roff, rstart, gorder, pos, alive, y, samp,
                          rank)
        if not _valid(gw, gn):
            er1[B] = -1
            touched |= posB < k
    return touched


@njit(cache=True)
def _next_value(bnext, hp, hoff, hl, hr, tree, s, e, n, a, wr, samp, rank, roff, rstart, gorder,
                pos, alive):
    """Rank of the node's next value above the vanished w (B's upper value where B was
    listed, else from the value group table or the records); -1 if none."""
    if bnext >= 0:
        return bnext
    if hp >= 0:
        return hr[hp] if hp < hoff + hl else -1
    return _neighbour(tree, s, e, n, a, wr, True, samp, rank, roff, rstart, gorder, pos, alive)


@njit(cache=True)
def _pair_groups(prev, nxt, hp, hc, gp, gn, tree, s, e, a, roff, rstart, gorder, pos, alive, y,
                 samp, rank):
    """gp, gn = the class counts of the node's value groups prev and nxt, adjacent once w
    vanished: the value group table's rows around hp where the slot keeps one (hp >= 0),
    else counted from the records."""
    if hp >= 0:
        for cc in range(gp.shape[0]):
            gp[cc] = hc[hp - 1, cc]
            gn[cc] = hc[hp, cc]
        return
    _group_counts(gp, tree, s, e, a, prev, roff, rstart, gorder, pos, alive, y, samp, rank)
    _group_counts(gn, tree, s, e, a, nxt, roff, rstart, gorder, pos, alive, y, samp, rank)


@njit(cache=True)
def _left_counts(g, prev, B, hp, hoff, eleft, hc, tree, s, e, a, y, samp, rank):
    """g[:] = left class counts of the pair (prev, next): B's (the same records are on
    its left), the table's groups up to prev, or counted from the node's records."""
    C = g.shape[0]
    g[:] = 0
    if B >= 0:
        for cc in range(C):
            g[cc] = eleft[cc, B]
    elif hp >= 0:
        for q in range(hoff, hp):
            for cc in range(C):
                g[cc] += hc[q, cc]
    else:
        for q in range(s, e):
            sl = samp[tree, q]
            if sl >= 0 and rank[sl, a] <= prev:
                g[y[sl]] += 1


@njit(cache=True)
def _insert_pair(prev, nxt, h, v, sk, va, g, off, ln, er1, er2, eleft, vals, vmix, ctr):
    """Copy a slot's live entries er*[off:off + ln] to a fresh segment at the end of the
    entry pool (the caller made room), the pair (prev, nxt) with left counts g at its
    priority position (h, v). Returns (the segment's start, its length, that position
    among the live entries)."""
    C = g.shape[0]
    nb = 0
    for E_ in range(off, off + ln):
        if er1[E_] >= 0:
            eh = _prio(sk, vmix, va, er1[E_])
            if eh < h or (eh == h and vals[va + er1[E_]] < v):
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
    return start, j + 1, nb


@njit(cache=True)
def _cached_repair(nd, nk, r, c, k, nodes, caches, entries, tables, recs, layout, order, ctr,
                   gw, gp, gn):
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
    candidate); r2 >= 0 is the stored split's new upper value if its pair moved it.

    Its steps take the arrays they read, not the pools: a step called per slot with the
    pools as arguments made a deletion a third slower."""
    n_attr, n_r1 = nodes.attr, nodes.r1
    c_attr, c_off, c_len, c_all = caches.attr, caches.off, caches.length, caches.all_pairs
    c_cutp, c_cutv, c_hoff, c_hlen = (caches.cut_prio, caches.cut_value, caches.table_off,
                                      caches.table_len)
    er1, er2, eleft = entries.r1, entries.r2, entries.left
    hr, hc = tables.rank, tables.cnt
    rank, y, vals, vmix, voff = recs.rank, recs.y, recs.vals, recs.vmix, recs.voff
    samp, pos = layout.slot_at, layout.pos
    roff, rstart, gorder, alive = order.roff, order.rstart, order.gorder, order.alive
    P = c_attr.shape[1]
    C = hc.shape[1]
    cid = nodes.cid[nd]
    tree, s, e, n = nodes.tree[nd], nodes.start[nd], nodes.end[nd], nodes.n[nd]
    touched = False
    best_r2 = -1
    for ss in range(P):
        a = c_attr[cid, ss]
        if a < 0:
            continue
        wr = np.int64(rank[r, a])
        A, B, posA, posB = _scan_entries(c_off[cid, ss], c_len[cid, ss], wr, c, er1, er2, eleft)
        hl = c_hlen[cid, ss]
        hoff = c_hoff[cid, ss]
        hp = -1
        if hl > 0:
            hp = _table_row(hr, hoff, hl, wr)
            hc[hp, c] -= 1
            tot = 0
            for cc in range(C):
                gw[cc] = hc[hp, cc]
                tot += gw[cc]
            if tot > 0:  # w's group survives: pairs touching it can only turn invalid
                touched |= _drop_invalid(A, B, posA, posB, k, hp, gw, gp, gn, er1, er2, hc, tree,
                                         s, e, a, roff, rstart, gorder, pos, alive, y, samp, rank)
                continue
            # the group vanished: drop it, so that its neighbours become adjacent
            for q in range(hp, hoff + hl - 1):
                hr[q] = hr[q + 1]
                for cc in range(C):
                    hc[q, cc] = hc[q + 1, cc]
            hl -= 1
            c_hlen[cid, ss] = hl
            ctr[CTR_HGARB] += 1
        else:
            gw[:] = 0
            ro = roff[a] + wr
            if rstart[ro + 1] - rstart[ro] > 1:
                _group_counts(gw, tree, s, e, a, wr, roff, rstart, gorder, pos, alive, y, samp,
                              rank)
            if gw.sum() > 0:
                touched |= _drop_invalid(A, B, posA, posB, k, hp, gw, gp, gn, er1, er2, hc, tree,
                                         s, e, a, roff, rstart, gorder, pos, alive, y, samp, rank)
                continue
        # w's group vanished: (prev, w) becomes (prev, next); (w, next) disappears
        bnext = -1
        if B >= 0:
            bnext = er2[B]
            er1[B] = -1
            touched |= posB < k
        if A >= 0:
            prev = er1[A]
            nxt = _next_value(bnext, hp, hoff, hl, hr, tree, s, e, n, a, wr, samp, rank, roff,
                              rstart, gorder, pos, alive)
            if nxt >= 0:
                _pair_groups(prev, nxt, hp, hc, gp, gn, tree, s, e, a, roff, rstart, gorder,
                             pos, alive, y, samp, rank)
            if nxt >= 0 and _valid(gp, gn):
                er2[A] = nxt
                if a == n_attr[nd] and prev == n_r1[nd]:
                    best_r2 = nxt
            else:
                er1[A] = -1
                touched |= posA < k
            continue
        if c_all[cid, ss] and B < 0:
            continue
        # a pair (prev, next) that was not stored may now be valid and under the cut-off
        if hp >= 0:
            prev = hr[hp - 1] if hp > hoff else -1
        else:
            prev = _neighbour(tree, s, e, n, a, wr, False, samp, rank, roff, rstart, gorder,
                              pos, alive)
        if prev < 0:
            continue
        va = voff[a]
        sk = h2(nk ^ _TAG_THR, np.uint64(a))
        h = _prio(sk, vmix, va, prev)
        v = vals[va + prev]
        cp = c_cutp[cid, ss]
        if not (c_all[cid, ss] or h < cp or (h == cp and v <= c_cutv[cid, ss])):
            continue
        nxt = _next_value(bnext, hp, hoff, hl, hr, tree, s, e, n, a, wr, samp, rank, roff, rstart,
                          gorder, pos, alive)
        if nxt < 0:
            continue
        _pair_groups(prev, nxt, hp, hc, gp, gn, tree, s, e, a, roff, rstart, gorder, pos, alive,
                     y, samp, rank)
        if not _valid(gp, gn):
            continue
        _left_counts(gp, prev, B, hp, hoff, eleft, hc, tree, s, e, a, y, samp, rank)
        c_off[cid, ss], c_len[cid, ss], nb = _insert_pair(
            prev, nxt, h, v, sk, va, gp, c_off[cid, ss], c_len[cid, ss], er1, er2, eleft, vals,
            vmix, ctr)
        touched |= nb < k
    return touched, best_r2


@njit(cache=True)
def _cached_score(nd, nodes, caches, entries, k, msl, gini, tab, Lb, Rb):
    """Re-score the first k live pairs of each slot of cached node nd.

    Returns a status (0 same split, 1 same split with a new v2, 2 best split changed, 3
    the cache must be recomputed: a slot holds fewer than k pairs and not every valid
    one), the new r2 and the runner-up score (status 0 and 1)."""
    n_attr, n_r1, n_r2, n_n, n_cnt, n_cid = (nodes.attr, nodes.r1, nodes.r2, nodes.n,
                                             nodes.cnt, nodes.cid)
    c_attr, c_off, c_len, c_all = caches.attr, caches.off, caches.length, caches.all_pairs
    er1, er2, eleft = entries.r1, entries.r2, entries.left
    P = c_attr.shape[1]
    C = n_cnt.shape[1]
    cid = n_cid[nd]
    n = n_n[nd]
    best_sc = -np.inf
    second = -np.inf
    best = -1
    battr = -1
    for ss in range(P):
        a = c_attr[cid, ss]
        if a < 0:
            continue
        off = c_off[cid, ss]
        nval = 0
        for E_ in range(off, off + c_len[cid, ss]):
            if er1[E_] >= 0:
                nval += 1
        if (nval < k and not c_all[cid, ss]) or nval == 0:
            return 3, -1, np.inf  # (whatever was scored so far is moot)
        taken = 0
        for E_ in range(off, off + c_len[cid, ss]):
            if taken >= k:
                break
            if er1[E_] < 0:
                continue
            taken += 1
            nl = np.int64(0)
            for cc in range(C):
                Lb[0, cc] = eleft[cc, E_]
                nl += Lb[0, cc]
            nr = np.int64(n) - nl
            if nl >= msl and nr >= msl:
                for cc in range(C):
                    Rb[0, cc] = np.int64(n_cnt[nd, cc]) - Lb[0, cc]
                sc = score1(Lb, 0, Rb, 0, nl, nr, gini, tab)
                if sc > best_sc:
                    second = best_sc
                    best_sc = sc
                    best = E_
                    battr = a
                elif sc > second:
                    second = sc
    if best >= 0 and battr == n_attr[nd] and er1[best] == n_r1[nd]:
        if not gini:
            second = np.inf
        return (1 if er2[best] != n_r2[nd] else 0), np.int64(er2[best]), second
    return 2, -1, np.inf


@njit(cache=True)
def _groups_unchanged(nd, r, c, nodes, recs, layout):
    """Whether the valid pairs of every attribute sampled at uncached node nd are the same
    after record r (class c) left it: true unless the record's value group, on some
    sampled attribute, vanished from the node or became pure (the only ways a pair can
    appear, disappear or merge). Counts the groups from the node's records."""
    t, s, e, sattr = nodes.tree[nd], nodes.start[nd], nodes.end[nd], nodes.sampled
    rank, y = recs.rank, recs.y
    samp = layout.slot_at
    for ss in range(sattr.shape[1]):
        a = sattr[nd, ss]
        if a < 0:
            continue
        wr = np.int64(rank[r, a])
        other = -1  # a class other than c seen in w's group; -2: two of them
        same = False  # a record of class c seen in w's group
        for q in range(s, e):
            sl = samp[t, q]
            if sl >= 0 and rank[sl, a] == wr:
                lab = y[sl]
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
def _split_score(nd, nxt, c, nodes, msl, gini, tab, Lb, Rb):
    """Score of greedy node nd's stored split from its children's counts, after record r
    (class c, on its way to child nxt, whose counts are not yet decremented) left it;
    -inf if a side now holds fewer than msl records."""
    n_left, n_n, n_cnt = nodes.left, nodes.n, nodes.cnt
    C = n_cnt.shape[1]
    lk = n_left[nd]
    nl = np.int64(0)
    for cc in range(C):
        Lb[0, cc] = n_cnt[lk, cc]
    if nxt == lk:
        Lb[0, c] -= 1
    for cc in range(C):
        nl += Lb[0, cc]
        Rb[0, cc] = np.int64(n_cnt[nd, cc]) - Lb[0, cc]
    nr = np.int64(n_n[nd]) - nl
    if nl < msl or nr < msl:
        return -np.inf
    return score1(Lb, 0, Rb, 0, nl, nr, gini, tab)


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
                    tab, w, lists, cnt, rbuf, ctr, stats, gw, gp, gn, Lb, Rb):
    """Update greedy node nd (not pure, not too small) after record r (class c, on its way
    to child nxt) left it; returns whether its canonical split now differs from the stored
    one.

    A node whose other candidates' scores are bounded (n_bound: the runner-up at the last
    full scoring, plus what the deletions since can have added) keeps its split without
    re-scoring when the candidates are the same pairs as then and the split still beats
    the bound; otherwise a cached node re-scores its lists, an uncached one is re-derived
    from its records (and a cache that ran short is recomputed)."""
    n_tree, n_depth, n_path, n_attr, n_r1 = (nodes.tree, nodes.depth, nodes.path, nodes.attr,
                                             nodes.r1)
    n_r2, n_n, n_cid, n_bound, n_sattr = (nodes.r2, nodes.n, nodes.cid, nodes.bound,
                                          nodes.sampled)
    msl, P, k, buf, gini = rule.min_samples_leaf, rule.n_sampled, rule.k, rule.buffer, rule.gini
    cache_min = rule.cache_min
    KB = k + buf
    n = n_n[nd]
    cid = n_cid[nd]
    if cid >= 0 and n < cache_min:
        for ss in range(P):  # the cache's attributes are the node's sampled ones
            n_sattr[nd, ss] = caches.attr[cid, ss]
        uncache_node(nd, nodes, caches, ctr)
        cid = -1
    bound = _drift(n_bound[nd])
    n_bound[nd] = np.inf
    if cid >= 0:
        nk = h2(recs.tree_keys[n_tree[nd]], np.uint64(n_path[nd]))
        touched, nr2 = _cached_repair(nd, nk, r, c, k, nodes, caches, entries, tables, recs,
                                      layout, order, ctr, gw, gp, gn)
        if not touched and bound < np.inf and _split_score(nd, nxt, c, nodes, msl, gini, tab,
                                                           Lb, Rb) > bound:
            if nr2 >= 0:
                _set_r2(nd, nr2, nodes, recs)
            n_bound[nd] = bound
            return False
        st, nr2, second = _cached_score(nd, nodes, caches, entries, k, msl, gini, tab, Lb, Rb)
        if st == 0 or st == 1:
            if st == 1:
                _set_r2(nd, nr2, nodes, recs)
            n_bound[nd] = bound_of(second)
            return False
        if st == 2:
            return True
        stats[STAT_CACHES] += 1
    elif bound < np.inf and _groups_unchanged(nd, r, c, nodes, recs, layout) and _split_score(
            nd, nxt, c, nodes, msl, gini, tab, Lb, Rb) > bound:
        n_bound[nd] = bound
        return False
    m = gather_rows(layout.slot_at, n_tree[nd], nodes.start[nd], nodes.end[nd], rbuf, 0)
    d = decide_one(rbuf, 0, m, n_tree[nd], n_path[nd], n_depth[nd], cid >= 0, recs, rule, tab,
                   w, lists, cnt)
    flag = True
    if d.kind == GREEDY and d.attr == n_attr[nd] and d.r1 == n_r1[nd]:
        flag = False
        if d.r2 != n_r2[nd]:
            _set_r2(nd, d.r2, nodes, recs)
        n_bound[nd] = bound_of(d.second)
        for ss in range(P):
            n_sattr[nd, ss] = lists.attr[ss]
    if cid >= 0 and d.kind == GREEDY and m >= cache_min:
        # a cache is a function of the node's records alone: install it even where the
        # split changed (correct if it flips back)
        install_cache(cid, caches, entries, tables, lists, ctr, KB)
    return flag


@njit(cache=True)
def outermost(root: np.ndarray, dirty: np.ndarray, n_kind: np.ndarray, n_left: np.ndarray,
              n_right: np.ndarray) -> np.ndarray:
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
            elif n_kind[u] != LEAF:
                stack[top] = n_left[u]
                stack[top + 1] = n_right[u]
                top += 2
    return out[:m]


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
    n_tree, n_depth, n_path, n_kind, n_why = (nodes.tree, nodes.depth, nodes.path, nodes.kind,
                                              nodes.why)
    n_left, n_right, n_attr, n_thr, n_r1 = (nodes.left, nodes.right, nodes.attr, nodes.thr,
                                            nodes.r1)
    n_draw, n_n, n_cnt, n_cid = nodes.draw, nodes.n, nodes.cnt, nodes.cid
    X, rank = recs.X, recs.rank
    c_len = caches.length
    maxd, msl, P = rule.max_depth, rule.min_samples_leaf, rule.n_sampled
    hist_ratio = rule.hist_ratio
    KB = rule.k + rule.buffer
    root = layout.root
    C = n_cnt.shape[1]
    T = root.shape[0]
    ecap = entries.r1.shape[0]
    hcap = tables.rank.shape[0]
    gw = np.zeros(C, np.int64)
    gp = np.zeros(C, np.int64)
    gn = np.zeros(C, np.int64)
    Lb = np.zeros((1, C), np.int64)
    Rb = np.zeros((1, C), np.int64)
    nflag = ctr[CTR_NFLAG]
    for t in range(ctr[CTR_AT_TREE], T):
        nd = root[t]
        if ctr[CTR_AT_NODE] >= 0:
            nd = ctr[CTR_AT_NODE]
            ctr[CTR_AT_NODE] = -1
        while True:
            if not stop and dirty[nd]:
                # its parent reads its counts (a random node's empty child, a greedy
                # node's split score): they follow the records; nothing else does
                n_n[nd] -= 1
                n_cnt[nd, c] -= 1
                break
            kind = n_kind[nd]
            cid = n_cid[nd]
            if kind == GREEDY and cid >= 0:
                # room for its rewritten segments and a recomputed cache
                need_e = P * KB
                for ss in range(P):
                    need_e += c_len[cid, ss] + 1
                need_h = P * (n_n[nd] // hist_ratio + 1)
                if ctr[CTR_EUSED] + need_e > ecap or ctr[CTR_HUSED] + need_h > hcap:
                    ctr[CTR_NEED_E] = need_e
                    ctr[CTR_NEED_H] = need_h
                    ctr[CTR_AT_TREE] = t
                    ctr[CTR_AT_NODE] = nd
                    ctr[CTR_NFLAG] = nflag
                    return -1
            nxt = -1
            if kind != LEAF:
                a = n_attr[nd]
                go = rank[r, a] <= n_r1[nd] if kind == GREEDY else X[a, r] <= n_thr[nd]
                nxt = n_left[nd] if go else n_right[nd]
            n_n[nd] -= 1
            n_cnt[nd, c] -= 1
            n = n_n[nd]
            stats[STAT_NODES] += 1
            flag = False
            if kind == LEAF:
                why = n_why[nd]
                if why <= W_PURE:  # a leaf's reason follows its counts
                    if n_depth[nd] >= maxd:
                        n_why[nd] = W_DEPTH
                    elif n < 2 * msl:
                        n_why[nd] = W_SMALL
                    else:
                        n_why[nd] = W_PURE
                else:  # constant or too small to split: re-derive
                    m = gather_rows(layout.slot_at, n_tree[nd], nodes.start[nd], nodes.end[nd],
                                    rbuf, 0)
                    d = decide_one(rbuf, 0, m, n_tree[nd], n_path[nd], n_depth[nd], False,
                                   recs, rule, tab, w, lists, cnt)
                    if d.kind == LEAF:
                        n_why[nd] = d.why
                    else:
                        flag = True
            else:
                cmax = 0
                for cc in range(C):
                    if n_cnt[nd, cc] > cmax:
                        cmax = n_cnt[nd, cc]
                if cmax == n or n < 2 * msl:
                    flag = True
                elif kind == RANDOM:
                    lk = n_left[nd]
                    rk = n_right[nd]
                    nl = n_n[lk] - (1 if nxt == lk else 0)
                    nr = n_n[rk] - (1 if nxt == rk else 0)
                    flag = nl == 0 or nr == 0 or n_draw[nd] < 0 or domchg[n_attr[nd]]
                else:
                    flag = _greedy_changed(nd, nxt, r, c, nodes, caches, entries, tables, recs,
                                           layout, order, rule, tab, w, lists, cnt, rbuf, ctr,
                                           stats, gw, gp, gn, Lb, Rb)
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
