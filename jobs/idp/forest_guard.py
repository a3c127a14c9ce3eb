"""A sound iDP label guard for DaRE forests (DESIGN.md, "Beyond LUCID, for DaRE forests").

A :class:`~jobs.learners.dare.DaREForest` answers ``argmax_c p_c(q)`` (lowest class index
on ties) with ``p(q) = mean_t p_t(q)`` and ``p_t(q) = counts / max(n, 1)`` of the leaf of
tree t that q reaches. Its deletions are exact, so every leave-one-out (LOO) forest
``F_{-x}`` is obtained exactly from a copy of the forest and one ``delete([x])``.

The certificate
---------------
Write ``Delta_{t,x}(q) = p_{t,-x}(q) - p_t(q)`` (a vector over the classes of the served
forest; a class that vanishes from ``F_{-x}`` has probability 0 there). For an ordered pair
of classes (a, b) let, per tree t and leaf l of t,

    H_t(l)[a, b] = max over records x, sup over points q in l of
                   Delta_{t,x,b}(q) - Delta_{t,x,a}(q)          (how far b can gain on a)

    D_t(l)       = max over x, sup over q in l, max over c of |Delta_{t,x,c}(q)|.

Then for every record x and every query q reaching leaves l_t(q):

    p_{-x,w}(q) - p_{-x,c}(q) = (p_w(q) - p_c(q)) - mean_t (Delta_{t,x,c} - Delta_{t,x,w})(q)
                             >= (p_w(q) - p_c(q)) - mean_t H_t(l_t(q))[w, c]

(the max over x is taken per tree, which can only make the bound larger), and
``|p_{-x,c}(q) - p_c(q)| <= delta(q) := mean_t D_t(l_t(q))``. The query is **certain**
when, for its predicted class w and every c != w,

    p_w(q) - p_c(q)  >  mean_t H_t(l_t(q))[w, c] + tol          (STRICT)

Then every LOO forest ranks w strictly above every other class, so it predicts w whatever
its tie-break. With ``>=`` instead the LOO forest could tie w with a class c < w and answer
c (argmax takes the lowest index), which is why equality is not certain. ``tol`` (1e-9 plus
8 T 2^-53) covers floating-point rounding in the means computed by the served and the
LOO forests (a mean of T numbers in [0, 1] is off by at most about T 2^-53). Since
``H_t[w, c] <= 2 D_t``, this is at least as tight as "margin > 2 delta(q)".

How H_t and D_t are computed (exactly, no relaxation)
-----------------------------------------------------
Each tree is a partition of R^d into leaf cells ``lo < q <= hi`` (axis-aligned boxes,
:meth:`DaREForest.leaves`), and p_t is constant on each cell. For each record x the LOO
forest is built exactly (deep copy + delete). Per tree:

* the LOO tree has the same cells (same paths and boxes): deleting x changed no split, and
  only counts changed (in practice x's leaf: (n_c - [c = y]) / (n - 1) vs n_c / n, read off
  the LOO forest's own counts). Leaf l gets ``Delta = p'_l - p_l``.
* otherwise (a subtree was retrained or a threshold moved): every old cell l is intersected
  with every new cell l' (open-closed boxes, so the intersection is nonempty iff
  ``max(lo, lo') < min(hi, hi')`` in every coordinate; a nonempty (a, b] contains the float
  b). On each intersection both p_t and p_{t,-x} are constant, equal to p_l and p'_{l'}.
  If l lies inside one l' the change ``p'_{l'} - p_l`` is folded into l's table; if the new
  cells split l, each piece is stored as a box with its own change, so the bound is
  POINTWISE: a threshold that moved by a sliver only loosens the bound inside the sliver.

Serving: for each tree, H_t(q) is the max of its leaf's table and of the stored boxes of
that leaf that contain q (a max over x, exact per tree and point); the bound is the mean over
trees. This is the same supremum as above, evaluated at q instead of over the whole leaf.

Precomputation costs one deletion per record
(:attr:`ForestGuard.fit_report`); serving costs one extra table lookup per tree.

Binding
-------
The tables are tied to ``forest.content_hash()`` at fit time. Every :meth:`certain` /
:meth:`answer` re-hashes the forest: on a mismatch (the forest was updated since) nothing
is certain and :class:`~jobs.idp.guard.LabelGuard` is bound in noise-all mode, until
:meth:`ForestGuard.refit` recomputes the tables for the new forest. Queries are not
clipped: the tables hold on all of R^d.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobs.idp.guard import LabelGuard
from jobs.learners.base import check_features
from jobs.learners.dare import DaREForest

SOUND = "sound"
NOISE_ALL = "noise-all"


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


def _pair_change(delta: np.ndarray) -> np.ndarray:
    """(..., C) changes -> (..., C, C) with [a, b] = delta_b - delta_a."""
    return delta[..., None, :] - delta[..., :, None]


def _tree_bounds(forest: DaREForest):
    """Per leaf (rows of forest.leaves()): D (L,) and H (L, C, C); see the module docstring."""
    t0 = time.perf_counter()
    h0 = forest.content_hash()
    L = forest.leaves()
    C = forest.n_classes_
    cls_index = {c: i for i, c in enumerate(forest.classes_.tolist())}
    P = _leaf_probs(L, np.arange(C), C)
    nL = len(L["node"])
    T = int(forest.n_estimators)
    starts = np.searchsorted(L["tree"], np.arange(T + 1))
    D = np.zeros(nL)
    H = np.zeros((nL, C, C))
    changed = 0
    box_row, box_lo, box_hi, box_D, box_H = [], [], [], [], []
    ids = forest.record_ids_
    for rid in ids.tolist():
        g = copy.deepcopy(forest)
        g.delete([rid])
        Lg = g.leaves()
        col = np.array([cls_index[c] for c in g.classes_.tolist()], dtype=np.int64)
        Pg = _leaf_probs(Lg, col, C)
        gstarts = np.searchsorted(Lg["tree"], np.arange(T + 1))
        same_all = (
            len(Lg["node"]) == nL
            and np.array_equal(Lg["tree"], L["tree"])
            and np.array_equal(Lg["path"], L["path"])
        )
        if same_all:
            rowsame = (Lg["lo"] == L["lo"]).all(axis=1) & (Lg["hi"] == L["hi"]).all(axis=1)
            tsame = np.bincount(L["tree"][~rowsame], minlength=T) == 0
            rows = tsame[L["tree"]]
            dl = Pg[rows] - P[rows]
            D[rows] = np.maximum(D[rows], np.abs(dl).max(axis=1))
            H[rows] = np.maximum(H[rows], _pair_change(dl))
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
                dl = Pg[gs:ge] - P[s:e]
                D[s:e] = np.maximum(D[s:e], np.abs(dl).max(axis=1))
                H[s:e] = np.maximum(H[s:e], _pair_change(dl))
                continue
            changed += 1
            lo = np.maximum(L["lo"][s:e, None, :], Lg["lo"][None, gs:ge, :])
            hi = np.minimum(L["hi"][s:e, None, :], Lg["hi"][None, gs:ge, :])
            meet = (lo < hi).all(axis=2)  # (l, l')
            # l inside l': the change is constant on l (folded into the leaf's table)
            whole = meet & (lo == L["lo"][s:e, None, :]).all(axis=2) & (
                hi == L["hi"][s:e, None, :]
            ).all(axis=2)
            dl = Pg[None, gs:ge, :] - P[s:e, None, :]  # (l, l', C)
            dabs = np.where(whole, np.abs(dl).max(axis=2), 0.0)
            D[s:e] = np.maximum(D[s:e], dabs.max(axis=1))
            pair = np.where(whole[..., None, None], _pair_change(dl), -np.inf)
            H[s:e] = np.maximum(H[s:e], pair.max(axis=1))
            # l split by the new cells: one box per piece, with the change on that piece
            pl, pg = np.nonzero(meet & ~whole)
            if pl.size:
                box_row.append(s + pl)
                box_lo.append(lo[pl, pg])
                box_hi.append(hi[pl, pg])
                box_D.append(np.abs(dl[pl, pg]).max(axis=1))
                box_H.append(_pair_change(dl[pl, pg]))
    if forest.content_hash() != h0:  # pragma: no cover - copies must not touch the forest
        raise RuntimeError("the forest changed while its guard was being computed")
    p = forest.n_features_
    boxes = _Boxes(
        row=np.concatenate(box_row) if box_row else np.zeros(0, np.int64),
        lo=np.concatenate(box_lo) if box_lo else np.zeros((0, p)),
        hi=np.concatenate(box_hi) if box_hi else np.zeros((0, p)),
        D=np.concatenate(box_D) if box_D else np.zeros(0),
        H=np.concatenate(box_H) if box_H else np.zeros((0, C, C)),
    )
    rep = ForestFitReport(
        seconds=time.perf_counter() - t0, n_records=len(ids), n_trees=T, n_leaves=nL,
        changed_trees=changed, forest_hash=h0, detail={"boxes": len(boxes.row)},
    )  # fmt: skip
    return D, H, boxes, rep


@dataclass
class _Boxes:
    """Pieces of split leaves: leaf row, cell lo < q <= hi, and the change on the piece.

    Sorted by row; `rows`, `start`, `stop` index each row's run so that a query
    only looks at the pieces of the leaves it reaches.
    """

    row: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    D: np.ndarray
    H: np.ndarray

    def __post_init__(self) -> None:
        order = np.argsort(self.row, kind="stable")
        self.row, self.lo, self.hi = self.row[order], self.lo[order], self.hi[order]
        self.D, self.H = self.D[order], self.H[order]
        self.rows, self.start = np.unique(self.row, return_index=True)
        self.stop = np.append(self.start[1:], len(self.row))


class ForestGuard:
    """Label-only, eps-iDP answers from a DaRE forest (see the module docstring).

    Build with :meth:`fit`; :meth:`certain` gives (class indices, certainty mask),
    :meth:`answer` publishes labels through :class:`LabelGuard`.
    """

    def __init__(self, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
                 random_state: int | None = None) -> None:
        self.forest = forest
        self.guard = LabelGuard(max(2, forest.n_classes_), epsilon=epsilon,
                                memo_size=memo_size, random_state=random_state)
        self.forest_hash: str | None = None
        self.fit_report: ForestFitReport | None = None
        self._tree = self._path = None
        self._D = self._H = None
        self._boxes: _Boxes | None = None
        self._node_cache: tuple[int, np.ndarray] | None = None  # (generation, rows)

    @classmethod
    def fit(cls, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
            random_state: int | None = None) -> ForestGuard:
        """Precompute the per-leaf tables for `forest` (one exact deletion per record)."""
        self = cls(forest, epsilon=epsilon, memo_size=memo_size, random_state=random_state)
        self.refit()
        return self

    def refit(self) -> ForestFitReport:
        """(Re)compute the tables for the forest as it is now; sound mode afterwards."""
        D, H, boxes, rep = _tree_bounds(self.forest)
        L = self.forest.leaves()
        self._tree, self._path, self._D, self._H, self._boxes = (
            L["tree"], L["path"], D, H, boxes
        )
        self.forest_hash = rep.forest_hash
        self.fit_report = rep
        self._node_cache = None
        return rep

    @property
    def tol(self) -> float:
        return 1e-9 + 8.0 * float(self.forest.n_estimators) * 2.0**-53

    # ---------------------------------------------------------------- binding

    def _rows(self) -> np.ndarray | None:
        """Node id -> row of the tables for the served forest, or None on a hash mismatch.

        The forest is re-hashed only when its `generation_` moved since the last check.
        """
        if self._node_cache is not None and self._node_cache[0] == self.forest.generation_:
            self.guard.bind(self.forest_hash, True)  # cheap; also binds a replaced LabelGuard
            return self._node_cache[1]
        h = self.forest.content_hash()
        if self.forest_hash is None or h != self.forest_hash:
            self.guard.bind(h, False)
            return None
        self.guard.bind(h, True)
        L = self.forest.leaves()
        node = L["node"]
        # equal hashes imply equal (tree, path) leaf lists; pool ids may differ
        if not (np.array_equal(L["tree"], self._tree) and np.array_equal(L["path"], self._path)):
            self.guard.bind(h, False)  # pragma: no cover - defensive
            return None
        rows = np.full(int(node.max()) + 1, -1, dtype=np.int64)
        rows[node] = np.arange(len(node))
        self._node_cache = (self.forest.generation_, rows)
        return rows

    @property
    def mode(self) -> str:
        return SOUND if self._rows() is not None else NOISE_ALL

    # ---------------------------------------------------------------- queries

    def _per_tree(self, Q: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per tree and query: D_t(q) (T, n) and H_t(q) (T, n, C, C), pointwise."""
        r = rows[self.forest.leaf_nodes(Q)]  # (T, n) table rows
        Dq = self._D[r].copy()
        Hq = self._H[r].copy()
        b = self._boxes
        if len(b.row):
            T, n = r.shape
            flat = r.ravel()
            order = np.argsort(flat, kind="stable")
            fs = flat[order]
            reached = np.unique(fs)
            k = np.searchsorted(b.rows, reached)
            k = k[(k < len(b.rows)) & (b.rows[np.minimum(k, len(b.rows) - 1)] == reached)]
            for j in k.tolist():
                row, sel = b.rows[j], slice(b.start[j], b.stop[j])
                lo_i, hi_i = np.searchsorted(fs, [row, row + 1])
                cells = order[lo_i:hi_i]  # flat (t, q) positions in this leaf
                q = cells % n
                inside = ((b.lo[sel][None] < Q[q][:, None]) & (Q[q][:, None] <= b.hi[sel][None])
                          ).all(axis=2)  # (m, boxes)
                dv = np.where(inside, b.D[sel][None], 0.0).max(axis=1)
                hv = np.where(inside[..., None, None], b.H[sel][None], -np.inf).max(axis=1)
                t = cells // n
                Dq[t, q] = np.maximum(Dq[t, q], dv)
                Hq[t, q] = np.maximum(Hq[t, q], hv)
        return Dq, Hq

    def bounds(self, X: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores (n, C), delta (n,), H (n, C, C)) with delta(q) >= max_x,c |p_{-x,c} - p_c|
        and H[q, a, b] >= max_x of how far class b can gain on class a at q. Raises when the
        forest no longer matches the tables."""
        rows = self._rows()
        if rows is None:
            raise RuntimeError("the forest changed since the guard was fitted; call refit()")
        Q = check_features(X, None, self.forest.n_features_)
        Dq, Hq = self._per_tree(Q, rows)
        return self.forest.scores(Q), Dq.mean(axis=0), Hq.mean(axis=0)

    def certain(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Predicted class index (lowest on ties) and whether every LOO forest agrees."""
        rows = self._rows()
        Q = check_features(X, None, self.forest.n_features_)
        scores = self.forest.scores(Q)
        n, C = scores.shape
        labels = np.argmax(scores, axis=1)
        if rows is None:
            return labels, np.zeros(n, dtype=bool)
        _, Hq = self._per_tree(Q, rows)
        idx = np.arange(n)
        gain = Hq[:, idx, labels, :].mean(axis=0)  # (n, C): how far c can gain on w
        margin = scores[idx, labels][:, None] - scores
        ok = margin > gain + self.tol
        ok[idx, labels] = True
        return labels, ok.all(axis=1)

    def answer(self, X: Any) -> np.ndarray:
        """Published labels (values of forest.classes_): certain ones as is, the rest through
        the memoised exponential mechanism (everything noised when the hash does not match)."""
        Xq = np.asarray(X, dtype=np.float64) + 0.0
        labels, certain = self.certain(Xq)
        idx = self.guard.answer(Xq, labels, certain)
        return self.forest.classes_[idx]
