"""Compiled (numba) kernels of :mod:`jobs.learners.dare.forest`: keyed hashing, the split search
of one node (:func:`decide_one`) and the depth-first builder of subtrees
(:func:`build_subtrees`) that fitting and every retrain after an update use; deletions
are in :mod:`jobs.learners.dare.delete_kernels`.

Every function here reproduces, bit for bit, a choice the DaRE forest documents in
:mod:`jobs.learners.dare.forest` (keyed hashing, candidate selection, split scores, tie-breaks);
the module docstring there is the specification. Integer counts stay integers, and the
split score of a candidate is computed by one function, :func:`score1`, whichever path
(from-scratch split search or cached incremental re-scoring) asks for it, so equal counts
give equal bits. ``cache=True`` keeps the compiled code on disk next to this file
(``__pycache__``), so only the first import on a machine pays the compile time.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

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
    """Keyed hash of two uint64 values (= ``dare_shared._h2``)."""
    return mix(a ^ mix(b + _GOLD))


@njit(cache=True)
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


# ----------------------------------------------------------------------------- split search
#
# One node's canonical state is computed by :func:`decide_one` (greedy search in
# :func:`greedy_one`, random split in :func:`random_one`). Fitting, rebuilding a subtree
# after an update, re-checking a node during a deletion and the vectorised
# :func:`greedy_tasks` all call these, so they make the same choices by construction.

LEAF, RANDOM, GREEDY = 0, 1, 2
W_DEPTH, W_SMALL, W_PURE, W_CONST, W_MSL = 1, 2, 3, 4, 5
_TAG_RATTR = np.uint64(0xA4093822299F31D0)
_TAG_DRAW = np.uint64(0x082EFA98EC4E6C89)
_S11 = np.uint64(11)
_INV53 = 2.0**-53
#: a value group table is counted densely (no sort) when the attribute has at most this
#: many distinct values per record of the node: ties make sorting the waste it is
_DENSE = 8


@njit(cache=True)
def midpoint(v1, v2):
    """Threshold between adjacent values: the midpoint, or v1 where it rounds onto v2."""
    t = 0.5 * v1 + 0.5 * v2
    if not (t >= v1 and t < v2):
        t = v1
    return t


@njit(cache=True)
def make_work(maxn: int, maxnv: int, p: int, C: int, P: int, KB: int,
              hist_ratio: int) -> tuple[tuple, tuple]:
    """Scratch buffers of the split search for nodes of up to maxn records: W (work; its
    dense tables are zeroed and left zeroed by every use) and S (one node's lists)."""
    maxn = max(maxn, 1)
    maxnv = max(maxnv, 1)
    W = (np.empty(maxn, np.int64), np.empty(maxn, np.int64), np.zeros(maxnv * C, np.int64),
         np.empty(maxn, np.int64), np.empty((maxn, C), np.int64), np.empty(p, np.uint64),
         np.empty(p, np.int64), np.empty(KB, np.uint64), np.zeros(maxnv, np.int64),
         np.empty(maxn, np.int64), np.empty((maxn, C), np.int64), np.zeros((1, C), np.int64),
         np.zeros((1, C), np.int64), np.empty(maxn, np.int64), np.empty(maxn, np.int64),
         np.empty(maxn, np.int64))
    H = P * (maxn // hist_ratio + 1)
    S = (np.empty(P, np.int64), np.empty(P, np.bool_), np.empty(P, np.int64),
         np.empty(P, np.float64), np.empty(P, np.int64), np.empty(P * KB, np.int64),
         np.empty(P * KB, np.int64), np.empty((P * KB, C), np.int64), np.empty(P, np.int64),
         np.empty(P, np.int64), np.empty(H, np.int64), np.empty((H, C), np.int64))
    return W, S


@njit(cache=True)
def _lt(h, a, i, j):
    return h[i] < h[j] or (h[i] == h[j] and a[i] < a[j])


@njit(cache=True)
def _sift_down(h, a, i, size):
    while True:
        m = i
        lft = 2 * i + 1
        if lft < size and _lt(h, a, lft, m):
            m = lft
        if lft + 1 < size and _lt(h, a, lft + 1, m):
            m = lft + 1
        if m == i:
            return
        h[i], h[m] = h[m], h[i]
        a[i], a[m] = a[m], a[i]
        i = m


@njit(cache=True)
def _order_init(base, p, hb, order):
    """A min-heap of the attributes by (h2(base, a), a): popping it (:func:`_order_pop`)
    gives the keyed attribute order (a stable sort of the hashes) one attribute at a time,
    so a node that needs its first few attributes does not sort them all."""
    for a in range(p):
        hb[a] = h2(base, np.uint64(a))
        order[a] = a
    for i in range(p // 2 - 1, -1, -1):
        _sift_down(hb, order, i, p)


@njit(cache=True)
def _order_pop(hb, order, size):
    a = order[0]
    size -= 1
    hb[0] = hb[size]
    order[0] = order[size]
    _sift_down(hb, order, 0, size)
    return a


@njit(cache=True)
def _key_down(heap, i, size):
    """Sift heap[i] down in the max-heap heap[:size]."""
    key = heap[i]
    while True:
        m = i
        lft = 2 * i + 1
        big = key
        if lft < size and heap[lft] > big:
            m = lft
            big = heap[lft]
        if lft + 1 < size and heap[lft + 1] > big:
            m = lft + 1
        if m == i:
            break
        heap[i] = heap[m]
        i = m
    heap[i] = key


@njit(cache=True)
def _key_sort(heap, size, heaped):
    """Sort heap[:size] ascending in place (heapsort; heapify first unless `heaped`)."""
    if not heaped:
        for i in range(size // 2 - 1, -1, -1):
            _key_down(heap, i, size)
    for end in range(size - 1, 0, -1):
        top = heap[0]
        heap[0] = heap[end]
        heap[end] = top
        _key_down(heap, 0, end)


@njit(cache=True)
def value_groups(rows, lo, hi, a, rank, y, nv, C, keys, tmp, dense, dtot, g_rank, g_cnt):
    """The value groups of attribute a among rows[lo:hi]: g_rank[:ng] ascending with their
    class counts g_cnt[:ng]; returns ng. Counted in a dense table when the attribute has
    few distinct values (ties), else by sorting (rank, label) keys."""
    nt = hi - lo
    ng = 0
    if nv <= _DENSE * nt:
        for i in range(lo, hi):
            r = rows[i]
            q = np.int64(rank[r, a])
            dense[q * C + y[r]] += 1
            dtot[q] += 1
        for q in range(nv):
            if dtot[q] > 0:
                dtot[q] = 0
                b = q * C
                g_rank[ng] = q
                for c in range(C):
                    g_cnt[ng, c] = dense[b + c]
                    dense[b + c] = 0
                ng += 1
        return ng
    lb = 0
    while (1 << lb) < C:
        lb += 1
    lmask = (np.int64(1) << lb) - 1
    nbits = lb + 1
    while (np.int64(1) << nbits) <= (np.int64(nv + 1) << lb):
        nbits += 1
    for i in range(nt):
        r = rows[lo + i]
        keys[i] = (np.int64(rank[r, a]) << lb) | y[r]
    kk = _sort_keys(keys, tmp, nt, nbits)
    i = 0
    while i < nt:
        rk = kk[i] >> lb
        for c in range(C):
            g_cnt[ng, c] = 0
        j = i
        while j < nt and (kk[j] >> lb) == rk:
            g_cnt[ng, kk[j] & lmask] += 1
            j += 1
        g_rank[ng] = rk
        ng += 1
        i = j
    return ng


@njit(cache=True)
def greedy_one(rows, lo, hi, nk, cnt, cache, rank, y, vmix, voff, vals, P, k, buf, msl, gini,
               tab, hist_ratio, W, S):
    """Greedy split of one node holding rows[lo:hi] (class counts cnt), as specified in
    dare.py: the first min(P, p) non-constant attributes in keyed order
    (h2(nk ^ TAG_GATTR, a), stable); per attribute the valid adjacent value pairs ranked by
    (h2(h2(nk ^ TAG_THR, a), bits(v1)) >> 32, index), the first k scored, the best score
    wins, ties to the earlier (slot, priority, index).

    S[0] receives the sampled attributes (-1: none). With `cache`, S also receives per
    slot the first k + buf pairs (r1, r2, left counts), whether they are all the valid
    pairs, the cut-off (priority, v1) and, where the attribute has at most one distinct
    value per `hist_ratio` records, its value group table.

    Returns (ok, attr, r1, r2, slots found, runner-up): the runner-up is the best score of
    the other scored candidates (-inf: none; +inf with entropy, where deletions have no
    cheap bound on how far a score moves)."""
    keys, tmp, dense, g_rank, g_cnt, hb, order, bkey, dtot, pg, pc, Lb, Rb, pil, pdot, pnl = W
    s_attr, s_all, s_cutp, s_cutv, s_len, s_r1, s_r2, s_left, s_hlen, s_hoff, s_hr, s_hc = S
    p = rank.shape[1]  # rank is record-major: (slots, features)
    C = cnt.shape[0]
    need = min(P, p)
    KB = k + buf
    K = KB if cache else k
    nt = hi - lo
    for ss in range(P):
        s_attr[ss] = -1
    if cache:
        for ss in range(P):
            s_all[ss] = True
            s_cutp[ss] = -1
            s_cutv[ss] = 0.0
            s_len[ss] = 0
            s_hlen[ss] = 0
            s_hoff[ss] = 0
    _order_init(nk ^ _TAG_GATTR, p, hb, order)
    # Gini from running integer sums: a candidate's left side has sum L_c^2 = pil and
    # sum cnt_c L_c = pdot, so its right side has sum R_c^2 = stot - 2 pdot + pil: the
    # same integers score1 forms, so the same bits, in O(1) per candidate
    stot = np.int64(0)
    for c in range(C):
        stot += np.int64(cnt[c]) * np.int64(cnt[c])
    left = p
    best_sc = -np.inf
    second = -np.inf
    best_a = -1
    best_r1 = -1
    best_r2 = -1
    slot = 0
    hpos = 0
    while slot < need and left > 0:
        a = _order_pop(hb, order, left)
        left -= 1
        va = voff[a]
        nv = voff[a + 1] - va
        ng = value_groups(rows, lo, hi, a, rank, y, nv, C, keys, tmp, dense, dtot, g_rank, g_cnt)
        if ng < 2:
            continue  # constant attribute: no slot
        sk = h2(nk ^ _TAG_THR, np.uint64(a))
        nb = 0
        heaped = False
        nvalid = 0
        prev_pure = False
        prev_lab = -1
        for c in range(C):
            pc[0, c] = 0
        pil[0] = 0
        pdot[0] = 0
        pnl[0] = 0
        for g in range(ng):
            nz = 0
            lab = -1
            for c in range(C):
                if g_cnt[g, c] > 0:
                    nz += 1
                    lab = c
            pure = nz == 1
            if g > 0:
                il = pil[g - 1]
                dt = pdot[g - 1]
                nlg = pnl[g - 1]
                for c in range(C):
                    x = g_cnt[g - 1, c]
                    p0 = pc[g - 1, c]
                    pc[g, c] = p0 + x
                    if x > 0:
                        il += (2 * p0 + x) * x
                        dt += cnt[c] * x
                        nlg += x
                pil[g] = il
                pdot[g] = dt
                pnl[g] = nlg
                if not (prev_pure and pure and prev_lab == lab):
                    # = h2(sk, bits(v1)): vmix holds mix(bits(v) + GOLD) per value
                    key = (((mix(sk ^ vmix[va + g_rank[g - 1]]) >> _S32) << _S32)
                           | np.uint64(nvalid))
                    pg[nvalid] = g
                    nvalid += 1
                    # keep the K smallest keys (a max-heap once K are in)
                    if nb < K:
                        bkey[nb] = key
                        nb += 1
                    else:
                        if not heaped:
                            for i in range(K // 2 - 1, -1, -1):
                                _key_down(bkey, i, K)
                            heaped = True
                        if key < bkey[0]:
                            bkey[0] = key
                            _key_down(bkey, 0, K)
            prev_pure = pure
            prev_lab = lab
        if cache:
            _key_sort(bkey, nb, heaped)
        # score the first k pairs in (priority, index) order: with a cache they are sorted;
        # without one they are all nb kept, in any order, and a tie in score goes to the
        # smaller key, as in key order
        bkey_best = np.uint64(0)
        for q in range(min(k, nb)):
            g = pg[np.int64(bkey[q] & _LOW32)]
            nl = pnl[g]
            nr = nt - nl
            if nl >= msl and nr >= msl:
                if gini:
                    il = pil[g]
                    sc = il / nl + (stot - 2 * pdot[g] + il) / nr
                else:
                    for c in range(C):
                        Lb[0, c] = pc[g, c]
                        Rb[0, c] = cnt[c] - pc[g, c]
                    sc = score1(Lb, 0, Rb, 0, nl, nr, gini, tab)
                if sc > best_sc or (sc == best_sc and best_a == a and bkey[q] < bkey_best):
                    second = best_sc
                    best_sc = sc
                    best_a = a
                    best_r1 = g_rank[g - 1]
                    best_r2 = g_rank[g]
                    bkey_best = bkey[q]
                elif sc > second:
                    second = sc
        s_attr[slot] = a
        if cache:
            for q in range(nb):
                g = pg[np.int64(bkey[q] & _LOW32)]
                s_r1[slot * KB + q] = g_rank[g - 1]
                s_r2[slot * KB + q] = g_rank[g]
                for c in range(C):
                    s_left[slot * KB + q, c] = pc[g, c]
            s_len[slot] = nb
            s_all[slot] = nvalid <= KB
            if nb > 0:
                s_cutp[slot] = np.int64(bkey[nb - 1] >> _S32)
                s_cutv[slot] = vals[va + s_r1[slot * KB + nb - 1]]
            if ng * hist_ratio <= nt:
                s_hoff[slot] = hpos
                s_hlen[slot] = ng
                for g in range(ng):
                    s_hr[hpos] = g_rank[g]
                    for c in range(C):
                        s_hc[hpos, c] = g_cnt[g, c]
                    hpos += 1
        slot += 1
    if not gini:
        second = np.inf
    return best_a >= 0, best_a, best_r1, best_r2, slot, second


@njit(cache=True)
def random_one(rows, lo, hi, nk, X, dom, max_draws, hb, order):
    """Random split of one node: the first attribute in keyed order (h2(nk ^ TAG_RATTR, a),
    stable) that is not constant on rows[lo:hi], and the first draw j of its keyed stream
    v_j = (2 u_j - 1) D_a inside [min, max) (the min after max_draws misses, draw -1).
    Returns (ok, attr, threshold, draw)."""
    p = X.shape[0]
    _order_init(nk ^ _TAG_RATTR, p, hb, order)
    for left in range(p, 0, -1):
        a = _order_pop(hb, order, left)
        mn = X[a, rows[lo]]
        mx = mn
        for i in range(lo + 1, hi):
            v = X[a, rows[i]]
            if v < mn:
                mn = v
            if v > mx:
                mx = v
        if mn < mx:
            base = h2(nk ^ _TAG_DRAW, np.uint64(a))
            D = dom[a]
            for j in range(max_draws):
                u = np.float64(h2(base, np.uint64(j)) >> _S11) * _INV53
                v = (2.0 * u - 1.0) * D  # exact: u has 53 bits, D is a power of two
                if v >= mn and v < mx:
                    return True, a, v, j
            return True, a, mn, -1
    return False, -1, 0.0, -1


@njit(cache=True)
def decide_one(rows, lo, hi, tree, path, depth, want_cache, R, Pm, tab, W, S, cnt):
    """The canonical state of one node from its records rows[lo:hi]: (kind, why, attr,
    thr, r1, r2, draw, slots, runner-up score) with its class counts in cnt and a greedy
    node's sampled attributes in S[0]; a cached greedy node's lists in S (want_cache and
    at least cache_min records)."""
    X, rank, y, vals, vmix, voff, dom, tkeys = R
    maxd, drmax, msl, P, k, buf, gini, cache_min, max_draws, hist_ratio = Pm
    C = cnt.shape[0]
    n = hi - lo
    cnt[:] = 0
    for i in range(lo, hi):
        cnt[y[rows[i]]] += 1
    cmax = 0
    for c in range(C):
        if cnt[c] > cmax:
            cmax = cnt[c]
    why = 0
    if depth >= maxd:
        why = W_DEPTH
    elif n < 2 * msl:
        why = W_SMALL
    elif cmax == n:
        why = W_PURE
    kind = LEAF
    attr = -1
    thr = 0.0
    r1 = -1
    r2 = -1
    draw = -1
    ns = 0
    second = np.inf
    if why == 0:
        nk = h2(tkeys[tree], np.uint64(path))
        if depth < drmax:
            ok, attr, thr, draw = random_one(rows, lo, hi, nk, X, dom, max_draws, W[5], W[6])
            if ok:
                kind = RANDOM
            else:
                why = W_CONST
        else:
            ok, attr, r1, r2, ns, second = greedy_one(
                rows, lo, hi, nk, cnt, want_cache and n >= cache_min, rank, y, vmix, voff,
                vals, P, k, buf, msl, gini, tab, hist_ratio, W, S)
            if ok:
                kind = GREEDY
                va = voff[attr]
                thr = midpoint(vals[va + r1], vals[va + r2])
            else:
                attr = -1
                why = W_CONST if ns == 0 else W_MSL
    return kind, why, attr, thr, r1, r2, draw, ns, second


# tasks of one greedy_tasks call are split into this many chunks (each owns its scratch)
_CHUNKS = 16


@njit(cache=True, parallel=True)
def greedy_tasks(nk, n, cnt, rows, off, want_cache, rank, y, vals, vmix, voff, P, k, buf,
                 msl, gini, tab, nvals_max, hist_ratio):
    """Greedy split of each task (node) from its records rows[off[t]:off[t+1]]
    (:func:`greedy_one` per task). Tasks with want_cache that found a split keep their
    lists: entries and value group tables in task then slot order.

    Tasks are independent: they run in parallel, in chunks that each own their scratch
    buffers, writing to per-task places; the lists are then packed in task order, so the
    result does not depend on the number of threads.

    Returns ok, attr, r1, r2 (per task), slot_attr, allf, cutp, cutv, elen (per task and
    slot), the entries' r1, r2 and left counts, hlen (per task and slot) and the group
    tables' ranks and class counts."""
    ntask = nk.shape[0]
    p = rank.shape[1]  # rank is record-major: (slots, features)
    C = cnt.shape[1]
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
    hlen = np.zeros((ntask, P), np.int64)
    e_at = np.zeros(ntask + 1, np.int64)  # each task's place in the unpacked lists
    h_at = np.zeros(ntask + 1, np.int64)
    maxn = 1
    for t in range(ntask):
        e_at[t + 1] = e_at[t] + (P * KB if want_cache[t] else 0)
        h_at[t + 1] = h_at[t] + (P * (n[t] // hist_ratio + 1) if want_cache[t] else 0)
        if n[t] > maxn:
            maxn = n[t]
    u_r1 = np.empty(e_at[ntask], np.int32)
    u_r2 = np.empty(e_at[ntask], np.int32)
    u_left = np.empty((e_at[ntask], C), np.int32)
    u_hr = np.empty(h_at[ntask], np.int32)
    u_hc = np.empty((h_at[ntask], C), np.int32)
    nchunk = min(ntask, _CHUNKS)
    for ch in prange(nchunk):
        W, S = make_work(maxn, nvals_max, p, C, P, KB, hist_ratio)
        s_attr, s_all, s_cutp, s_cutv, s_len, s_r1, s_r2, s_left, s_hlen, s_hoff, s_hr, s_hc = S
        for t in range(ch, ntask, nchunk):
            good, a, r1, r2, _ns, _sc = greedy_one(
                rows, off[t], off[t + 1], nk[t], cnt[t], want_cache[t], rank, y, vmix, voff,
                vals, P, k, buf, msl, gini, tab, hist_ratio, W, S)
            if not good:
                continue
            ok[t] = True
            o_attr[t] = a
            o_r1[t] = r1
            o_r2[t] = r2
            if not want_cache[t]:
                continue
            used = e_at[t]
            hused = h_at[t]
            for ss in range(P):
                slot_attr[t, ss] = s_attr[ss]
                allf[t, ss] = s_all[ss]
                cutp[t, ss] = s_cutp[ss]
                cutv[t, ss] = s_cutv[ss]
                elen[t, ss] = s_len[ss]
                for q in range(s_len[ss]):
                    u_r1[used] = s_r1[ss * KB + q]
                    u_r2[used] = s_r2[ss * KB + q]
                    for c in range(C):
                        u_left[used, c] = s_left[ss * KB + q, c]
                    used += 1
                hlen[t, ss] = s_hlen[ss]
                for q in range(s_hlen[ss]):
                    u_hr[hused] = s_hr[s_hoff[ss] + q]
                    for c in range(C):
                        u_hc[hused, c] = s_hc[s_hoff[ss] + q, c]
                    hused += 1
    ne = 0
    nh = 0
    for t in range(ntask):
        if ok[t] and want_cache[t]:
            ne += elen[t].sum()
            nh += hlen[t].sum()
    e_r1 = np.empty(ne, np.int32)
    e_r2 = np.empty(ne, np.int32)
    e_left = np.empty((ne, C), np.int32)
    h_r = np.empty(nh, np.int32)
    h_c = np.empty((nh, C), np.int32)
    used = 0
    hused = 0
    for t in range(ntask):
        if not (ok[t] and want_cache[t]):
            continue
        m = elen[t].sum()
        e_r1[used:used + m] = u_r1[e_at[t]:e_at[t] + m]
        e_r2[used:used + m] = u_r2[e_at[t]:e_at[t] + m]
        e_left[used:used + m] = u_left[e_at[t]:e_at[t] + m]
        used += m
        m = hlen[t].sum()
        h_r[hused:hused + m] = u_hr[h_at[t]:h_at[t] + m]
        h_c[hused:hused + m] = u_hc[h_at[t]:h_at[t] + m]
        hused += m
    return (ok, o_attr, o_r1, o_r2, slot_attr, allf, cutp, cutv, elen, e_r1, e_r2, e_left,
            hlen, h_r, h_c)


# ----------------------------------------------------------------------------- building
#
# Pools are passed as tuples (see DaREForest._pools): N the node arrays and the node free
# list, CC the cache table and its free list, E the candidate entries, H the value group
# tables, LAY the per-tree record layout. ctr holds the pools' counters (CTR_* below);
# kernels that may run out of room check before they write and return 1, leaving their
# state resumable, and the caller grows the pools and calls again.

CTR_NFREE, CTR_CFREE, CTR_EUSED, CTR_EGARB, CTR_HUSED, CTR_HGARB, CTR_SP = 0, 1, 2, 3, 4, 5, 6
CTR_NEED_E, CTR_NEED_H = 7, 8
CTR_AT_TREE, CTR_AT_NODE, CTR_NFLAG = 9, 10, 11  # where a resumable deletion stopped
CTR_WORK = 12  # records x levels the builder went through (its cost, for estimates)
CTR_LEN = 13


@njit(cache=True)
def bound_of(second):
    """What a greedy node keeps of its runner-up score: an upper bound on every other
    scored candidate's score, with room for rounding (a Gini score is computed with a
    relative error below 1e-15); +inf where no bound is known."""
    if second == -np.inf or second == np.inf:
        return second
    return second + 1e-9 * (abs(second) + 1.0)


@njit(cache=True)
def uncache_node(nd, N, CC, ctr):
    """Release node nd's cache row (its entries and group tables become garbage)."""
    n_cid = N[16]
    c_attr, c_len, c_hlen, cfree = CC[0], CC[2], CC[7], CC[8]
    cid = n_cid[nd]
    if cid < 0:
        return
    for ss in range(c_attr.shape[1]):
        ctr[CTR_EGARB] += c_len[cid, ss]
        ctr[CTR_HGARB] += c_hlen[cid, ss]
        c_attr[cid, ss] = -1
        c_len[cid, ss] = 0
        c_hlen[cid, ss] = 0
    n_cid[nd] = -1
    cfree[ctr[CTR_CFREE]] = cid
    ctr[CTR_CFREE] += 1


@njit(cache=True)
def install_cache(cid, CC, E, H, S, ctr, KB):
    """Write one node's lists from the scratch S (:func:`greedy_one`) into cache row cid,
    appending its entries and group tables to the pools (room was checked by the caller)."""
    c_attr, c_off, c_len, c_all, c_cutp, c_cutv, c_hoff, c_hlen, _cfree = CC
    er1, er2, eleft = E
    hr, hc = H
    s_attr, s_all, s_cutp, s_cutv, s_len, s_r1, s_r2, s_left, s_hlen, s_hoff, s_hr, s_hc = S
    C = s_left.shape[1]
    eu = ctr[CTR_EUSED]
    hu = ctr[CTR_HUSED]
    for ss in range(c_attr.shape[1]):
        ctr[CTR_EGARB] += c_len[cid, ss]
        ctr[CTR_HGARB] += c_hlen[cid, ss]
        c_attr[cid, ss] = s_attr[ss]
        c_all[cid, ss] = s_all[ss]
        c_cutp[cid, ss] = s_cutp[ss]
        c_cutv[cid, ss] = s_cutv[ss]
        ln = s_len[ss]
        c_off[cid, ss] = eu
        c_len[cid, ss] = ln
        for q in range(ln):
            er1[eu] = s_r1[ss * KB + q]
            er2[eu] = s_r2[ss * KB + q]
            for c in range(C):
                eleft[c, eu] = s_left[ss * KB + q, c]
            eu += 1
        hl = s_hlen[ss]
        c_hoff[cid, ss] = hu
        c_hlen[cid, ss] = hl
        for q in range(hl):
            hr[hu] = s_hr[s_hoff[ss] + q]
            for c in range(C):
                hc[hu, c] = s_hc[s_hoff[ss] + q, c]
            hu += 1
    ctr[CTR_EUSED] = eu
    ctr[CTR_HUSED] = hu


@njit(cache=True)
def layout_rows(samp: np.ndarray, tree: np.ndarray, s: np.ndarray, e: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """The live records of nodes with layout ranges [s[i], e[i]) of tree[i]: CSR (rows,
    off). One pass to count, one to fill: a node high in a tree holds most records."""
    m = tree.shape[0]
    off = np.zeros(m + 1, np.int64)
    for i in range(m):
        c = 0
        for q in range(s[i], e[i]):
            if samp[tree[i], q] >= 0:
                c += 1
        off[i + 1] = off[i] + c
    rows = np.empty(off[m], np.int64)
    for i in range(m):
        j = off[i]
        for q in range(s[i], e[i]):
            sl = samp[tree[i], q]
            if sl >= 0:
                rows[j] = sl
                j += 1
    return rows, off


@njit(cache=True)
def prepare_rebuild(roots: np.ndarray, N: tuple, CC: tuple, LAY: tuple, ctr: np.ndarray,
                    rows: np.ndarray, stack: np.ndarray) -> int:
    """Free everything below each root (and the roots' caches), gather each root's live
    records from the layout into `rows` and push the roots as build tasks on `stack`
    (node, tree, path, depth, s, e, lo, hi). Returns the number of records gathered."""
    n_tree, n_depth, n_path, n_kind, n_left, n_right = N[0], N[1], N[2], N[3], N[5], N[6]
    n_s, n_e, n_used, nfree = N[14], N[15], N[17], N[18]
    samp = LAY[0]
    dfs = np.empty(256, np.int64)
    m = 0
    sp = ctr[CTR_SP]
    for i in range(roots.shape[0]):
        rt = roots[i]
        top = 0
        if n_kind[rt] != LEAF:
            dfs[0] = n_left[rt]
            dfs[1] = n_right[rt]
            top = 2
        while top > 0:
            top -= 1
            u = dfs[top]
            if n_kind[u] != LEAF:
                dfs[top] = n_left[u]
                dfs[top + 1] = n_right[u]
                top += 2
            uncache_node(u, N, CC, ctr)
            n_used[u] = False
            n_kind[u] = LEAF
            n_left[u] = -1
            n_right[u] = -1
            nfree[ctr[CTR_NFREE]] = u
            ctr[CTR_NFREE] += 1
        uncache_node(rt, N, CC, ctr)
        t = n_tree[rt]
        lo = m
        for q in range(n_s[rt], n_e[rt]):
            sl = samp[t, q]
            if sl >= 0:
                rows[m] = sl
                m += 1
        stack[sp, 0] = rt
        stack[sp, 1] = t
        stack[sp, 2] = n_path[rt]
        stack[sp, 3] = n_depth[rt]
        stack[sp, 4] = n_s[rt]
        stack[sp, 5] = n_e[rt]
        stack[sp, 6] = lo
        stack[sp, 7] = m
        sp += 1
    ctr[CTR_SP] = sp
    return m


@njit(cache=True)
def build_subtrees(stack: np.ndarray, ctr: np.ndarray, rows: np.ndarray, N: tuple, CC: tuple,
                   E: tuple, H: tuple, R: tuple, LAY: tuple, Pm: tuple, tab: np.ndarray,
                   W: tuple, S: tuple, cnt: np.ndarray) -> int:
    """Grow the subtrees of the tasks on `stack`, depth first, from their records (ranges
    of `rows`, partitioned in place): every node is :func:`decide_one` of its records;
    greedy nodes with at least cache_min records keep their lists; leaves place their
    records in the layout. Returns 0 when done, 1 when a pool is short (the caller grows
    the pools, ctr[CTR_NEED_H] says how many group table entries, and calls again)."""
    (n_tree, n_depth, n_path, n_kind, n_why, n_left, n_right, n_attr, n_thr, n_r1, n_r2,
     n_draw, n_n, n_cnt, n_s, n_e, n_cid, n_used, nfree, n_bound, n_sattr) = N
    cfree = CC[8]
    s_attr = S[0]
    samp, pos = LAY
    rank, X = R[1], R[0]
    _maxd, _drmax, _msl, P, k, buf, _gini, cache_min, _md, hist_ratio = Pm
    KB = k + buf
    C = cnt.shape[0]
    ecap = E[0].shape[0]
    hcap = H[0].shape[0]
    sp = ctr[CTR_SP]
    while sp > 0:
        nd = stack[sp - 1, 0]
        tree = stack[sp - 1, 1]
        path = stack[sp - 1, 2]
        depth = stack[sp - 1, 3]
        s = stack[sp - 1, 4]
        e = stack[sp - 1, 5]
        lo = stack[sp - 1, 6]
        hi = stack[sp - 1, 7]
        n = hi - lo
        need_h = P * (n // hist_ratio + 1)
        if (ctr[CTR_NFREE] < 2 or ctr[CTR_CFREE] < 1 or ctr[CTR_EUSED] + P * KB > ecap
                or ctr[CTR_HUSED] + need_h > hcap):
            ctr[CTR_SP] = sp
            ctr[CTR_NEED_E] = P * KB
            ctr[CTR_NEED_H] = need_h
            return 1
        sp -= 1
        kind, why, attr, thr, r1, r2, draw, _ns, second = decide_one(
            rows, lo, hi, tree, path, depth, True, R, Pm, tab, W, S, cnt)
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
        n_draw[nd] = draw
        n_cid[nd] = -1
        if kind == GREEDY:
            n_bound[nd] = bound_of(second)
            for ss in range(P):
                n_sattr[nd, ss] = s_attr[ss]
        if kind == GREEDY and n >= cache_min:
            cid = cfree[ctr[CTR_CFREE] - 1]
            ctr[CTR_CFREE] -= 1
            install_cache(cid, CC, E, H, S, ctr, KB)
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
        stack[sp, 0] = rk
        stack[sp, 1] = tree
        stack[sp, 2] = (path << 1) | 1
        stack[sp, 3] = depth + 1
        stack[sp, 4] = s + nl
        stack[sp, 5] = e
        stack[sp, 6] = lo + nl
        stack[sp, 7] = hi
        sp += 1
        stack[sp, 0] = lk
        stack[sp, 1] = tree
        stack[sp, 2] = path << 1
        stack[sp, 3] = depth + 1
        stack[sp, 4] = s
        stack[sp, 5] = s + nl
        stack[sp, 6] = lo
        stack[sp, 7] = lo + nl
        sp += 1
    ctr[CTR_SP] = 0
    return 0


@njit(cache=True)
def node_tables(nodes: np.ndarray, N: tuple, CC: tuple, H: tuple, R: tuple, LAY: tuple,
                ctr: np.ndarray, hist_ratio: int, W: tuple) -> int:
    """(Re)compute the value group tables of the cached slots of `nodes` from their records
    (after loading a saved forest, which does not store them). Returns 1 if the group
    table pool is short (nothing written for the node it stopped at; call again with the
    remaining nodes, from ctr[CTR_SP])."""
    n_tree, n_n, n_s, n_e, n_cid = N[0], N[12], N[14], N[15], N[16]
    c_attr, c_hoff, c_hlen = CC[0], CC[6], CC[7]
    hr, hc = H
    rank, y, voff = R[1], R[2], R[5]
    samp = LAY[0]
    keys, tmp, dense, g_rank, g_cnt, dtot = W[0], W[1], W[2], W[3], W[4], W[8]
    C = g_cnt.shape[1]
    P = c_attr.shape[1]
    rows = np.empty(max(samp.shape[1], 1), np.int64)
    for i in range(ctr[CTR_SP], nodes.shape[0]):
        nd = nodes[i]
        cid = n_cid[nd]
        if cid < 0:
            continue
        if ctr[CTR_HUSED] + P * (n_n[nd] // hist_ratio + 1) > hr.shape[0]:
            ctr[CTR_SP] = i
            ctr[CTR_NEED_H] = P * (n_n[nd] // hist_ratio + 1)
            return 1
        t = n_tree[nd]
        m = 0
        for q in range(n_s[nd], n_e[nd]):
            sl = samp[t, q]
            if sl >= 0:
                rows[m] = sl
                m += 1
        for ss in range(P):
            ctr[CTR_HGARB] += c_hlen[cid, ss]
            c_hlen[cid, ss] = 0
            a = c_attr[cid, ss]
            if a < 0:
                continue
            nv = voff[a + 1] - voff[a]
            ng = value_groups(rows, 0, m, a, rank, y, nv, C, keys, tmp, dense, dtot, g_rank,
                              g_cnt)
            if ng * hist_ratio > m:
                continue
            hu = ctr[CTR_HUSED]
            c_hoff[cid, ss] = hu
            c_hlen[cid, ss] = ng
            for g in range(ng):
                hr[hu + g] = g_rank[g]
                for c in range(C):
                    hc[hu + g, c] = g_cnt[g, c]
            ctr[CTR_HUSED] = hu + ng
    ctr[CTR_SP] = nodes.shape[0]
    return 0
