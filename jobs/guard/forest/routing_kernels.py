"""The forest guard's compiled kernels: routing queries to leaves and, per query, the
largest gain a single deletion can give a class (:mod:`jobs.guard.forest.forest_guard`).
See docs/DESIGN.md (Beyond LUCID, for DaRE forests)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

#: the forest's trees in compact node ids (:meth:`ForestStructure.kernel`): routing, class
#: counts, and each leaf's records (``rec[rec_off[u]:rec_off[u + 1]]``, record positions)
#: with their labels ``y``
Trees = NamedTuple("Trees", [(name, np.ndarray) for name in (
    "root", "kind", "left", "right", "attr", "thr", "cnt", "n", "rec_off", "rec", "y")])


class PairIndex(NamedTuple):
    """Per compact node (CSR): the exact pairs' records and subtree roots, and the
    worst-case pairs' records."""

    f_off: np.ndarray
    f_rec: np.ndarray
    f_root: np.ndarray
    w_off: np.ndarray
    w_rec: np.ndarray


#: the exact pairs' grown subtrees, as nodes of one pool (:meth:`FragilePairs.pool`)
GrownPool = NamedTuple("GrownPool", [(name, np.ndarray) for name in (
    "leaf", "attr", "thr", "left", "right", "cnt", "n")])


#: a leaf holding more records than this is not read record by record per query: its
#: records' closed forms are bounded per class instead (sound; looser by about one over the
#: leaf's records, nothing next to a margin at that size). At 10^6 rows a query met 2.2
#: million leaf records over 50 trees, 0.22 s of CPU
LEAF_SCAN = 1024


class QueryArrays(NamedTuple):
    """Everything :func:`gains` reads: the trees, the pairs by node, their subtrees, the
    number of records, the deepest leaf's depth, and the most records a leaf may hold to
    be read record by record (:data:`LEAF_SCAN`)."""

    trees: Trees
    pairs: PairIndex
    grown: GrownPool
    n_records: int
    depth_max: int
    leaf_scan: int


@njit(cache=True)
def route(Q, tr):  # pragma: no cover - compiled
    """Leaf (compact id) of every (tree, query), shape (T, n); `tr`: :class:`Trees`."""
    root, kind, left, right, attr, thr = tr.root, tr.kind, tr.left, tr.right, tr.attr, tr.thr
    n = Q.shape[0]
    T = root.shape[0]
    out = np.empty((T, n), dtype=np.int64)
    for i in range(n):
        for t in range(T):
            k = root[t]
            while kind[k] != 0:
                k = left[k] if Q[i, attr[k]] <= thr[k] else right[k]
            out[t, i] = k
    return out


@njit(cache=True)
def _leaf_changes(cnt_k, nl, p, out):  # pragma: no cover - compiled
    """out[c, j]: how class j's probability at a leaf of `nl` records (counts `cnt_k`,
    probabilities `p`) moves when one record of class c leaves it."""
    C = out.shape[0]
    for c in range(C):
        for j in range(C):
            out[c, j] = (cnt_k[j] - (1.0 if j == c else 0.0)) / (nl - 1) - p[j]


@njit(cache=True)
def gains(Q, qa):  # pragma: no cover - compiled
    """Per query i: H[i, a, b] = max over records x of sum_t (hi_{t,x,b} - lo_{t,x,a}) / T
    and delta[i] = max over x, c of the largest |sum_t| of its bounds / T, where a tree's
    (hi, lo) for x is its exact change (closed form for a stable record of q's leaf; for
    an exact fragile pair on q's path, the leaf of its grown subtree that q reaches
    against q's leaf), or the worst a tree can do for a worst-case pair on q's path:
    hi_b = 1 - p_b, lo_a = -p_a. Records whose deletion changes nothing at q give 0.
    Exact (per-record sums) where q's leaves hold at most `leaf_scan` records; a larger
    leaf adds, for every record of a class it holds, the most that class's closed form can
    add there (per class, not per record). `qa`: :class:`QueryArrays`."""
    tr, ix, g_ = qa.trees, qa.pairs, qa.grown
    n_records = qa.n_records
    root, kind, left, right, attr, thr = tr.root, tr.kind, tr.left, tr.right, tr.attr, tr.thr
    cnt, nn, rec_off, rec, y = tr.cnt, tr.n, tr.rec_off, tr.rec, tr.y
    f_off, f_rec, f_root, w_off, w_rec = ix.f_off, ix.f_rec, ix.f_root, ix.w_off, ix.w_rec
    g_leaf, g_attr, g_thr, g_left, g_right = g_.leaf, g_.attr, g_.thr, g_.left, g_.right
    g_cnt, g_n = g_.cnt, g_.n
    n = Q.shape[0]
    T = root.shape[0]
    C = cnt.shape[1]
    # the records a query meets: those of its pairs and of its leaves read one by one
    cap = max(1, min(n_records, f_off[-1] + w_off[-1] + T * qa.leaf_scan))
    loc = np.full(n_records, -1, np.int32)  # record -> its row below while met
    stamp = np.full(n_records, -1, np.int32)  # the tree where it last had a pair
    who = np.empty(cap, np.int64)
    hi = np.zeros((cap, C))
    lo = np.zeros((cap, C))
    # per record met: the large leaves' per-class terms its pairs replace
    corr = np.zeros((cap, C, C))
    corr_d = np.zeros((cap, C))
    # per class: the large leaves' closed forms, bounded (gain of b on a; |change of a|)
    big_h = np.zeros((C, C, C))
    big_d = np.zeros((C, C))
    big_has = np.zeros(C, np.bool_)
    dcs = np.zeros((C, C))
    path = np.empty(qa.depth_max + 2, np.int64)
    p = np.empty(C)
    H = np.zeros((n, C, C))
    delta = np.zeros(n)
    for i in range(n):
        nt = 0
        big_h[:] = 0.0
        big_d[:] = 0.0
        big_has[:] = False
        for t in range(T):
            k = root[t]
            d = 0
            while kind[k] != 0:
                path[d] = k
                d += 1
                k = left[k] if Q[i, attr[k]] <= thr[k] else right[k]
            path[d] = k
            d += 1
            nl = nn[k]
            for c in range(C):
                p[c] = cnt[k, c] / max(nl, 1)
            big = nl > max(qa.leaf_scan, 1)  # (a leaf of one record has no closed form)
            if big:
                _leaf_changes(cnt[k], nl, p, dcs)
                for c in range(C):
                    if cnt[k, c] == 0:
                        continue  # no record of class c leaves this leaf
                    big_has[c] = True
                    for a in range(C):
                        big_d[c, a] += abs(dcs[c, a])
                        for b in range(C):
                            big_h[c, a, b] += max(0.0, dcs[c, b] - dcs[c, a])
            for j in range(d):
                u = path[j]
                for e in range(f_off[u], f_off[u + 1]):  # exact pair: its grown subtree
                    x = f_rec[e]
                    m, nt = _meet(loc, who, x, nt)
                    if big and stamp[x] != t:
                        _replace(corr, corr_d, m, dcs, y[x], cnt[k, y[x]] > 0)
                    stamp[x] = t
                    g = f_root[e]
                    while not g_leaf[g]:
                        g = g_left[g] if Q[i, g_attr[g]] <= g_thr[g] else g_right[g]
                    for c in range(C):
                        dc = g_cnt[g, c] / max(g_n[g], 1) - p[c]
                        hi[m, c] += dc
                        lo[m, c] += dc
                for e in range(w_off[u], w_off[u + 1]):  # worst-case pair
                    x = w_rec[e]
                    m, nt = _meet(loc, who, x, nt)
                    if big and stamp[x] != t:
                        _replace(corr, corr_d, m, dcs, y[x], cnt[k, y[x]] > 0)
                    stamp[x] = t
                    for c in range(C):
                        hi[m, c] += 1.0 - p[c]
                        lo[m, c] -= p[c]
            if big:
                continue
            for e in range(rec_off[k], rec_off[k + 1]):  # stable in q's leaf: closed form
                x = rec[e]
                if stamp[x] == t or nl <= 1:
                    continue
                m, nt = _meet(loc, who, x, nt)
                yx = y[x]
                for c in range(C):
                    dc = (cnt[k, c] - (1.0 if c == yx else 0.0)) / (nl - 1) - p[c]
                    hi[m, c] += dc
                    lo[m, c] += dc
        base = 0.0 if nt < n_records else -np.inf
        for a in range(C):
            for b in range(C):
                H[i, a, b] = base if a != b else 0.0
        for c in range(C):  # a record no pair and no small leaf met
            if big_has[c]:
                for a in range(C):
                    delta[i] = max(delta[i], big_d[c, a] / T)
                    for b in range(C):
                        if a != b:
                            H[i, a, b] = max(H[i, a, b], big_h[c, a, b] / T)
        for m in range(nt):
            x = who[m]
            c = y[x]
            for a in range(C):
                delta[i] = max(delta[i], (max(abs(hi[m, a]), abs(lo[m, a]))
                                          + big_d[c, a] - corr_d[m, a]) / T)
                for b in range(C):
                    if a != b:
                        H[i, a, b] = max(H[i, a, b], (hi[m, b] - lo[m, a]
                                                      + big_h[c, a, b] - corr[m, a, b]) / T)
            hi[m, :] = 0.0
            lo[m, :] = 0.0
            corr[m, :, :] = 0.0
            corr_d[m, :] = 0.0
            stamp[x] = -1
            loc[x] = -1
    return H, delta


@njit(cache=True)
def _meet(loc, who, x, nt):  # pragma: no cover - compiled
    """Record x's row among the records a query met (a new one at `nt` the first time),
    and how many rows are in use."""
    m = loc[x]
    if m < 0:
        m = nt
        loc[x] = m
        who[m] = x
        nt += 1
    return m, nt


@njit(cache=True)
def _replace(corr, corr_d, m, dcs, c, held):  # pragma: no cover - compiled
    """Record m (class c) has a pair in a tree whose leaf is large: the pair's own change
    stands for that tree, so the class's bounded term there is taken back from it."""
    if not held:
        return
    C = dcs.shape[0]
    for a in range(C):
        corr_d[m, a] += abs(dcs[c, a])
        for b in range(C):
            corr[m, a, b] += max(0.0, dcs[c, b] - dcs[c, a])
