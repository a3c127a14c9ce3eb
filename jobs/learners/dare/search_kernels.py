"""Compiled (numba) split search of the DaRE forest: keyed hashing, the canonical state of one
node (:func:`decide_one`) and the greedy search of many nodes at once (:func:`greedy_tasks`).
Each function reproduces, bit for bit, a rule the docs state; integer counts stay integers
and one function, :func:`score1`, scores a candidate on every path, so equal counts give
equal bits. ``cache=True`` keeps the compiled code in ``__pycache__`` beside this file.
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

from typing import NamedTuple

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




class SearchScratch(NamedTuple):
    """Work buffers of the split search of one node (:func:`make_work`); the dense tables
    are zeroed and left zeroed by every use."""

    keys: np.ndarray  # (rank, label) sort keys of the node's records
    tmp: np.ndarray  # radix sort buffer
    dense: np.ndarray  # value x class counts (ties: counted, not sorted)
    g_rank: np.ndarray  # the node's value groups: rank
    g_cnt: np.ndarray  # and class counts
    attr_hash: np.ndarray  # heap of the keyed attribute order: hashes
    attr_heap: np.ndarray  # and attributes
    best_keys: np.ndarray  # keys (priority, index) of the K first valid pairs
    dense_tot: np.ndarray  # records per value of the dense table
    pair_group: np.ndarray  # valid pair j: the group of its upper value
    prefix_cnt: np.ndarray  # class counts of the groups below group g
    left_row: np.ndarray  # (1, C) counts :func:`score1` reads
    right_row: np.ndarray
    prefix_sq: np.ndarray  # sum_c L_c^2 below group g
    prefix_dot: np.ndarray  # sum_c cnt_c L_c below group g
    prefix_n: np.ndarray  # records below group g


class NodeLists(NamedTuple):
    """One node's candidate lists per sampled attribute slot, as a cached node keeps them
    (:func:`greedy_one` with `cache`): pairs of slot s at s * (k + buffer) + q."""

    attr: np.ndarray  # sampled attribute per slot (-1: none)
    all_pairs: np.ndarray  # the slot lists every valid pair
    cut_prio: np.ndarray  # cut-off key (priority, v1) of the list
    cut_value: np.ndarray
    length: np.ndarray
    r1: np.ndarray
    r2: np.ndarray
    left: np.ndarray  # (pairs, C) left class counts
    table_len: np.ndarray  # the slot's value group table (0: none)
    table_off: np.ndarray
    table_rank: np.ndarray
    table_cnt: np.ndarray


class GreedySplit(NamedTuple):
    """:func:`greedy_one`'s answer: the runner-up is the best score of the other scored
    candidates (-inf: none; +inf with entropy, where deletions have no cheap bound on
    how far a score moves)."""

    ok: bool
    attr: int
    r1: int
    r2: int
    slots: int  # sampled attributes found
    second: float


class RandomSplit(NamedTuple):
    ok: bool
    attr: int
    thr: float
    draw: int  # -1: the fallback after max_draws misses


class NodeDecision(NamedTuple):
    """:func:`decide_one`'s answer: a node's canonical state."""

    kind: int
    why: int
    attr: int
    thr: float
    r1: int
    r2: int
    draw: int
    slots: int
    second: float


class TaskSplits(NamedTuple):
    """:func:`greedy_tasks`' answer: per task the split, per task and slot the lists, and
    the lists' entries and value group tables packed in task then slot order."""

    ok: np.ndarray
    attr: np.ndarray
    r1: np.ndarray
    r2: np.ndarray
    slot_attr: np.ndarray
    all_pairs: np.ndarray
    cut_prio: np.ndarray
    cut_value: np.ndarray
    length: np.ndarray
    e_r1: np.ndarray
    e_r2: np.ndarray
    e_left: np.ndarray
    table_len: np.ndarray
    t_rank: np.ndarray
    t_cnt: np.ndarray


@njit(cache=True)
def make_work(maxn: int, maxnv: int, p: int, C: int, P: int, KB: int,
              hist_ratio: int) -> tuple[SearchScratch, NodeLists]:
    """Scratch buffers of the split search for nodes of up to maxn records."""
    maxn = max(maxn, 1)
    maxnv = max(maxnv, 1)
    work = SearchScratch(
        np.empty(maxn, np.int64), np.empty(maxn, np.int64), np.zeros(maxnv * C, np.int64),
        np.empty(maxn, np.int64), np.empty((maxn, C), np.int64), np.empty(p, np.uint64),
        np.empty(p, np.int64), np.empty(KB, np.uint64), np.zeros(maxnv, np.int64),
        np.empty(maxn, np.int64), np.empty((maxn, C), np.int64), np.zeros((1, C), np.int64),
        np.zeros((1, C), np.int64), np.empty(maxn, np.int64), np.empty(maxn, np.int64),
        np.empty(maxn, np.int64))
    H = P * (maxn // hist_ratio + 1)
    lists = NodeLists(
        np.empty(P, np.int64), np.empty(P, np.bool_), np.empty(P, np.int64),
        np.empty(P, np.float64), np.empty(P, np.int64), np.empty(P * KB, np.int64),
        np.empty(P * KB, np.int64), np.empty((P * KB, C), np.int64), np.empty(P, np.int64),
        np.empty(P, np.int64), np.empty(H, np.int64), np.empty((H, C), np.int64))
    return work, lists


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
def drain_groups(dense, dtot, base, nv, C, g_rank, g_cnt):
    """The groups counted densely at values base..base+nv-1 (class counts of value q at
    dense[(base + q) * C:], its total at dtot[base + q]) into g_rank[:ng] ascending and
    g_cnt[:ng], zeroing the counts read; returns ng."""
    ng = 0
    for q in range(nv):
        if dtot[base + q] > 0:
            dtot[base + q] = 0
            b = (base + q) * C
            g_rank[ng] = q
            for c in range(C):
                g_cnt[ng, c] = dense[b + c]
                dense[b + c] = 0
            ng += 1
    return ng


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
        return drain_groups(dense, dtot, 0, nv, C, g_rank, g_cnt)
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
def greedy_one(rows, lo, hi, nk, cnt, cache, recs, rule, tab, w, lists):
    """Greedy split of one node holding rows[lo:hi] (class counts cnt), as specified in
    :mod:`jobs.learners.dare.forest`: the first min(P, p) non-constant attributes in keyed
    order (h2(nk ^ TAG_GATTR, a), stable); per attribute the valid adjacent value pairs
    ranked by (h2(h2(nk ^ TAG_THR, a), bits(v1)) >> 32, index), the first k scored, the
    best score wins, ties to the earlier (slot, priority, index).

    lists.attr receives the sampled attributes (-1: none). With `cache`, `lists` also
    receives per slot the first k + buffer pairs (r1, r2, left counts), whether they are
    all the valid pairs, the cut-off (priority, v1) and, where the attribute has at most
    one distinct value per hist_ratio records, its value group table (:class:`NodeLists`).

    One function, not steps: this loop is most of a fit's time (and of a retrain's), and
    splitting it cost a tenth of that."""
    keys, tmp, dense, g_rank, g_cnt = w.keys, w.tmp, w.dense, w.g_rank, w.g_cnt
    hb, order, bkey, dtot, pg = w.attr_hash, w.attr_heap, w.best_keys, w.dense_tot, w.pair_group
    pc, Lb, Rb, pil, pdot, pnl = (w.prefix_cnt, w.left_row, w.right_row, w.prefix_sq,
                                  w.prefix_dot, w.prefix_n)
    s_attr, s_all, s_cutp, s_cutv = lists.attr, lists.all_pairs, lists.cut_prio, lists.cut_value
    s_len, s_r1, s_r2, s_left = lists.length, lists.r1, lists.r2, lists.left
    s_hlen, s_hoff, s_hr, s_hc = lists.table_len, lists.table_off, lists.table_rank, lists.table_cnt
    rank, y, vmix, voff, vals = recs.rank, recs.y, recs.vmix, recs.voff, recs.vals
    P, k, buf, msl, gini = rule.n_sampled, rule.k, rule.buffer, rule.min_samples_leaf, rule.gini
    hist_ratio = rule.hist_ratio
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
    return GreedySplit(best_a >= 0, best_a, best_r1, best_r2, np.int64(slot), second)


@njit(cache=True)
def random_one(rows, lo, hi, nk, X, dom, max_draws, hb, order):
    """Random split of one node: the first attribute in keyed order (h2(nk ^ TAG_RATTR, a),
    stable) that is not constant on rows[lo:hi], and the first draw j of its keyed stream
    v_j = (2 u_j - 1) D_a inside [min, max) (the min after max_draws misses, draw -1)."""
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
                    return RandomSplit(True, a, v, np.int64(j))
            return RandomSplit(True, a, mn, np.int64(-1))
    return RandomSplit(False, np.int64(-1), 0.0, np.int64(-1))


@njit(cache=True)
def decide_one(rows, lo, hi, tree, path, depth, want_cache, recs, rule, tab, w, lists, cnt):
    """The canonical state of one node from its records rows[lo:hi], with its class counts
    in cnt and a greedy node's sampled attributes in lists.attr; a cached greedy node's
    lists in `lists` (want_cache and at least cache_min records)."""
    C = cnt.shape[0]
    n = hi - lo
    cnt[:] = 0
    for i in range(lo, hi):
        cnt[recs.y[rows[i]]] += 1
    cmax = 0
    for c in range(C):
        if cnt[c] > cmax:
            cmax = cnt[c]
    why = 0
    if depth >= rule.max_depth:
        why = W_DEPTH
    elif n < 2 * rule.min_samples_leaf:
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
        nk = h2(recs.tree_keys[tree], np.uint64(path))
        if depth < rule.d_rmax:
            rs = random_one(rows, lo, hi, nk, recs.X, recs.dom, rule.max_draws, w.attr_hash,
                            w.attr_heap)
            attr, thr, draw = rs.attr, rs.thr, rs.draw
            if rs.ok:
                kind = RANDOM
            else:
                why = W_CONST
        else:
            gs = greedy_one(rows, lo, hi, nk, cnt, want_cache and n >= rule.cache_min, recs,
                            rule, tab, w, lists)
            attr, r1, r2, ns, second = gs.attr, gs.r1, gs.r2, gs.slots, gs.second
            if gs.ok:
                kind = GREEDY
                va = recs.voff[attr]
                thr = midpoint(recs.vals[va + r1], recs.vals[va + r2])
            else:
                attr = -1
                why = W_CONST if ns == 0 else W_MSL
    return NodeDecision(kind, why, attr, thr, r1, r2, draw, ns, second)


# tasks of one greedy_tasks call are split into this many chunks (each owns its scratch)
_CHUNKS = 16


@njit(cache=True, parallel=True)
def greedy_tasks(nk, n, cnt, rows, off, want_cache, recs, rule, tab, nvals_max):
    """Greedy split of each task (node) from its records rows[off[t]:off[t+1]]
    (:func:`greedy_one` per task). Tasks with want_cache that found a split keep their
    lists: entries and value group tables in task then slot order (:class:`TaskSplits`).

    Tasks are independent: they run in parallel, in chunks that each own their scratch
    buffers, writing to per-task places; the lists are then packed in task order, so the
    result does not depend on the number of threads."""
    ntask = nk.shape[0]
    p = recs.rank.shape[1]  # rank is record-major: (slots, features)
    C = cnt.shape[1]
    P = rule.n_sampled
    KB = rule.k + rule.buffer
    hist_ratio = rule.hist_ratio
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
    u_pair = np.empty((e_at[ntask], 2), np.int32)  # (r1, r2)
    u_left = np.empty((e_at[ntask], C), np.int32)
    u_hr = np.empty((h_at[ntask], 1), np.int32)
    u_hc = np.empty((h_at[ntask], C), np.int32)
    nchunk = min(ntask, _CHUNKS)
    for ch in prange(nchunk):
        w, lists = make_work(maxn, nvals_max, p, C, P, KB, hist_ratio)
        for t in range(ch, ntask, nchunk):
            gs = greedy_one(rows, off[t], off[t + 1], nk[t], cnt[t], want_cache[t], recs,
                            rule, tab, w, lists)
            if not gs.ok:
                continue
            ok[t] = True
            o_attr[t] = gs.attr
            o_r1[t] = gs.r1
            o_r2[t] = gs.r2
            if not want_cache[t]:
                continue
            used = e_at[t]
            hused = h_at[t]
            for ss in range(P):
                slot_attr[t, ss] = lists.attr[ss]
                allf[t, ss] = lists.all_pairs[ss]
                cutp[t, ss] = lists.cut_prio[ss]
                cutv[t, ss] = lists.cut_value[ss]
                elen[t, ss] = lists.length[ss]
                for q in range(lists.length[ss]):
                    u_pair[used, 0] = lists.r1[ss * KB + q]
                    u_pair[used, 1] = lists.r2[ss * KB + q]
                    for c in range(C):
                        u_left[used, c] = lists.left[ss * KB + q, c]
                    used += 1
                hlen[t, ss] = lists.table_len[ss]
                for q in range(lists.table_len[ss]):
                    u_hr[hused, 0] = lists.table_rank[lists.table_off[ss] + q]
                    for c in range(C):
                        u_hc[hused, c] = lists.table_cnt[lists.table_off[ss] + q, c]
                    hused += 1
    e_pair = _pack(ok, want_cache, elen, e_at, u_pair)
    return TaskSplits(ok, o_attr, o_r1, o_r2, slot_attr, allf, cutp, cutv, elen,
                      e_pair[:, 0].copy(), e_pair[:, 1].copy(),
                      _pack(ok, want_cache, elen, e_at, u_left), hlen,
                      _pack(ok, want_cache, hlen, h_at, u_hr)[:, 0].copy(),
                      _pack(ok, want_cache, hlen, h_at, u_hc))


@njit(cache=True)
def _pack(ok, want_cache, length, at, rows):
    """The rows of `rows` that tasks with lists filled (task t: length[t].sum() rows from
    at[t]), packed in task order."""
    ntask = ok.shape[0]
    total = 0
    for t in range(ntask):
        if ok[t] and want_cache[t]:
            total += length[t].sum()
    out = np.empty((total, rows.shape[1]), rows.dtype)
    used = 0
    for t in range(ntask):
        if not (ok[t] and want_cache[t]):
            continue
        m = length[t].sum()
        out[used:used + m] = rows[at[t]:at[t] + m]
        used += m
    return out
