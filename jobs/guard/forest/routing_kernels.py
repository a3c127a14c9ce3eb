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


class QueryArrays(NamedTuple):
    """Everything :func:`gains` reads: the trees, the pairs by node, their subtrees, the
    number of records and the deepest leaf's depth."""

    trees: Trees
    pairs: PairIndex
    grown: GrownPool
    n_records: int
    depth_max: int


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
def gains(Q, qa):  # pragma: no cover - compiled
    """Per query i: H[i, a, b] = max over records x of sum_t (hi_{t,x,b} - lo_{t,x,a}) / T
    and delta[i] = max over x, c of the largest |sum_t| of its bounds / T, where a tree's
    (hi, lo) for x is its exact change (closed form for a stable record of q's leaf; for
    an exact fragile pair on q's path, the leaf of its grown subtree that q reaches
    against q's leaf), or the worst a tree can do for a worst-case pair on q's path:
    hi_b = 1 - p_b, lo_a = -p_a. Records whose deletion changes nothing at q give 0.
    `qa`: :class:`QueryArrays`."""
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
    hi = np.zeros((n_records, C))
    lo = np.zeros((n_records, C))
    stamp = np.full(n_records, -1, np.int64)
    met = np.zeros(n_records, np.bool_)
    touched = np.empty(n_records, np.int64)
    path = np.empty(qa.depth_max + 2, np.int64)
    p = np.empty(C)
    H = np.zeros((n, C, C))
    delta = np.zeros(n)
    for i in range(n):
        nt = 0
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
            for j in range(d):
                u = path[j]
                for e in range(f_off[u], f_off[u + 1]):  # exact pair: its grown subtree
                    x = f_rec[e]
                    stamp[x] = t
                    if not met[x]:
                        met[x] = True
                        touched[nt] = x
                        nt += 1
                    g = f_root[e]
                    while not g_leaf[g]:
                        g = g_left[g] if Q[i, g_attr[g]] <= g_thr[g] else g_right[g]
                    for c in range(C):
                        dc = g_cnt[g, c] / max(g_n[g], 1) - p[c]
                        hi[x, c] += dc
                        lo[x, c] += dc
                for e in range(w_off[u], w_off[u + 1]):  # worst-case pair
                    x = w_rec[e]
                    stamp[x] = t
                    if not met[x]:
                        met[x] = True
                        touched[nt] = x
                        nt += 1
                    for c in range(C):
                        hi[x, c] += 1.0 - p[c]
                        lo[x, c] -= p[c]
            for e in range(rec_off[k], rec_off[k + 1]):  # stable in q's leaf: closed form
                x = rec[e]
                if stamp[x] == t or nl <= 1:
                    continue
                if not met[x]:
                    met[x] = True
                    touched[nt] = x
                    nt += 1
                yx = y[x]
                for c in range(C):
                    dc = (cnt[k, c] - (1.0 if c == yx else 0.0)) / (nl - 1) - p[c]
                    hi[x, c] += dc
                    lo[x, c] += dc
        base = 0.0 if nt < n_records else -np.inf
        for a in range(C):
            for b in range(C):
                H[i, a, b] = base if a != b else 0.0
        for m in range(nt):
            x = touched[m]
            for a in range(C):
                delta[i] = max(delta[i], max(abs(hi[x, a]), abs(lo[x, a])) / T)
                for b in range(C):
                    if a != b:
                        H[i, a, b] = max(H[i, a, b], (hi[x, b] - lo[x, a]) / T)
            for c in range(C):
                hi[x, c] = 0.0
                lo[x, c] = 0.0
            stamp[x] = -1
            met[x] = False
    return H, delta
