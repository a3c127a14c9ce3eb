"""Compiled (numba) kernels of :mod:`jobs.learners.dare`.

Every function here reproduces, bit for bit, a choice the DaRE forest documents in
:mod:`jobs.learners.dare` (keyed hashing, candidate selection, split scores, tie-breaks);
the module docstring there is the specification. Integer counts stay integers, and the
split score of a candidate is computed by one function, :func:`score1`, whichever path
(from-scratch split search or cached incremental re-scoring) asks for it, so equal counts
give equal bits. ``cache=True`` keeps the compiled code on disk next to this file
(``__pycache__``), so only the first import on a machine pays the compile time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_TAG_GATTR = np.uint64(0x243F6A8885A308D3)
_TAG_THR = np.uint64(0x13198A2E03707344)
_LOW32 = np.uint64(0xFFFFFFFF)


@njit(cache=True)
def mix(x):
    """splitmix64's finaliser on one uint64 (wrapping arithmetic)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


@njit(cache=True)
def h2(a, b):
    """Keyed hash of two uint64 values (= ``dare._h2``)."""
    return mix(a ^ mix(b + _GOLD))


@njit(cache=True, inline="always")
def score1(L, i, R, j, nl, nr, gini, tab):
    """Split score of one candidate from its left/right class counts L[i], R[j] (rows).

    Gini: sum L_c^2 / n_l + sum R_c^2 / n_r (exact integer numerators, one division each);
    entropy: (sum_c f(L_c) - f(n_l)) + (sum_c f(R_c) - f(n_r)) with f = x log x from `tab`.
    The only score function: the split search and the incremental re-scoring both call it."""
    C = L.shape[1]
    if gini:
        il = np.int64(L[i, 0]) * np.int64(L[i, 0])
        ir = np.int64(R[j, 0]) * np.int64(R[j, 0])
        for c in range(1, C):
            il += np.int64(L[i, c]) * np.int64(L[i, c])
            ir += np.int64(R[j, c]) * np.int64(R[j, c])
        return il / nl + ir / nr
    fl = tab[L[i, 0]]
    fr = tab[R[j, 0]]
    for c in range(1, C):
        fl = fl + tab[L[i, c]]
        fr = fr + tab[R[j, c]]
    return (fl - tab[nl]) + (fr - tab[nr])


@njit(cache=True)
def _sort_keys(keys, tmp, n, nbits):
    """Sort keys[:n] (non-negative int64 below 2**nbits) ascending; LSD radix for large n."""
    if n <= 32:
        for i in range(1, n):
            v = keys[i]
            j = i - 1
            while j >= 0 and keys[j] > v:
                keys[j + 1] = keys[j]
                j -= 1
            keys[j + 1] = v
        return keys
    if nbits > 32:
        keys[:n] = np.sort(keys[:n])
        return keys
    # 8-bit digits
    src = keys
    dst = tmp
    cnt = np.zeros(257, np.int64)
    shift = 0
    while shift < nbits:
        cnt[:] = 0
        for i in range(n):
            cnt[((src[i] >> shift) & 255) + 1] += 1
        for b in range(1, 257):
            cnt[b] += cnt[b - 1]
        for i in range(n):
            d = (src[i] >> shift) & 255
            dst[cnt[d]] = src[i]
            cnt[d] += 1
        src, dst = dst, src
        shift += 8
    return src


@njit(cache=True)
def greedy_tasks(nk, n, cnt, rows, off, want_cache, rank, y, vals, vmix, voff, P, k, buf,
                 msl, gini, tab, nvals_max):
    """Greedy split of each task (node) from its records rows[off[t]:off[t+1]].

    Same choices as the specification in dare.py: the first min(P, p) non-constant
    attributes in keyed order (h2(nk ^ TAG_GATTR, a), stable), per attribute the valid
    adjacent value pairs ranked by (h2(h2(nk ^ TAG_THR, a), bits(v1)) >> 32, index), the
    first k scored, best score wins, ties to the earlier (slot, priority, index). Tasks
    with want_cache keep the first k + buf pairs per slot (cache entries, task then slot
    order; only for tasks that found a split).

    Returns ok, attr, r1, r2 (per task), slot_attr, allf, cutp, cutv, elen (per task and
    slot) and the entries' r1, r2 and left counts (the first `used` rows)."""
    ntask = nk.shape[0]
    p = rank.shape[0]
    C = cnt.shape[1]
    need = min(P, p)
    KB = k + buf
    ok = np.zeros(ntask, np.bool_)
    o_attr = np.full(ntask, -1, np.int64)
    o_r1 = np.full(ntask, -1, np.int64)
    o_r2 = np.full(ntask, -1, np.int64)
    slot_attr = np.full((ntask, P), -1, np.int32)
    allf = np.ones((ntask, P), np.bool_)
    cutp = np.full((ntask, P), -1, np.int64)
    cutv = np.zeros((ntask, P), np.float64)
    elen = np.zeros((ntask, P), np.int64)
    ncache = 0
    maxn = 1
    for t in range(ntask):
        if want_cache[t]:
            ncache += 1
        if n[t] > maxn:
            maxn = n[t]
    e_r1 = np.empty(ncache * P * KB, np.int32)
    e_r2 = np.empty(ncache * P * KB, np.int32)
    e_left = np.empty((ncache * P * KB, C), np.int32)
    used = 0
    keys = np.empty(maxn, np.int64)
    tmp = np.empty(maxn, np.int64)
    hb = np.empty(p, np.uint64)
    order = np.empty(p, np.int64)
    bkey = np.empty(KB, np.uint64)
    br1 = np.empty(KB, np.int64)
    br2 = np.empty(KB, np.int64)
    bleft = np.empty((KB, C), np.int64)
    cum = np.zeros(C, np.int64)
    R = np.empty((1, C), np.int64)
    # sort keys rank << lb | label
    lb = 0
    while (1 << lb) < C:
        lb += 1
    lmask = (np.int64(1) << lb) - 1
    nbits = lb + 1
    while (np.int64(1) << nbits) <= ((nvals_max + 1) << lb):
        nbits += 1
    for t in range(ntask):
        s0 = off[t]
        nt = off[t + 1] - s0
        nkt = nk[t]
        # keyed attribute order (stable insertion sort of p hashes)
        base = nkt ^ _TAG_GATTR
        for a in range(p):
            h = h2(base, np.uint64(a))
            j = a - 1
            while j >= 0 and hb[j] > h:
                hb[j + 1] = hb[j]
                order[j + 1] = order[j]
                j -= 1
            hb[j + 1] = h
            order[j + 1] = a
        cache = want_cache[t]
        K = KB if cache else k
        tstart = used
        best_sc = -np.inf
        best_a = -1
        best_r1 = -1
        best_r2 = -1
        slot = 0
        for oi in range(p):
            if slot >= need:
                break
            a = order[oi]
            for i in range(nt):
                r = rows[s0 + i]
                keys[i] = (np.int64(rank[a, r]) << lb) | y[r]
            kk = _sort_keys(keys, tmp, nt, nbits)
            if (kk[0] >> lb) == (kk[nt - 1] >> lb):
                continue  # constant attribute: no slot
            sk = h2(nkt ^ _TAG_THR, np.uint64(a))
            va = voff[a]
            cum[:] = 0
            nb = 0
            nvalid = 0
            prev_rk = -1
            prev_pure = False
            prev_lab = -1
            i = 0
            while i < nt:
                rk = kk[i] >> lb
                gf = kk[i] & lmask
                j = i + 1
                while j < nt and (kk[j] >> lb) == rk:
                    j += 1
                gl = kk[j - 1] & lmask
                pure = gf == gl
                if prev_rk >= 0 and not (prev_pure and pure and prev_lab == gf):
                    # = h2(sk, bits(v1)): vmix holds mix(bits(v) + GOLD) per value
                    key = ((mix(sk ^ vmix[va + prev_rk]) >> _S32) << _S32) | np.uint64(nvalid)
                    nvalid += 1
                    pos = -1
                    if nb < K:
                        pos = nb
                        nb += 1
                    elif key < bkey[K - 1]:
                        pos = K - 1
                    if pos >= 0:
                        while pos > 0 and bkey[pos - 1] > key:
                            bkey[pos] = bkey[pos - 1]
                            br1[pos] = br1[pos - 1]
                            br2[pos] = br2[pos - 1]
                            for c in range(C):
                                bleft[pos, c] = bleft[pos - 1, c]
                            pos -= 1
                        bkey[pos] = key
                        br1[pos] = prev_rk
                        br2[pos] = rk
                        for c in range(C):
                            bleft[pos, c] = cum[c]
                for q in range(i, j):
                    cum[kk[q] & lmask] += 1
                prev_rk = rk
                prev_pure = pure
                prev_lab = gl
                i = j
            slot_attr[t, slot] = a
            # score the first k pairs in (priority, index) order
            for q in range(min(k, nb)):
                nl = np.int64(0)
                for c in range(C):
                    nl += bleft[q, c]
                nr = nt - nl
                if nl >= msl and nr >= msl:
                    for c in range(C):
                        R[0, c] = cnt[t, c] - bleft[q, c]
                    sc = score1(bleft, q, R, 0, nl, nr, gini, tab)
                    if sc > best_sc:
                        best_sc = sc
                        best_a = a
                        best_r1 = br1[q]
                        best_r2 = br2[q]
            if cache:
                for q in range(nb):
                    e_r1[used] = br1[q]
                    e_r2[used] = br2[q]
                    for c in range(C):
                        e_left[used, c] = bleft[q, c]
                    used += 1
                elen[t, slot] = nb
                allf[t, slot] = nvalid <= KB
                if nb > 0:
                    cutp[t, slot] = np.int64(bkey[nb - 1] >> _S32)
                    cutv[t, slot] = vals[va + br1[nb - 1]]
            slot += 1
        if best_a >= 0:
            ok[t] = True
            o_attr[t] = best_a
            o_r1[t] = best_r1
            o_r2[t] = best_r2
        else:
            used = tstart
    return (ok, o_attr, o_r1, o_r2, slot_attr, allf, cutp, cutv, elen,
            e_r1[:used], e_r2[:used], e_left[:used])


# ----------------------------------------------------------------------------- deletions


@njit(cache=True)
def _group_counts(g, tree, s, e, a, q, roff, rstart, gorder, pos, alive, y):
    """g[:] = class counts of the node's live records whose `a` value has rank q."""
    g[:] = 0
    ro = roff[a] + q
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
                rk = rank[a, sl]
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
                    return rank[a, sl]
    else:
        for i in range(rstart[ro] - 1, -1, -1):
            sl = gorder[a, i]
            if alive[sl]:
                ps = pos[tree, sl]
                if ps >= s and ps < e:
                    return rank[a, sl]
    return -1


@njit(cache=True)
def _prio(sk, vmix, va, r):
    return np.int64(mix(sk ^ vmix[va + r]) >> _S32)


@njit(cache=True)
def cached_delete(nodes, nk, r, c, n_cid, n_tree, n_s, n_e, n_n, n_cnt, n_attr, n_r1, n_r2,
                  c_attr, c_off, c_len, c_all, c_cutp, c_cutv, er1, er2, eleft, eused,
                  rank, roff, rstart, gorder, pos, alive, samp, y, vals, vmix, voff,
                  k, msl, gini, tab):
    """Incremental update of cached greedy nodes after record r (class c) left them (the
    record is already dead and out of the layout, the node counts already decremented).

    Per slot: decrement the left counts of cached pairs at or above r's value w, repair
    the pairs (prev, w) and (w, next), and when w's value group vanished from the node
    consider the merged pair (prev, next) under the slot's cut-off (inserted at its
    priority position into a fresh copy of the segment at the end of the entry pool, which
    the caller has reserved). Then re-score the first k live pairs of each slot.

    Returns per node a status (0 same, 1 same split with a new v2, 2 best split changed,
    3 cache must be recomputed), the new r2 for status 1, the new pool end and the number
    of entries freed."""
    nn = nodes.shape[0]
    P = c_attr.shape[1]
    C = n_cnt.shape[1]
    status = np.zeros(nn, np.int64)
    newr2 = np.full(nn, -1, np.int64)
    garb = 0
    gw = np.zeros(C, np.int64)
    gp = np.zeros(C, np.int64)
    gn = np.zeros(C, np.int64)
    Lb = np.zeros((1, C), np.int64)
    Rb = np.zeros((1, C), np.int64)
    for i in range(nn):
        nd = nodes[i]
        cid = n_cid[nd]
        tree = n_tree[nd]
        s = n_s[nd]
        e = n_e[nd]
        n = n_n[nd]
        for ss in range(P):
            a = c_attr[cid, ss]
            if a < 0:
                continue
            allf = c_all[cid, ss]
            off = c_off[cid, ss]
            ln = c_len[cid, ss]
            wr = rank[a, r]
            A = -1
            B = -1
            for E in range(off, off + ln):
                r1 = er1[E]
                if r1 < 0:
                    continue
                if r1 >= wr:
                    eleft[c, E] -= 1
                if er2[E] == wr:
                    A = E
                if r1 == wr:
                    B = E
            ro = roff[a] + wr
            gw[:] = 0
            if rstart[ro + 1] - rstart[ro] > 1:
                _group_counts(gw, tree, s, e, a, wr, roff, rstart, gorder, pos, alive, y)
            if gw.sum() > 0:  # w's group survives: pairs touching it can only turn invalid
                if A >= 0:
                    _group_counts(gp, tree, s, e, a, er1[A], roff, rstart, gorder, pos, alive, y)
                    if not _valid(gp, gw):
                        er1[A] = -1
                if B >= 0:
                    _group_counts(gn, tree, s, e, a, er2[B], roff, rstart, gorder, pos, alive, y)
                    if not _valid(gw, gn):
                        er1[B] = -1
                continue
            # w's group vanished: (prev, w) becomes (prev, next); (w, next) disappears
            bnext = -1
            if B >= 0:
                bnext = er2[B]
                er1[B] = -1
            if A >= 0:
                nxt = bnext
                if nxt < 0:
                    nxt = _neighbour(tree, s, e, n, a, wr, True, samp, rank, roff, rstart,
                                     gorder, pos, alive)
                prev = er1[A]
                if nxt < 0:
                    er1[A] = -1
                else:
                    _group_counts(gp, tree, s, e, a, prev, roff, rstart, gorder, pos, alive, y)
                    _group_counts(gn, tree, s, e, a, nxt, roff, rstart, gorder, pos, alive, y)
                    if _valid(gp, gn):
                        er2[A] = nxt
                    else:
                        er1[A] = -1
                continue
            if allf and B < 0:
                continue
            # a pair (prev, next) that was not stored may now be valid and under the cut-off
            prev = _neighbour(tree, s, e, n, a, wr, False, samp, rank, roff, rstart, gorder,
                              pos, alive)
            if prev < 0:
                continue
            va = voff[a]
            sk = h2(nk[i] ^ _TAG_THR, np.uint64(a))
            h = _prio(sk, vmix, va, prev)
            v = vals[va + prev]
            cp = c_cutp[cid, ss]
            if not (allf or h < cp or (h == cp and v <= c_cutv[cid, ss])):
                continue
            nxt = bnext
            if nxt < 0:
                nxt = _neighbour(tree, s, e, n, a, wr, True, samp, rank, roff, rstart, gorder,
                                 pos, alive)
            if nxt < 0:
                continue
            _group_counts(gp, tree, s, e, a, prev, roff, rstart, gorder, pos, alive, y)
            _group_counts(gn, tree, s, e, a, nxt, roff, rstart, gorder, pos, alive, y)
            if not _valid(gp, gn):
                continue
            if B >= 0:
                for cc in range(C):
                    gp[cc] = eleft[cc, B]
            else:
                gp[:] = 0
                for q in range(s, e):
                    sl = samp[tree, q]
                    if sl >= 0 and rank[a, sl] <= prev:
                        gp[y[sl]] += 1
            # copy the live entries to a new segment, the new pair at its priority position
            nb = 0
            for E in range(off, off + ln):
                if er1[E] >= 0:
                    eh = _prio(sk, vmix, va, er1[E])
                    if eh < h or (eh == h and vals[va + er1[E]] < v):
                        nb += 1
            start = eused
            d = start
            j = 0
            for E in range(off, off + ln):
                if er1[E] < 0:
                    continue
                if j == nb:
                    d += 1
                er1[d] = er1[E]
                er2[d] = er2[E]
                for cc in range(C):
                    eleft[cc, d] = eleft[cc, E]
                d += 1
                j += 1
            di = start + nb
            er1[di] = prev
            er2[di] = nxt
            for cc in range(C):
                eleft[cc, di] = gp[cc]
            newlen = j + 1
            eused = start + newlen
            garb += ln
            c_off[cid, ss] = start
            c_len[cid, ss] = newlen
        # ---- select the first k live pairs of each slot and score them
        for ss in range(P):
            a = c_attr[cid, ss]
            if a < 0:
                continue
            off = c_off[cid, ss]
            nval = 0
            for E in range(off, off + c_len[cid, ss]):
                if er1[E] >= 0:
                    nval += 1
            if (nval < k and not c_all[cid, ss]) or nval == 0:
                status[i] = 3
        if status[i] == 3:
            continue
        best_sc = -np.inf
        best = -1
        battr = -1
        for ss in range(P):
            a = c_attr[cid, ss]
            if a < 0:
                continue
            off = c_off[cid, ss]
            taken = 0
            for E in range(off, off + c_len[cid, ss]):
                if taken >= k:
                    break
                if er1[E] < 0:
                    continue
                taken += 1
                nl = np.int64(0)
                for cc in range(C):
                    Lb[0, cc] = eleft[cc, E]
                    nl += Lb[0, cc]
                nr = np.int64(n) - nl
                if nl >= msl and nr >= msl:
                    for cc in range(C):
                        Rb[0, cc] = np.int64(n_cnt[nd, cc]) - Lb[0, cc]
                    sc = score1(Lb, 0, Rb, 0, nl, nr, gini, tab)
                    if sc > best_sc:
                        best_sc = sc
                        best = E
                        battr = a
        if best >= 0 and battr == n_attr[nd] and er1[best] == n_r1[nd]:
            newr2[i] = er2[best]
            status[i] = 1 if er2[best] != n_r2[nd] else 0
        else:
            status[i] = 2
    return status, newr2, eused, garb
