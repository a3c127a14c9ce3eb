"""A sound iDP label guard for DaRE forests (DESIGN.md, "Beyond LUCID, for DaRE forests").

A :class:`~jobs.learners.dare.DaREForest` answers ``argmax_c p_c(q)`` (lowest class index
on ties) with ``p(q) = mean_t p_t(q)`` and ``p_t(q) = counts / max(n, 1)`` of the leaf of
tree t that q reaches. Its deletions are exact, so every leave-one-out (LOO) forest
``F_{-x}`` is obtained exactly from a copy of the forest and one ``delete([x])``.

The certificate
---------------
Write ``Delta_{t,x}(q) = p_{t,-x}(q) - p_t(q)`` (a vector over the classes of the served
forest; a class that vanishes from ``F_{-x}`` has probability 0 there). One deletion removes
ONE record x, so the LOO forest's probabilities are exactly

    p_{-x}(q) = p(q) + mean_t Delta_{t,x}(q),

and for an ordered pair of classes (a, b) the gain of b on a under the worst deletion is

    H(q)[a, b] = max over records x of mean_t (Delta_{t,x,b}(q) - Delta_{t,x,a}(q)).

The query is **certain** when, for its predicted class w and every c != w,

    p_w(q) - p_c(q)  >  H(q)[w, c] + tol          (STRICT)

Then for every x, ``p_{-x,w}(q) - p_{-x,c}(q) = (p_w - p_c)(q) - mean_t (Delta_{t,x,c} -
Delta_{t,x,w})(q) > tol``: every LOO forest ranks w strictly above every other class, so it
predicts w whatever its tie-break. With ``>=`` the LOO forest could tie w with a class
c < w and answer c (argmax takes the lowest index), which is why equality is not certain.
``tol`` (1e-9 plus 8 T 2^-53) covers floating-point rounding in the means computed by the
served and the LOO forests and in the sums below (a mean of T numbers in [-1, 1] is off by
at most about T 2^-53). ``delta(q) = max_x max_c |mean_t Delta_{t,x,c}(q)|`` is the largest
change of any class probability; ``H[w, c] <= 2 delta``, so "certain" is at least as tight
as "margin > 2 delta(q)". H and delta are the exact maxima over the records (up to
rounding), not bounds of them: the aggregation is per record, so a record that moves
several trees is charged once, with its own changes, and trees it does not touch add 0.

How the changes are stored (exactly, no relaxation)
---------------------------------------------------
Each tree is a partition of R^d into leaf cells ``lo < q <= hi`` (axis-aligned boxes,
:meth:`DaREForest.leaves`), and p_t is constant on each cell. For each record x the LOO
forest is built exactly (deep copy + delete). Per tree:

* the LOO tree has the same cells (same paths and boxes): deleting x changed no split, only
  counts (in practice x's leaf: (n_c - [c = y]) / (n - 1) vs n_c / n, read off the LOO
  forest's own counts). Every leaf l whose probabilities moved gets an entry
  ``(l, x, Delta = p'_l - p_l)``.
* otherwise (a subtree was retrained or a threshold moved): every old cell l is intersected
  with every new cell l' (open-closed boxes, so the intersection is nonempty iff
  ``max(lo, lo') < min(hi, hi')`` in every coordinate). On each intersection both p_t and
  p_{t,-x} are constant, equal to p_l and p'_{l'}. If l lies inside one l', the entry
  ``(l, x, p'_{l'} - p_l)`` holds on all of l; if the new cells split l, each piece gets an
  entry with its change and the coordinates where the piece is narrower than l (its
  constraints). The pieces of l partition l, so at any q in l exactly one applies.

An entry is kept only when its change is nonzero; every other (tree, record) pair leaves
p_t unchanged at q. Serving q: route q down every tree to its leaf (a routing table rebuilt
from the leaf cells and checked against them exactly), add up, per record, the changes of
the entries of those leaves whose constraints q meets (a compiled kernel), and take the
maxima above. Precomputation costs one deletion per record (:attr:`ForestGuard.fit_report`);
serving costs the entries of T leaves per query.

Binding and persistence
-----------------------
The tables are tied to ``forest.content_hash()`` at fit time. Every :meth:`certain` /
:meth:`answer` checks the forest: the hash is recomputed only when the forest's
``generation_`` moved since the last check; on a mismatch (the forest was updated) nothing
is certain and :class:`~jobs.idp.guard.LabelGuard` is bound in noise-all mode, until
:meth:`ForestGuard.refit` recomputes the tables for the new forest. :meth:`ForestGuard.save`
writes the tables with the hash; :meth:`ForestGuard.load` refuses a forest with another
hash. Queries are not clipped: the tables hold on all of R^d.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from jobs.idp.guard import LabelGuard
from jobs.learners.base import (
    check_features,
    hash_arrays,
    read_bundle_meta,
    read_bundle_payload,
    write_bundle,
)
from jobs.learners.dare import DaREForest

SOUND = "sound"
NOISE_ALL = "noise-all"
FORMAT = "obliviate.forest-guard/1"
_TABLES = "tables.npz"


@dataclass
class ForestFitReport:
    seconds: float
    n_records: int
    n_trees: int
    n_leaves: int
    #: (record, tree) pairs whose deletion changed the tree's cells (box intersection used)
    changed_trees: int
    forest_hash: str
    detail: dict[str, Any] = field(default_factory=dict)


def _leaf_probs(L: dict[str, np.ndarray], col: np.ndarray, C: int) -> np.ndarray:
    """Leaf class probabilities (as scores() computes them) in the served class space."""
    P = np.zeros((len(L["node"]), C))
    P[:, col] = L["counts"] / np.maximum(L["n"], 1)[:, None].astype(np.float64)
    return P


# --------------------------------------------------------------------------- tables


@dataclass
class _Table:
    """Nonzero per-tree changes, one entry per (leaf row, record[, piece]), sorted by row.

    Entry e holds at the queries of leaf ``row[e]`` that meet its constraints
    ``cdim/clo/chi[con[e]:con[e + 1]]`` (``clo < q[cdim] <= chi``); there, deleting record
    ``rec[e]`` (index into the fitted forest's ``record_ids_``) changes tree t's class
    probabilities by ``d[e]``. ``start[l]:start[l + 1]`` are the entries of leaf row l.
    """

    row: np.ndarray
    rec: np.ndarray
    d: np.ndarray
    con: np.ndarray
    cdim: np.ndarray
    clo: np.ndarray
    chi: np.ndarray
    start: np.ndarray

    ARRAYS = ("row", "rec", "d", "con", "cdim", "clo", "chi", "start")

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.ARRAYS}

    def fits(self, n_leaves: int, n_records: int, n_features: int, C: int) -> bool:
        """Whether every index is in range and the runs are consistent (loaded tables)."""
        E = len(self.row)
        dtypes_ok = all(getattr(self, k).dtype == np.int64
                        for k in ("row", "rec", "con", "cdim", "start")) and all(
            getattr(self, k).dtype == np.float64 for k in ("d", "clo", "chi"))
        return bool(
            dtypes_ok
            and self.rec.shape == (E,) and self.d.shape == (E, C) and self.con.shape == (E + 1,)
            and self.start.shape == (n_leaves + 1,)
            and self.clo.shape == self.chi.shape == self.cdim.shape == (int(self.con[-1]),)
            and self.con[0] == 0 and (np.diff(self.con) >= 0).all()
            and self.start[0] == 0 and self.start[-1] == E
            and np.array_equal(self.start, np.searchsorted(self.row, np.arange(n_leaves + 1)))
            and ((self.row >= 0) & (self.row < n_leaves)).all() and (np.diff(self.row) >= 0).all()
            and ((self.rec >= 0) & (self.rec < n_records)).all()
            and ((self.cdim >= 0) & (self.cdim < n_features)).all()
        )  # fmt: skip


class _Collector:
    """Gathers the entries of :class:`_Table` while the LOO forests are walked."""

    def __init__(self, p: int, C: int) -> None:
        self.p, self.C = p, C
        self.row: list[np.ndarray] = []
        self.rec: list[np.ndarray] = []
        self.d: list[np.ndarray] = []
        self.ncon: list[np.ndarray] = []
        self.cdim: list[np.ndarray] = []
        self.clo: list[np.ndarray] = []
        self.chi: list[np.ndarray] = []

    def whole(self, rows: np.ndarray, j: int, d: np.ndarray) -> None:
        """Changes that hold on all of each leaf row (zeros dropped)."""
        nz = (d != 0).any(axis=1)
        k = int(nz.sum())
        if k:
            self.row.append(rows[nz])
            self.rec.append(np.full(k, j, dtype=np.int64))
            self.d.append(d[nz])
            self.ncon.append(np.zeros(k, dtype=np.int64))

    def pieces(self, rows: np.ndarray, j: int, d: np.ndarray, plo: np.ndarray, phi: np.ndarray,
               llo: np.ndarray, lhi: np.ndarray) -> None:
        """Changes on pieces (plo, phi] of leaf cells (llo, lhi]: constraints where narrower."""
        nz = (d != 0).any(axis=1)
        if not nz.any():
            return
        rows, d, plo, phi, llo, lhi = rows[nz], d[nz], plo[nz], phi[nz], llo[nz], lhi[nz]
        pi, dim = np.nonzero((plo != llo) | (phi != lhi))  # row-major: grouped by piece
        self.row.append(rows)
        self.rec.append(np.full(len(rows), j, dtype=np.int64))
        self.d.append(d)
        self.ncon.append(np.bincount(pi, minlength=len(rows)).astype(np.int64))
        self.cdim.append(dim.astype(np.int64))
        self.clo.append(plo[pi, dim])
        self.chi.append(phi[pi, dim])

    def table(self, n_leaves: int) -> _Table:
        def cat(parts: list[np.ndarray], shape: tuple[int, ...], dtype: type) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(shape, dtype)

        row = cat(self.row, (0,), np.int64)
        rec = cat(self.rec, (0,), np.int64)
        d = cat(self.d, (0, self.C), np.float64)
        ncon = cat(self.ncon, (0,), np.int64)
        cdim = cat(self.cdim, (0,), np.int64)
        clo = cat(self.clo, (0,), np.float64)
        chi = cat(self.chi, (0,), np.float64)
        order = np.lexsort((rec, row))
        old = np.concatenate([[0], np.cumsum(ncon)])
        ncon = ncon[order]
        con = np.concatenate([[0], np.cumsum(ncon)]).astype(np.int64)
        # constraint segments follow their entries into the new order
        idx = np.repeat(old[:-1][order] - con[:-1], ncon) + np.arange(con[-1])
        row = row[order]
        return _Table(
            row=row, rec=rec[order], d=np.ascontiguousarray(d[order]), con=con,
            cdim=cdim[idx], clo=clo[idx], chi=chi[idx],
            start=np.searchsorted(row, np.arange(n_leaves + 1)).astype(np.int64),
        )  # fmt: skip


def _fit_tables(forest: DaREForest) -> tuple[_Table, ForestFitReport]:
    """The entries of every LOO forest (see the module docstring), one deletion per record."""
    t0 = time.perf_counter()
    h0 = forest.content_hash()
    L = forest.leaves()
    C = forest.n_classes_
    cls_index = {c: i for i, c in enumerate(forest.classes_.tolist())}
    P = _leaf_probs(L, np.arange(C), C)
    nL = len(L["node"])
    T = int(forest.n_estimators)
    starts = np.searchsorted(L["tree"], np.arange(T + 1))
    out = _Collector(forest.n_features_, C)
    changed = 0
    ids = forest.record_ids_
    for j, rid in enumerate(ids.tolist()):
        g = copy.deepcopy(forest)
        g.delete([rid])
        Lg = g.leaves()
        col = np.array([cls_index[c] for c in g.classes_.tolist()], dtype=np.int64)
        Pg = _leaf_probs(Lg, col, C)
        gstarts = np.searchsorted(Lg["tree"], np.arange(T + 1))
        if (
            len(Lg["node"]) == nL
            and np.array_equal(Lg["tree"], L["tree"])
            and np.array_equal(Lg["path"], L["path"])
        ):
            rowsame = (Lg["lo"] == L["lo"]).all(axis=1) & (Lg["hi"] == L["hi"]).all(axis=1)
            tsame = np.bincount(L["tree"][~rowsame], minlength=T) == 0
            rows = np.flatnonzero(tsame[L["tree"]])
            out.whole(rows, j, Pg[rows] - P[rows])
            todo = np.flatnonzero(~tsame)
        else:
            todo = np.arange(T)
        for t in todo.tolist():
            s, e = starts[t], starts[t + 1]
            gs, ge = gstarts[t], gstarts[t + 1]
            if (
                e - s == ge - gs
                and np.array_equal(L["path"][s:e], Lg["path"][gs:ge])
                and np.array_equal(L["lo"][s:e], Lg["lo"][gs:ge])
                and np.array_equal(L["hi"][s:e], Lg["hi"][gs:ge])
            ):
                out.whole(np.arange(s, e), j, Pg[gs:ge] - P[s:e])
                continue
            changed += 1
            llo, lhi = L["lo"][s:e], L["hi"][s:e]
            lo = np.maximum(llo[:, None, :], Lg["lo"][None, gs:ge, :])
            hi = np.minimum(lhi[:, None, :], Lg["hi"][None, gs:ge, :])
            meet = (lo < hi).all(axis=2)  # (l, l')
            # l inside l': the change is constant on l
            whole = meet & (lo == llo[:, None, :]).all(axis=2) & (hi == lhi[:, None, :]).all(axis=2)
            dl = Pg[None, gs:ge, :] - P[s:e, None, :]  # (l, l', C)
            wl, wg = np.nonzero(whole)
            out.whole(s + wl, j, dl[wl, wg])
            # l split by the new cells: one entry per piece, with the change on that piece
            pl, pg = np.nonzero(meet & ~whole)
            out.pieces(s + pl, j, dl[pl, pg], lo[pl, pg], hi[pl, pg], llo[pl], lhi[pl])
    if forest.content_hash() != h0:  # pragma: no cover - copies must not touch the forest
        raise RuntimeError("the forest changed while its guard was being computed")
    tab = out.table(nL)
    pieces = int((np.diff(tab.con) > 0).sum())
    rep = ForestFitReport(
        seconds=time.perf_counter() - t0, n_records=len(ids), n_trees=T, n_leaves=nL,
        changed_trees=changed, forest_hash=h0,
        detail={"entries": len(tab.row), "pieces": pieces},
    )  # fmt: skip
    return tab, rep


# --------------------------------------------------------------------------- routing


@dataclass
class _Routing:
    """Every tree's splits, rebuilt from the leaf cells: node k sends q to ``left[k]`` iff
    ``q[attr[k]] <= thr[k]``; a child (or a root) ``< 0`` is leaf row ``-child - 1``."""

    root: np.ndarray
    attr: np.ndarray
    thr: np.ndarray
    left: np.ndarray
    right: np.ndarray


def _routing(L: dict[str, np.ndarray], T: int) -> _Routing:
    """Rebuild the splits bottom-up from the leaf cells and check them exactly.

    Two sibling cells must equal their parent's cell cut at one threshold of one coordinate
    (left ``hi = thr``, right ``lo = thr``) and every root cell must be all of R^d; then, by
    induction, routing q by these splits reaches the leaf whose cell contains q, which is
    the leaf the forest routes q to (:meth:`DaREForest.leaves`). The guard routes queries
    itself, once, instead of asking the forest for node ids.
    """
    tree, path, lo, hi = L["tree"], L["path"], L["lo"], L["hi"]
    depth = np.zeros(len(path), dtype=np.int64)
    while True:  # depth from the heap path (root 1)
        deeper = (path >> (depth + 1)) > 0
        if not deeper.any():
            break
        depth += deeper
    cur_t = np.zeros(0, np.int64)
    cur_p = np.zeros(0, np.int64)
    cur_id = np.zeros(0, np.int64)
    cur_lo = np.zeros((0, lo.shape[1]))
    cur_hi = np.zeros((0, lo.shape[1]))
    attr: list[np.ndarray] = []
    thr: list[np.ndarray] = []
    left: list[np.ndarray] = []
    right: list[np.ndarray] = []
    n_int = 0
    for dep in range(int(depth.max(initial=0)), -1, -1):
        at = depth == dep
        cur_t = np.concatenate([cur_t, tree[at]])
        cur_p = np.concatenate([cur_p, path[at]])
        cur_id = np.concatenate([cur_id, -np.flatnonzero(at) - 1])
        cur_lo = np.concatenate([cur_lo, lo[at]])
        cur_hi = np.concatenate([cur_hi, hi[at]])
        order = np.lexsort((cur_p, cur_t))
        cur_t, cur_p, cur_id = cur_t[order], cur_p[order], cur_id[order]
        cur_lo, cur_hi = cur_lo[order], cur_hi[order]
        if dep == 0:
            break
        a, b = slice(0, None, 2), slice(1, None, 2)
        if len(cur_p) % 2 or not (
            np.array_equal(cur_t[a], cur_t[b])
            and (cur_p[a] % 2 == 0).all()
            and np.array_equal(cur_p[b], cur_p[a] + 1)
        ):
            raise RuntimeError("leaf paths do not form binary trees")  # pragma: no cover
        llo, lhi, rlo, rhi = cur_lo[a], cur_hi[a], cur_lo[b], cur_hi[b]
        cut = lhi != rhi
        k = np.argmax(cut, axis=1)
        i = np.arange(len(k))
        t_ = lhi[i, k]
        if not (
            (cut.sum(axis=1) == 1).all()
            and np.array_equal(llo != rlo, cut)
            and (rlo[i, k] == t_).all()
            and (llo[i, k] < t_).all()
            and (t_ < rhi[i, k]).all()
        ):
            raise RuntimeError("leaf cells are not cut by one threshold")  # pragma: no cover
        m = len(k)
        attr.append(k)
        thr.append(t_)
        left.append(cur_id[a])
        right.append(cur_id[b])
        cur_t, cur_p = cur_t[a], cur_p[a] >> 1
        cur_id = np.arange(n_int, n_int + m, dtype=np.int64)
        cur_lo, cur_hi = llo, rhi
        n_int += m
    if not (
        np.array_equal(cur_t, np.arange(T))
        and (cur_p == 1).all()
        and np.isneginf(cur_lo).all()
        and np.isposinf(cur_hi).all()
    ):
        raise RuntimeError("leaf cells do not cover R^d once per tree")  # pragma: no cover

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    return _Routing(
        root=cur_id.astype(np.int64), attr=cat(attr, np.int64), thr=cat(thr, np.float64),
        left=cat(left, np.int64), right=cat(right, np.int64),
    )  # fmt: skip


# --------------------------------------------------------------------------- kernels


@njit(cache=True)
def _route(Q, root, attr, thr, left, right):  # pragma: no cover - compiled
    """Leaf row of every (tree, query), shape (T, n)."""
    n = Q.shape[0]
    T = root.shape[0]
    rows = np.empty((T, n), dtype=np.int64)
    for i in range(n):
        for t in range(T):
            k = root[t]
            while k >= 0:
                k = left[k] if Q[i, attr[k]] <= thr[k] else right[k]
            rows[t, i] = -k - 1
    return rows


@njit(cache=True)
def _accumulate(Q, i, rows, start, rec, d, con, cdim, clo, chi, acc, seen, touched
                ):  # pragma: no cover - compiled
    """Add up, per record x, the changes of tree t's class probabilities at query i over all
    trees: acc[x] = sum_t Delta_{t,x}(q_i). Returns how many records got an entry; their
    indices are touched[:nt] (the caller resets acc and seen). Entries are sorted by (leaf
    row, record), and at most one entry of a (leaf, record) holds at q."""
    T = rows.shape[0]
    C = d.shape[1]
    nt = 0
    for t in range(T):
        r = rows[t, i]
        e, end = start[r], start[r + 1]
        while e < end:
            ok = True
            for m in range(con[e], con[e + 1]):
                v = Q[i, cdim[m]]
                if not (clo[m] < v and v <= chi[m]):
                    ok = False
                    break
            if not ok:
                e += 1
                continue
            x = rec[e]
            if not seen[x]:
                seen[x] = True
                touched[nt] = x
                nt += 1
            for c in range(C):
                acc[x, c] += d[e, c]
            # the other entries of (leaf, x) are pieces disjoint from this one
            e += 1
            while e < end and rec[e] == x:
                e += 1
    return nt


@njit(cache=True)
def _certify(Q, rows, scores, tol, n_records, start, rec, d, con, cdim, clo, chi
             ):  # pragma: no cover - compiled
    """Per query: w = argmax of scores (lowest index on ties) and whether, for every c != w,
    scores[w] - scores[c] > max_x mean_t (Delta_{t,x,c} - Delta_{t,x,w}) + tol (records
    without an entry at q contribute 0)."""
    T, n = rows.shape
    C = d.shape[1]
    acc = np.zeros((n_records, C))
    seen = np.zeros(n_records, dtype=np.bool_)
    touched = np.empty(n_records, dtype=np.int64)
    gain = np.empty(C)
    labels = np.empty(n, dtype=np.int64)
    certain = np.empty(n, dtype=np.bool_)
    for i in range(n):
        w = 0
        for c in range(1, C):
            if scores[i, c] > scores[i, w]:
                w = c
        nt = _accumulate(Q, i, rows, start, rec, d, con, cdim, clo, chi, acc, seen, touched)
        base = 0.0 if nt < n_records else -np.inf
        for c in range(C):
            gain[c] = base
        for k in range(nt):
            x = touched[k]
            for c in range(C):
                g = (acc[x, c] - acc[x, w]) / T
                if g > gain[c]:
                    gain[c] = g
            for c in range(C):
                acc[x, c] = 0.0
            seen[x] = False
        ok = True
        for c in range(C):
            if c != w and not (scores[i, w] - scores[i, c] > gain[c] + tol):
                ok = False
        labels[i] = w
        certain[i] = ok
    return labels, certain


@njit(cache=True)
def _bounds(Q, rows, n_records, start, rec, d, con, cdim, clo, chi):  # pragma: no cover
    """Per query: H[i, a, b] = max_x mean_t (Delta_{t,x,b} - Delta_{t,x,a}) and
    delta[i] = max_x max_c |mean_t Delta_{t,x,c}| (records without an entry give 0)."""
    T, n = rows.shape
    C = d.shape[1]
    acc = np.zeros((n_records, C))
    seen = np.zeros(n_records, dtype=np.bool_)
    touched = np.empty(n_records, dtype=np.int64)
    H = np.zeros((n, C, C))
    delta = np.zeros(n)
    for i in range(n):
        nt = _accumulate(Q, i, rows, start, rec, d, con, cdim, clo, chi, acc, seen, touched)
        if nt == n_records:
            for a in range(C):
                for b in range(C):
                    if a != b:
                        H[i, a, b] = -np.inf
        for k in range(nt):
            x = touched[k]
            for a in range(C):
                delta[i] = max(delta[i], abs(acc[x, a]) / T)
                for b in range(C):
                    if a != b:
                        H[i, a, b] = max(H[i, a, b], (acc[x, b] - acc[x, a]) / T)
            for c in range(C):
                acc[x, c] = 0.0
            seen[x] = False
    return H, delta


# --------------------------------------------------------------------------- the guard


class ForestGuard:
    """Label-only, eps-iDP answers from a DaRE forest (see the module docstring).

    Build with :meth:`fit` (or :meth:`load` a saved one); :meth:`certain` gives (class
    indices, certainty mask), :meth:`answer` publishes labels through :class:`LabelGuard`.
    """

    def __init__(self, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
                 random_state: int | None = None) -> None:
        self.forest = forest
        self.guard = LabelGuard(max(2, forest.n_classes_), epsilon=epsilon,
                                memo_size=memo_size, random_state=random_state)
        self.forest_hash: str | None = None
        self.fit_report: ForestFitReport | None = None
        self._table: _Table | None = None
        self._routing: _Routing | None = None
        self._P: np.ndarray | None = None  # leaf row -> class probabilities
        self._tree = self._path = None  # leaf row -> tree, heap path
        self._summary: dict[str, Any] = {}
        self._checked: tuple[int, str, bool] | None = None  # (generation, hash, matches)

    @classmethod
    def fit(cls, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
            random_state: int | None = None) -> ForestGuard:
        """Precompute the tables for `forest` (one exact deletion per record)."""
        self = cls(forest, epsilon=epsilon, memo_size=memo_size, random_state=random_state)
        self.refit()
        return self

    def refit(self) -> ForestFitReport:
        """(Re)compute the tables for the forest as it is now; sound mode afterwards."""
        table, rep = _fit_tables(self.forest)
        self._install(table, rep, self.forest.leaves())
        return rep

    def _install(self, table: _Table, rep: ForestFitReport, L: dict[str, np.ndarray]) -> None:
        """Tables + the routing and leaf probabilities of the forest they were fitted to."""
        self._table = table
        self._routing = _routing(L, int(self.forest.n_estimators))
        self._P = _leaf_probs(L, np.arange(self.forest.n_classes_), self.forest.n_classes_)
        self._tree, self._path = L["tree"], L["path"]
        self.forest_hash = rep.forest_hash
        self.fit_report = rep
        self._summary = self._summarise()
        self._checked = (self.forest.generation_, rep.forest_hash, True)

    @property
    def tol(self) -> float:
        return 1e-9 + 8.0 * float(self.forest.n_estimators) * 2.0**-53

    # ---------------------------------------------------------------- persistence

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (forest hash, fit report, summary) and
        ``path/tables.npz`` (no pickle), so that a serving process loads instead of refits."""
        if self._table is None or self.fit_report is None:
            raise RuntimeError("nothing to save: the guard has not been fitted")
        arrays = {**self._table.arrays(), "leaf_tree": self._tree, "leaf_path": self._path}
        rep = self.fit_report
        meta = {
            "format": FORMAT,
            "forest_hash": self.forest_hash,
            "n_classes": int(self.forest.n_classes_),
            "tables_hash": hash_arrays(*(arrays[k] for k in sorted(arrays))),
            "fit_report": asdict(rep),
            "summary": self._summary,
        }
        write_bundle(Path(path), meta, _TABLES, lambda fh: np.savez(fh, **arrays))

    @classmethod
    def load(cls, path: str | Path, forest: DaREForest, epsilon: float = 1.0,
             memo_size: int = 100_000, random_state: int | None = None) -> ForestGuard:
        """Read tables written by :meth:`save` for `forest`.

        Raises ValueError when `forest` is not the forest they were fitted to (content hash)
        or the tables do not match their recorded hash: tables of another forest would
        certify answers that a LOO forest of this one may give differently.
        """
        p = Path(path)
        meta = read_bundle_meta(p, FORMAT, "forest guard")
        h = forest.content_hash()
        if h != meta["forest_hash"]:
            raise ValueError(f"{p}: the guard was fitted to forest {meta['forest_hash'][:16]}..., "
                             f"not to the given forest {h[:16]}...; refit it")
        with np.load(read_bundle_payload(p, _TABLES), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        if sorted(arrays) != sorted((*_Table.ARRAYS, "leaf_tree", "leaf_path")) or hash_arrays(
            *(arrays[k] for k in sorted(arrays))
        ) != meta["tables_hash"]:
            raise ValueError(f"{p}: the guard's tables do not match their recorded hash")
        table = _Table(**{k: arrays[k] for k in _Table.ARRAYS})
        L = forest.leaves()
        # equal hashes imply equal leaf lists; checked because the tables index them, and the
        # compiled kernels do not check bounds
        if not (np.array_equal(L["tree"], arrays["leaf_tree"])
                and np.array_equal(L["path"], arrays["leaf_path"])
                and table.fits(len(L["node"]), forest.n_records_, forest.n_features_,
                               forest.n_classes_)):  # fmt: skip
            raise ValueError(f"{p}: the guard's tables do not fit the forest's leaves")
        self = cls(forest, epsilon=epsilon, memo_size=memo_size, random_state=random_state)
        self._install(table, ForestFitReport(**meta["fit_report"]), L)
        return self

    def _summarise(self) -> dict[str, Any]:
        tab, rep = self._table, self.fit_report
        nL = len(self._tree)
        leaf = np.zeros(nL)
        if len(tab.row):
            np.maximum.at(leaf, tab.row, np.abs(tab.d).max(axis=1))
        # one record's largest change anywhere: at most the sum over trees of its largest
        # entry in each tree, over T
        T = rep.n_trees
        per = np.zeros((max(rep.n_records, 1), T))
        if len(tab.row):
            np.maximum.at(per, (tab.rec, self._tree[tab.row]), np.abs(tab.d).max(axis=1))
        return {
            "rule": "forest-loo-per-record",
            "forest_hash": rep.forest_hash,
            "n_records": rep.n_records,
            "n_trees": T,
            "n_leaves": rep.n_leaves,
            "entries": len(tab.row),
            "fit_seconds": round(float(rep.seconds), 3),
            "tree_delta_median": float(np.median(leaf)) if nL else 0.0,
            "tree_delta_max": float(leaf.max(initial=0.0)),
            "delta_max_bound": float(per.sum(axis=1).max() / T),
        }

    @property
    def bound_summary(self) -> dict[str, Any]:
        """Small JSON-able record of what the guard rests on, for a model manifest.

        ``tree_delta_*``: over leaves, the largest change of one tree's class probability
        there under one deletion; ``delta_max_bound``: an upper bound on how far one
        deletion moves any class probability of the forest, anywhere.
        """
        return dict(self._summary)

    # ---------------------------------------------------------------- binding

    def _sound(self) -> bool:
        """Whether the tables are the forest's; re-hashes only when `generation_` moved."""
        gen = self.forest.generation_
        if self._checked is None or self._checked[0] != gen:
            h = self.forest.content_hash()
            self._checked = (gen, h, self.forest_hash is not None and h == self.forest_hash)
        _, h, ok = self._checked
        self.guard.bind(h, ok)  # cheap; also binds a replaced LabelGuard
        return ok

    @property
    def mode(self) -> str:
        return SOUND if self._sound() else NOISE_ALL

    # ---------------------------------------------------------------- queries

    def _rows(self, Q: np.ndarray) -> np.ndarray:
        r = self._routing
        return _route(Q, r.root, r.attr, r.thr, r.left, r.right)

    def _scores(self, rows: np.ndarray) -> np.ndarray:
        """Forest scores from the leaf rows, with DaREForest.scores' own numpy arithmetic
        (same chunks of trees, same reductions), so the labels are bit for bit its argmax."""
        T, n = rows.shape
        out = np.zeros((n, self._P.shape[1]))
        step = max(1, 100_000 // max(1, n))
        for t0 in range(0, T, step):
            out += self._P[rows[t0:t0 + step]].sum(axis=0)
        return out / T

    def _tables(self) -> tuple:
        tb = self._table
        return (self.fit_report.n_records, tb.start, tb.rec, tb.d, tb.con, tb.cdim, tb.clo,
                tb.chi)

    def bounds(self, X: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores (n, C), delta (n,), H (n, C, C)) with delta(q) = max_x,c |p_{-x,c} - p_c|
        and H[q, a, b] = max_x of how far class b gains on class a at q. Raises when the
        forest no longer matches the tables."""
        if not self._sound():
            raise RuntimeError("the forest changed since the guard was fitted; call refit()")
        Q = check_features(X, None, self.forest.n_features_)
        rows = self._rows(Q)
        H, delta = _bounds(Q, rows, *self._tables())
        return self._scores(rows), delta, H

    def certain(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Predicted class index (lowest on ties) and whether every LOO forest agrees."""
        Q = check_features(X, None, self.forest.n_features_)
        if not self._sound():
            return np.argmax(self.forest.scores(Q), axis=1), np.zeros(len(Q), dtype=bool)
        rows = self._rows(Q)
        return _certify(Q, rows, self._scores(rows), self.tol, *self._tables())

    def answer(self, X: Any) -> np.ndarray:
        """Published labels (values of forest.classes_): certain ones as is, the rest through
        the memoised exponential mechanism (everything noised when the hash does not match)."""
        Xq = np.asarray(X, dtype=np.float64) + 0.0
        labels, certain = self.certain(Xq)
        idx = self.guard.answer(Xq, labels, certain,
                                lambda C: np.argmax(self.forest.scores(C), axis=1))
        return self.forest.classes_[idx]
