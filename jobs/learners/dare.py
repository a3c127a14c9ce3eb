"""DaRE random forests (Brophy & Lowd, ICML 2021) whose updates are checkably exact.

A DaRE forest caches, at every decision node, the counts it needs to re-score
its candidate splits, so deleting (or adding) a record touches the counts along
the record's path in every tree and retrains a subtree only where the best
split changes. The paper promises that an update has the same *distribution*
as a retrain. This implementation promises more: after any sequence of
:meth:`DaREForest.delete` / :meth:`DaREForest.add` calls the forest is
bit-identical to ``DaREForest(same params).fit(live ids, X, y)``, which
:meth:`DaREForest.verify` checks by retraining and comparing content hashes.

Keyed randomness (why update == retrain)
----------------------------------------
No random stream is shared between training and updates. Every random choice
is a pure function of ``random_state`` and a name for the choice, computed
with a keyed 64-bit mixer (splitmix64's finaliser, keyed per tree by
``keyed.prf_u64(random_state, "dare-tree", t)``). A node is named by its tree
and its heap path (root 1, children 2i and 2i+1). A node's state is therefore
a pure function of the records that reach it:

* leaf: depth == max_depth, fewer than 2 * min_samples_leaf records, one
  class, no non-constant attribute, or no candidate leaves min_samples_leaf
  records on both sides.
* random node (depth < d_rmax): the first attribute, in the node's keyed
  attribute order, that is not constant on the node; the threshold is the
  first draw of the keyed stream ``v_j = (2 u_j - 1) D`` (u_j keyed by node,
  attribute and j) that falls in ``[min, max)`` of the node's values. ``D`` is
  a canonical function of the live data, the smallest power of two above the
  attribute's largest absolute value, so it changes only when that crosses a
  power of two (then every random node on the attribute is re-derived).
  A deletion only shrinks ``[min, max)``: the current draw stays the first
  draw inside as long as both children are non-empty, else the node is
  re-derived. An addition widens the range: the node is re-derived.
* greedy node: the first ``floor(sqrt(p))`` non-constant attributes in the
  node's keyed order; per attribute, the candidate thresholds are the pairs of
  adjacent distinct values (v1, v2) that are *valid* (not both value groups
  pure with the same label); each pair has the 32-bit priority
  ``h(node, attribute, bits(v1))``; the k valid pairs of smallest
  (priority, v1) are scored (Gini: maximise sum L_c^2/n_l + sum R_c^2/n_r
  from exact integer sums; entropy: from a table of x*log(x)); ties go to the
  earlier attribute, then the smaller (priority, v1). The threshold is the
  midpoint of (v1, v2).

Updating a greedy node with cached counts. Greedy nodes with at least
``_CACHE_MIN`` records keep, per sampled attribute, the first k + ``_BUFFER``
valid pairs in priority order with their left class counts, and the key
(priority, v1) of the last one (the cut-off). A pair is named by its lower
value v1, so when a deletion removes value w from a node, the pair (prev, w)
becomes (prev, next) under the same priority and the pair (w, next) disappears;
no pair with a new priority ever appears. Hence the stored list stays exactly
"every valid pair with priority up to the cut-off", and its first k entries are
the pairs a retrain would select, as long as at least k remain (otherwise the
node's cache is recomputed from its records). A deletion decrements the left
counts of the cached pairs, repairs the (at most two) pairs that touch w, and,
when w's value disappears, checks whether the merged pair (prev, next) is a
newly valid pair under the cut-off (prev and next are found by walking the
attribute's global sorted order, or the node's own records, whichever is
shorter). It then re-scores the k selected pairs and retrains the subtree only
if the best pair changes; a pair that only moved its upper value moves the
threshold without retraining. Smaller greedy nodes keep no per-candidate
cache: when a record in them changes, their best split is recomputed from their
records. Additions re-derive every node on the new records' paths from its
records (exact, but slower than deletions).

Ties. Finding w's group, its neighbours and their class counts is where tied
data made deletions slow: on a feature with a handful of values most of a node
(or of the training set) shares w. A cached slot whose attribute has at most one
distinct value per ``_HIST_RATIO`` of the node's records therefore also keeps the
node's value group table (rank and class counts of every value the node holds,
in value order; a function of the node's records, rebuilt on load, not hashed):
w's group and its neighbours are a binary search away, and the table shrinks
with the node (a vanished value leaves it). Values that tie are also counted
into a dense table instead of being sorted when a node is (re)built.

Skipping the re-scoring. A greedy node keeps an upper bound on the scores of its
other scored candidates: the runner-up's score at its last full scoring, plus 1
per deletion since (a Gini score, sum L_c^2 / n_l + sum R_c^2 / n_r, grows by at
most (n_l - 2) / n_l < 1 when a record leaves its side; a margin covers
rounding). While the scored candidates are the same pairs (for a cached node: no
pair among the first k died and none was inserted there; for an uncached one:
the deleted record's value group neither vanished nor turned pure on any sampled
attribute) and the stored split, scored from its children's counts, still beats
the bound, the split stands without re-scoring. Entropy has no such cheap bound
and always re-scores. None of this changes a choice: it only avoids work whose
outcome is known.

Deletions run in one compiled kernel (:mod:`jobs.learners.dare_delete`) over all
trees, and a tree's walk ends at its first changed node: that node is retrained
from its live records (:func:`dare_kernels.build_subtrees`, depth first, the same
split search as training), so nothing below it needs updating. A batch applies
its records one after the other the same way, also ending a walk at a node an
earlier record of the batch changed (its counts still follow, for its parent's
checks), and retrains the outermost changed nodes once, at the end: a subtree
retrained from its records is the canonical one whatever happened below it, so
this is exact even for a node that flipped back. A batch refits from scratch
instead when that is estimated to cost less (:meth:`DaREForest._estimate`,
deterministic, in units of build work; the report's ``retrained`` says which
mode was taken and both estimates).

Exactness does not make flips cheap: when two candidates of a large node are
nearly tied, successive deletions can flip the argmax back and forth, and each
flip retrains the subtree, exactly as a retrain would choose; this, not the
count updates, dominates the deletion time of G-DaRE.

What the forest stores per record
---------------------------------
Each live record's id, features, label and its position in every tree's layout.
A deletion leaves the record's slot behind in memory (so a batch needs no
renumbering); :meth:`DaREForest.save` drops every such slot first
(:meth:`DaREForest._compact_store`): the value domains are re-derived from the
live records and a cache cut-off that still named a deleted value is lowered to a
live one, so a saved bundle holds nothing of a deleted record. Thresholds are
midpoints of two live values or keyed draws.

The content hash covers the structure, thresholds, counts, the selected
candidates of cached nodes with their counts, the keyed draw indices, each
leaf's records (by id) and the live training set; nothing in it depends on
the order of updates, memory layout or record slots.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError

from jobs.learners import dare_delete as _del
from jobs.learners import dare_kernels as _kern
from jobs.learners.base import (
    Learner,
    UpdateReport,
    VerifyReport,
    check_features,
    ids_to_add,
    ids_to_delete,
    read_bundle_meta,
    read_bundle_payload,
    unique_ids,
    write_bundle,
)
from jobs.learners.keyed import prf_u64

FORMAT = "obliviate.dare/1"
_ARRAYS = "arrays.npz"

# ----------------------------------------------------------------------------- keyed mixing

_U64 = np.uint64
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_GOLD = _U64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S32, _S11 = _U64(30), _U64(27), _U64(31), _U64(32), _U64(11)
_TAG_GATTR = _U64(0x243F6A8885A308D3)
_TAG_THR = _U64(0x13198A2E03707344)
_TAG_RATTR = _U64(0xA4093822299F31D0)
_TAG_DRAW = _U64(0x082EFA98EC4E6C89)
_INV53 = 2.0**-53

LEAF, RANDOM, GREEDY = 0, 1, 2
# why a node is a leaf (0: it is not)
_W_DEPTH, _W_SMALL, _W_PURE, _W_CONST, _W_MSL = 1, 2, 3, 4, 5


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64), elementwise on a uint64 array (array
    integer arithmetic wraps silently; only numpy scalars would warn, so x is made 1-D)."""
    x = np.atleast_1d(x)
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def _h2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Keyed hash of two uint64 arrays (broadcasting)."""
    return _mix(np.atleast_1d(a) ^ _mix(np.atleast_1d(b) + _GOLD))


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l), as int64."""
    lens = np.asarray(lens, dtype=np.int64)
    tot = int(lens.sum())
    if tot == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lens)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lens), lens) + np.arange(
        tot, dtype=np.int64
    )


def _midpoint(v1: np.ndarray, v2: np.ndarray) -> np.ndarray:
    """Threshold between adjacent values: the midpoint, or v1 where it rounds onto v2."""
    t = 0.5 * v1 + 0.5 * v2  # finite inputs: no overflow, no NaN
    bad = ~((t >= v1) & (t < v2))
    if bad.any():
        t = np.where(bad, v1, t)
    return t


# Process-wide: `generation_` names the forest's current state, so a guard can tell
# cheaply that the forest it certified has not changed since (no re-hashing per query).
_GENERATIONS = itertools.count(1)

_XLOGX: list[np.ndarray] = [np.zeros(1)]


def _xlogx(n: int) -> np.ndarray:
    """Table of x * log(x) for x = 0..n-1 (0 at 0), computed one value at a time with math.log
    so an entry never depends on the table's length or on SIMD code paths."""
    tab = _XLOGX[0]
    if len(tab) < n:
        m = max(n, 2 * len(tab), 1024)
        ext = np.fromiter(
            (x * math.log(x) for x in range(len(tab), m)), dtype=np.float64, count=m - len(tab)
        )
        tab = np.concatenate([tab, ext])
        _XLOGX[0] = tab
    return tab


class _Decisions:
    """Per-task outcome of :meth:`DaREForest._decide` (parallel arrays)."""

    __slots__ = (
        "kind", "why", "attr", "thr", "r1", "r2", "draw", "n", "cnt", "go_left",
        "cache_task", "cache_slots", "cache_all", "cache_cutp", "cache_cutv", "cache_off",
        "cache_len", "e_r1", "e_r2", "e_left", "cache_hoff", "cache_hlen", "h_r", "h_c",
    )  # fmt: skip


class DaREForest(Learner, BaseEstimator):
    """Data-removal-enabled random forest with keyed, checkably exact updates.

    Parameters
    ----------
    n_estimators : int
        Number of trees; every tree sees all records (no bootstrap).
    max_depth : int
        Maximum depth (the root has depth 0; at most 60).
    k : int
        Number of valid thresholds sampled per attribute at a greedy node.
    d_rmax : int
        Nodes at depth < d_rmax are random nodes (attribute and threshold drawn
        at random, independent of labels); 0 gives G-DaRE.
    criterion : {"gini", "entropy"}
        Split criterion of greedy nodes.
    min_samples_leaf : int
        A greedy split must leave at least this many records on each side.
    random_domain : float or None
        The range (-D, D) random nodes draw thresholds from. None: per attribute, the
        smallest power of two above the live records' largest |value| (it moves when the
        record holding it is deleted, and every random node on the attribute is then
        re-drawn). A power of two: fixed for every attribute, so no update moves it; for
        features scaled to a known box (the sidecar's [0, 1]: 2.0).
    random_state : int
        Key of every random choice (see the module docstring).
    """

    guarantee = "exact"

    #: greedy nodes with at least this many records keep per-candidate counts
    _CACHE_MIN = 128
    #: extra valid candidates a cached node keeps beyond its k selected ones
    _BUFFER = 8
    #: random-node threshold draws per vectorised round and the cap before a fallback
    _DRAW_CHUNK = 64
    _MAX_DRAWS = 1 << 16
    #: a cached slot keeps its node's value group table when the attribute has at most one
    #: distinct value per this many of the node's records (ties; see dare_delete)
    _HIST_RATIO = 4
    #: a batch deletion refits from scratch when that is estimated to be cheaper
    #: (:meth:`_estimate`); without the estimate (False), when it is larger than
    #: _REFIT_FRACTION of the live records
    _CHOOSE_BY_COST = True
    _REFIT_FRACTION = 0.25
    #: costs in units of build work (one record through one level of the builder): a node
    #: on a deletion's path costs 35-130 units (measured on tables of 120-16,000 records,
    #: 2-10 classes, 20-64 features; the kernel is bound by memory, the builder by the
    #: data), a deleted record about 1,000 more (the Python around it). The high end is
    #: taken, so that near the break-even point a batch refits
    _NODE_UNITS = 100.0
    _RECORD_UNITS = 1000.0
    #: share of the forest's build work one deletion retrains, until measured, and the
    #: weight of the newest measurement in its running average
    _PRIOR_RHO = 0.005
    _EMA = 0.2

    def __init__(
        self,
        n_estimators: int = 100,
        max_depth: int = 10,
        k: int = 25,
        d_rmax: int = 0,
        criterion: str = "gini",
        min_samples_leaf: int = 1,
        random_domain: float | None = None,
        random_state: int = 0,
    ) -> None:
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.k = k
        self.d_rmax = d_rmax
        self.criterion = criterion
        self.min_samples_leaf = min_samples_leaf
        self.random_domain = random_domain
        self.random_state = random_state

    # ================================================================== configuration / checks

    def _validate_params(self) -> None:
        def nonneg_int(name: str, v: Any, lo: int) -> int:
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
            return int(v)

        self._T = nonneg_int("n_estimators", self.n_estimators, 1)
        self._maxd = nonneg_int("max_depth", self.max_depth, 0)
        if self._maxd > 60:
            raise ValueError(f"max_depth must be <= 60, got {self.max_depth!r}")
        self._k = nonneg_int("k", self.k, 1)
        self._drmax = nonneg_int("d_rmax", self.d_rmax, 0)
        self._msl = nonneg_int("min_samples_leaf", self.min_samples_leaf, 1)
        D = self.random_domain
        if D is not None and not (isinstance(D, int | float | np.number) and not isinstance(D, bool)
                                  and math.isfinite(D) and D > 0
                                  and math.frexp(float(D))[0] == 0.5):
            raise ValueError(f"random_domain must be None or a positive power of two, got {D!r}")
        if self.criterion not in ("gini", "entropy"):
            raise ValueError(f"criterion must be 'gini' or 'entropy', got {self.criterion!r}")
        if isinstance(self.random_state, bool) or not isinstance(
            self.random_state, int | np.integer
        ):
            raise ValueError(f"random_state must be an integer, got {self.random_state!r}")

    def _check_fitted(self) -> None:
        if not hasattr(self, "classes_"):
            raise NotFittedError("this DaREForest is not fitted yet; call fit() first")


    @staticmethod
    def _check_y(y: Any, n: int) -> np.ndarray:
        arr = np.asarray(y)
        if arr.ndim != 1 or arr.shape[0] != n:
            raise ValueError(f"y must be 1-D with {n} labels, got shape {arr.shape}")
        if arr.dtype == object:
            raise ValueError("y must be a numeric or string array (not objects)")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError("y contains NaN or infinite labels")
        return arr

    @property
    def n_classes_(self) -> int:
        self._check_fitted()
        return len(self.classes_)

    @property
    def n_records_(self) -> int:
        """Number of live training records."""
        self._check_fitted()
        return int(self._nlive)

    @property
    def record_ids_(self) -> np.ndarray:
        """Live record ids, sorted."""
        self._check_fitted()
        return np.array(sorted(self._slot), dtype=object)

    # ================================================================== record store

    def _init_store(self, ids: np.ndarray, X: np.ndarray, yi: np.ndarray) -> None:
        n, p = X.shape
        self._cap = max(n, 1)
        self._nrec = n
        self._X = np.zeros((p, self._cap), dtype=np.float64)
        self._X[:, :n] = X.T
        self._y = np.zeros(self._cap, dtype=np.int32)
        self._y[:n] = yi
        self._alive = np.zeros(self._cap, dtype=bool)
        self._alive[:n] = True
        self._ids = np.empty(self._cap, dtype=object)
        self._ids[:n] = ids
        self._slot = {s: i for i, s in enumerate(ids.tolist())}
        self._nlive = n
        self._class_n = np.bincount(yi, minlength=len(self.classes_)).astype(np.int64)

    def _grow_store(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap)
        p = self._X.shape[0]
        X = np.zeros((p, cap), dtype=np.float64)
        X[:, : self._nrec] = self._X[:, : self._nrec]
        self._X = X
        for name, dt in (("_y", np.int32), ("_alive", bool)):
            a = np.zeros(cap, dtype=dt)
            a[: self._nrec] = getattr(self, name)[: self._nrec]
            setattr(self, name, a)
        ids = np.empty(cap, dtype=object)
        ids[: self._nrec] = self._ids[: self._nrec]
        self._ids = ids
        pos = np.zeros((self._T, cap), dtype=np.int32)
        pos[:, : self._nrec] = self._pos[:, : self._nrec]
        self._pos = pos
        rank = np.zeros((p, cap), dtype=np.int32)
        rank[:, : self._nrec] = self._rank[:, : self._nrec]
        self._rank = rank
        self._cap = cap

    def _compact_store(self) -> None:
        """Drop the slots of deleted records, so that their features, label and id leave
        the forest (and every bundle saved from it) instead of waiting in dead slots.

        Slots are renumbered everywhere they are referenced (layout, positions, ranks); the
        value domains are re-derived from the live records, so a deleted record's value
        leaves them too, and so does a cache cut-off that still names one (see
        :meth:`_forget_cutoffs`). Nothing the content hash covers changes."""
        n = self._nrec
        live = np.flatnonzero(self._alive[:n])
        if len(live) == n:
            return
        m = len(live)
        new = np.full(self._cap, -1, dtype=np.int32)
        new[live] = np.arange(m, dtype=np.int32)
        self._X = np.ascontiguousarray(self._X[:, live])
        self._y = self._y[live].copy()
        self._alive = np.ones(m, dtype=bool)
        self._ids = self._ids[live].copy()
        self._pos = np.ascontiguousarray(self._pos[:, live])
        self._rank = np.ascontiguousarray(self._rank[:, live])
        held = self._samp >= 0
        self._samp[held] = new[self._samp[held]]
        self._nrec = self._cap = m
        self._slot = {rid: k for k, rid in enumerate(self._ids.tolist())}
        self._remap_ranks(self._rerank())
        self._forget_cutoffs()
        # what freed nodes and cache slots last held is no longer anyone's state
        self._n_thr[~self._n_used] = 0.0
        unused = (self._c_attr < 0).all(axis=1)
        self._c_cutp[unused] = 0
        self._c_cutv[unused] = 0.0

    def _forget_cutoffs(self) -> None:
        """Lower every cache cut-off whose value no live record holds to its last live pair.

        A slot's list holds every valid pair whose key (priority, v1) is at most its
        cut-off, in key order. The cut-off key keeps the value of the pair that was last
        when the cache was built, which may be a deleted record's value. Every valid pair
        up to the last live entry is in the list (it is below the old cut-off), so lowering
        the cut-off to that entry's key keeps the invariant, and with it exactness; a slot
        with no live entry gets a cut-off below every key (it is recomputed when next
        touched, as it has fewer than k pairs). A slot that holds every valid pair has no
        use for a cut-off: its own is cleared."""
        every = (self._c_attr >= 0) & self._c_all
        self._c_cutp[every] = 0
        self._c_cutv[every] = 0.0
        cids, ss = np.nonzero((self._c_attr >= 0) & ~self._c_all)
        if cids.size == 0:
            return
        a = self._c_attr[cids, ss].astype(np.int64)
        va = self._voff[a]
        nv = self._voff[a + 1] - va
        cutv = self._c_cutv[cids, ss]
        at = np.zeros(len(a), dtype=np.int64)
        for k in range(len(a)):
            at[k] = np.searchsorted(self._vals[va[k] : va[k] + nv[k]], cutv[k])
        held = (at < nv) & (self._vals[va + np.minimum(at, nv - 1)] == cutv)
        stale = np.flatnonzero(~held)
        if stale.size == 0:
            return
        cids, ss, a, va = cids[stale], ss[stale], a[stale], va[stale]
        last = np.full(len(stale), -1, dtype=np.int64)
        for k in range(len(stale)):
            off = int(self._c_off[cids[k], ss[k]])
            seg = self._er1[off : off + int(self._c_len[cids[k], ss[k]])]
            alive = np.flatnonzero(seg >= 0)
            if alive.size:
                last[k] = seg[alive[-1]]
        node = np.zeros(self._ccap, dtype=np.int64)
        owners = np.flatnonzero(self._n_used & (self._n_cid >= 0))
        node[self._n_cid[owners]] = owners
        nd = node[cids]
        nk = self._nodekey(self._n_tree[nd], self._n_path[nd])
        sk = _h2(nk ^ _TAG_THR, a.astype(_U64))
        has = last >= 0
        r = np.where(has, last, 0)
        prio = (_mix(sk ^ self._vmix[va + r]) >> _S32).astype(np.int64)
        self._c_cutp[cids, ss] = np.where(has, prio, -1)
        self._c_cutv[cids, ss] = np.where(has, self._vals[va + r], 0.0)

    def _rerank(self) -> list[np.ndarray] | None:
        """Dense ranks of every slot's values per attribute, the global sorted order and the
        start of each value's run in it. Returns, per attribute, the map old rank -> new rank
        (None on the first call)."""
        p = self.n_features_
        n = self._nrec
        old_vals = None
        if hasattr(self, "_vals"):
            old_vals = [self._vals[self._voff[a] : self._voff[a + 1]] for a in range(p)]
        if not hasattr(self, "_rank") or self._rank.shape[1] < self._cap:
            self._rank = np.zeros((p, self._cap), dtype=np.int32)
        vals, voff = [], [0]
        gorder = np.empty((p, n), dtype=np.int32)
        rstart, roff = [], [0]
        for a in range(p):
            u, inv = np.unique(self._X[a, :n], return_inverse=True)
            self._rank[a, :n] = inv
            vals.append(u)
            voff.append(voff[-1] + len(u))
            gorder[a] = np.argsort(inv, kind="stable")
            rs = np.zeros(len(u) + 1, dtype=np.int32)
            np.cumsum(np.bincount(inv, minlength=len(u)), out=rs[1:])
            rstart.append(rs)
            roff.append(roff[-1] + len(u) + 1)
        self._vals = np.concatenate(vals) if vals else np.zeros(0)
        self._vmix = _mix(self._vals.view(_U64) + _GOLD)  # value half of the pair priority
        self._voff = np.array(voff, dtype=np.int64)
        self._gorder = gorder
        self._rstart = np.concatenate(rstart)
        self._roff = np.array(roff, dtype=np.int64)
        self._nvals_max = max((len(v) for v in vals), default=1)
        # the compiled kernels read a record's ranks together: record-major, 16 bits where
        # they fit (one cache line per record on tables of up to 32 features)
        dt = np.uint16 if self._nvals_max <= 65_535 else np.int32
        self._rank_rm = np.ascontiguousarray(self._rank.T, dtype=dt)
        if old_vals is None:
            return None
        return [np.searchsorted(vals[a], old_vals[a]).astype(np.int32) for a in range(p)]

    def _update_domain(self, attrs: np.ndarray | None = None) -> np.ndarray:
        """Random-node stream domains D_a = 2**e with 2**(e-1) <= max|x_a| < 2**e over the live
        data (e <= 1023). Returns the attributes whose D changed."""
        p = self.n_features_
        attrs = np.arange(p) if attrs is None else np.asarray(attrs, dtype=np.int64)
        if not hasattr(self, "_dom"):
            self._dom = np.ones(p, dtype=np.float64)
            self._absmax = np.zeros(p, dtype=np.float64)
        if not hasattr(self, "_absmax_n"):  # live records holding the largest |x_a|
            self._absmax_n = np.zeros(p, dtype=np.int64)
        if len(attrs) == 0:
            return attrs
        live = np.flatnonzero(self._alive[: self._nrec])
        ax = np.abs(self._X[np.ix_(attrs, live)])
        m = ax.max(axis=1) if live.size else np.zeros(len(attrs))
        self._absmax[attrs] = m
        self._absmax_n[attrs] = (ax == m[:, None]).sum(axis=1) if live.size else 0
        if self.random_domain is not None:
            dom = np.full(len(attrs), float(self.random_domain))
        else:
            dom = np.array([1.0 if v == 0 else math.ldexp(1.0, min(math.frexp(v)[1], 1023))
                            for v in m.tolist()])
        changed = attrs[dom != self._dom[attrs]]
        self._dom[attrs] = dom
        return changed

    # ================================================================== node & entry pools

    def _init_pools(self, ncap: int, ccap: int, ecap: int, scap: int) -> None:
        C, P = len(self.classes_), self._P
        self._ncap = ncap
        self._n_tree = np.zeros(ncap, dtype=np.int32)
        self._n_depth = np.zeros(ncap, dtype=np.int32)
        self._n_path = np.zeros(ncap, dtype=np.int64)
        self._n_kind = np.zeros(ncap, dtype=np.int8)
        self._n_why = np.zeros(ncap, dtype=np.int8)
        self._n_left = np.full(ncap, -1, dtype=np.int32)
        self._n_right = np.full(ncap, -1, dtype=np.int32)
        self._n_attr = np.full(ncap, -1, dtype=np.int32)
        self._n_thr = np.zeros(ncap, dtype=np.float64)
        self._n_r1 = np.full(ncap, -1, dtype=np.int32)
        self._n_r2 = np.full(ncap, -1, dtype=np.int32)
        self._n_draw = np.full(ncap, -1, dtype=np.int32)
        self._n_n = np.zeros(ncap, dtype=np.int32)
        self._n_cnt = np.zeros((ncap, C), dtype=np.int32)
        self._n_s = np.zeros(ncap, dtype=np.int32)
        self._n_e = np.zeros(ncap, dtype=np.int32)
        self._n_cid = np.full(ncap, -1, dtype=np.int32)
        self._n_used = np.zeros(ncap, dtype=bool)
        self._init_bounds(ncap)
        self._nfree = np.arange(ncap - 1, -1, -1, dtype=np.int64)
        self._nfree_n = ncap
        # cache table: one row per cached greedy node
        self._ccap = ccap
        self._c_attr = np.full((ccap, P), -1, dtype=np.int32)
        self._c_off = np.zeros((ccap, P), dtype=np.int64)
        self._c_len = np.zeros((ccap, P), dtype=np.int32)
        self._c_all = np.zeros((ccap, P), dtype=bool)
        self._c_cutp = np.zeros((ccap, P), dtype=np.int64)
        self._c_cutv = np.zeros((ccap, P), dtype=np.float64)
        self._c_hoff = np.zeros((ccap, P), dtype=np.int64)
        self._c_hlen = np.zeros((ccap, P), dtype=np.int32)
        self._cfree = np.arange(ccap - 1, -1, -1, dtype=np.int64)
        self._cfree_n = ccap
        # entry pool (cached candidate pairs)
        self._ecap = ecap
        self._er1 = np.full(ecap, -1, dtype=np.int32)
        self._er2 = np.full(ecap, -1, dtype=np.int32)
        # left class counts of cached pairs, class-major (1-D gathers per class); 16-bit while
        # no node can hold 65,535 records
        cdt = np.uint16 if self._nlive < 65_535 else np.int32
        self._eleft = np.zeros((C, ecap), dtype=cdt)
        self._eused = 0
        self._egarb = 0
        self._init_tables(max(1024, ecap // 4))
        # per-tree layout of records (leaves' instance lists are ranges of it)
        self._samp = np.full((self._T, scap), -1, dtype=np.int32)
        self._pos = np.zeros((self._T, self._cap), dtype=np.int32)
        self._root = np.full(self._T, -1, dtype=np.int64)
        self._tt = np.arange(self._T)

    _NODE_1D = (
        ("_n_tree", 0), ("_n_depth", 0), ("_n_path", 0), ("_n_kind", 0), ("_n_why", 0),
        ("_n_left", -1), ("_n_right", -1), ("_n_attr", -1), ("_n_thr", 0), ("_n_r1", -1),
        ("_n_r2", -1), ("_n_draw", -1), ("_n_n", 0), ("_n_s", 0), ("_n_e", 0),
        ("_n_cid", -1), ("_n_used", False), ("_n_bound", np.inf),
    )  # fmt: skip

    def _init_bounds(self, ncap: int) -> None:
        """Per greedy node, what lets a deletion keep its split without re-scoring (see
        :func:`dare_delete._greedy_changed`): an upper bound on its other candidates' scores
        (+inf: unknown) and its sampled attributes. Derived state, not saved."""
        self._n_bound = np.full(ncap, np.inf)
        self._n_sattr = np.full((ncap, self._P), -1, dtype=np.int32)

    def _alloc_nodes(self, m: int) -> np.ndarray:
        self._grow_nodes(m)
        out = self._nfree[self._nfree_n - m : self._nfree_n][::-1].copy()
        self._nfree_n -= m
        self._n_used[out] = True
        return out

    def _grow_nodes(self, m: int) -> None:
        """Make sure at least m nodes are free (the pool doubles)."""
        if self._nfree_n < m:
            old = self._ncap
            cap = max(2 * old, old + m)
            for name, fill in self._NODE_1D:
                a = getattr(self, name)
                b = np.full(cap, fill, dtype=a.dtype)
                b[:old] = a
                setattr(self, name, b)
            cnt = np.zeros((cap, self._n_cnt.shape[1]), dtype=np.int32)
            cnt[:old] = self._n_cnt
            self._n_cnt = cnt
            sattr = np.full((cap, self._P), -1, dtype=np.int32)
            sattr[:old] = self._n_sattr
            self._n_sattr = sattr
            fresh = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
            nfree = np.zeros(cap, dtype=np.int64)
            nfree[: len(fresh)] = fresh
            nfree[len(fresh) : len(fresh) + self._nfree_n] = self._nfree[: self._nfree_n]
            self._nfree = nfree
            self._nfree_n += len(fresh)
            self._ncap = cap

    def _uncache(self, nodes: np.ndarray) -> None:
        cid = self._n_cid[nodes]
        cid = cid[cid >= 0]
        if cid.size == 0:
            return
        self._egarb += int(self._c_len[cid].sum())
        self._hgarb += int(self._c_hlen[cid].sum())
        self._c_attr[cid] = -1
        self._c_len[cid] = 0
        self._c_hlen[cid] = 0
        self._n_cid[nodes] = -1
        need = self._cfree_n + len(cid)
        if need > len(self._cfree):
            f = np.zeros(max(need, 2 * len(self._cfree)), dtype=np.int64)
            f[: self._cfree_n] = self._cfree[: self._cfree_n]
            self._cfree = f
        self._cfree[self._cfree_n : need] = cid
        self._cfree_n = need

    def _alloc_caches(self, m: int) -> np.ndarray:
        self._grow_caches(m)
        out = self._cfree[self._cfree_n - m : self._cfree_n][::-1].copy()
        self._cfree_n -= m
        return out

    def _grow_caches(self, m: int) -> None:
        """Make sure at least m cache rows are free (the table doubles)."""
        if self._cfree_n < m:
            old = self._ccap
            cap = max(2 * old, old + m)
            P = self._P
            for name, fill, dt in (
                ("_c_attr", -1, np.int32), ("_c_off", 0, np.int64),
                ("_c_len", 0, np.int32), ("_c_all", False, bool),
                ("_c_cutp", 0, np.int64), ("_c_cutv", 0.0, np.float64),
                ("_c_hoff", 0, np.int64), ("_c_hlen", 0, np.int32),
            ):  # fmt: skip
                b = np.full((cap, P), fill, dtype=dt)
                b[:old] = getattr(self, name)
                setattr(self, name, b)
            fresh = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
            cfree = np.zeros(cap, dtype=np.int64)
            cfree[: len(fresh)] = fresh
            cfree[len(fresh) : len(fresh) + self._cfree_n] = self._cfree[: self._cfree_n]
            self._cfree = cfree
            self._cfree_n += len(fresh)
            self._ccap = cap

    def _alloc_entries(self, m: int) -> int:
        self._reserve_entries(m)
        start = self._eused
        self._eused += m
        return start

    def _reserve_entries(self, m: int) -> None:
        """Make room for m more entries (may compact the pool, moving cached segments)."""
        if self._eused + m > self._ecap:
            if self._egarb > self._eused // 4:
                self._compact_entries()
            if self._eused + m > self._ecap:
                cap = max(self._ecap + self._ecap // 4, self._eused + m)
                for name, fill in (("_er1", -1), ("_er2", -1)):
                    a = getattr(self, name)
                    b = np.full(cap, fill, dtype=a.dtype)
                    b[: self._eused] = a[: self._eused]
                    setattr(self, name, b)
                b = np.zeros((self._eleft.shape[0], cap), dtype=self._eleft.dtype)
                b[:, : self._eused] = self._eleft[:, : self._eused]
                self._eleft = b
                self._ecap = cap

    # ------------------------------------------------------------------ value group tables

    def _init_tables(self, hcap: int) -> None:
        """Pool of value group tables (rank, class counts per value of a node), one segment
        per cached slot that keeps one (``_c_hoff``, ``_c_hlen``; length 0: none)."""
        self._hcap = hcap
        self._hr = np.zeros(hcap, dtype=np.int32)
        self._hc = np.zeros((hcap, len(self.classes_)), dtype=np.int32)
        self._hused = 0
        self._hgarb = 0

    def _reserve_tables(self, m: int) -> None:
        """Make room for m more table entries (may compact the pool, moving segments)."""
        if self._hused + m > self._hcap:
            if self._hgarb > self._hused // 4:
                self._compact_tables()
            if self._hused + m > self._hcap:
                cap = max(self._hcap + self._hcap // 2, self._hused + m)
                hr = np.zeros(cap, dtype=np.int32)
                hr[: self._hused] = self._hr[: self._hused]
                hc = np.zeros((cap, self._hc.shape[1]), dtype=np.int32)
                hc[: self._hused] = self._hc[: self._hused]
                self._hr, self._hc, self._hcap = hr, hc, cap

    def _compact_tables(self) -> None:
        """Drop freed table segments (each segment keeps its value order)."""
        cids, ss = np.nonzero(self._c_hlen > 0)
        ln = self._c_hlen[cids, ss].astype(np.int64)
        idx = _ranges(self._c_hoff[cids, ss], ln)
        m = len(idx)
        self._hr[:m] = self._hr[idx]
        self._hc[:m] = self._hc[idx]
        self._c_hoff[cids, ss] = np.cumsum(ln) - ln
        self._hused = m
        self._hgarb = 0

    def _rebuild_tables(self) -> None:
        """Recompute every cached slot's value group table from the node's records (a
        saved forest does not store them: they are a function of the records)."""
        self._init_tables(max(1024, self._hcap if hasattr(self, "_hcap") else 0))
        self._c_hlen[:] = 0
        nodes = np.flatnonzero(self._n_used & (self._n_cid >= 0)).astype(np.int64)
        W = self._work(self._cap)[0]
        ctr = self._ctr()
        while True:
            N, CC, _E, H, R, LAY = self._pools()
            if not _kern.node_tables(nodes, N, CC, H, R, LAY, ctr, self._HIST_RATIO, W):
                break
            at, need = int(ctr[_kern.CTR_SP]), int(ctr[_kern.CTR_NEED_H])
            self._put_ctr(ctr)
            self._reserve_tables(need)
            ctr = self._ctr()
            ctr[_kern.CTR_SP] = at
        self._put_ctr(ctr)

    # ------------------------------------------------------------------ compiled kernels' view

    def _pools(self) -> tuple:
        """The arrays the compiled kernels read and write, grouped as they expect (see
        :mod:`jobs.learners.dare_kernels`): nodes, cache table, entries, group tables,
        records, layout. The free lists are made long enough to take every slot back."""
        if len(self._nfree) < self._ncap:
            f = np.zeros(self._ncap, dtype=np.int64)
            f[: self._nfree_n] = self._nfree[: self._nfree_n]
            self._nfree = f
        if len(self._cfree) < self._ccap:
            f = np.zeros(self._ccap, dtype=np.int64)
            f[: self._cfree_n] = self._cfree[: self._cfree_n]
            self._cfree = f
        N = (
            self._n_tree, self._n_depth, self._n_path, self._n_kind, self._n_why, self._n_left,
            self._n_right, self._n_attr, self._n_thr, self._n_r1, self._n_r2, self._n_draw,
            self._n_n, self._n_cnt, self._n_s, self._n_e, self._n_cid, self._n_used,
            self._nfree, self._n_bound, self._n_sattr,
        )  # fmt: skip
        CC = (
            self._c_attr, self._c_off, self._c_len, self._c_all, self._c_cutp, self._c_cutv,
            self._c_hoff, self._c_hlen, self._cfree,
        )  # fmt: skip
        E = (self._er1, self._er2, self._eleft)
        H = (self._hr, self._hc)
        R = (self._X, self._rank_rm, self._y, self._vals, self._vmix, self._voff, self._dom,
             self._tkeys)
        LAY = (self._samp, self._pos)
        return N, CC, E, H, R, LAY

    def _params(self) -> tuple:
        return (self._maxd, self._drmax, self._msl, self._P, self._k, self._BUFFER,
                self.criterion == "gini", self._CACHE_MIN, self._MAX_DRAWS, self._HIST_RATIO)

    def _ctr(self) -> np.ndarray:
        ctr = np.zeros(_kern.CTR_LEN, dtype=np.int64)
        ctr[_kern.CTR_NFREE] = self._nfree_n
        ctr[_kern.CTR_CFREE] = self._cfree_n
        ctr[_kern.CTR_EUSED] = self._eused
        ctr[_kern.CTR_EGARB] = self._egarb
        ctr[_kern.CTR_HUSED] = self._hused
        ctr[_kern.CTR_HGARB] = self._hgarb
        return ctr

    def _put_ctr(self, ctr: np.ndarray) -> None:
        self._nfree_n = int(ctr[_kern.CTR_NFREE])
        self._cfree_n = int(ctr[_kern.CTR_CFREE])
        self._eused = int(ctr[_kern.CTR_EUSED])
        self._egarb = int(ctr[_kern.CTR_EGARB])
        self._hused = int(ctr[_kern.CTR_HUSED])
        self._hgarb = int(ctr[_kern.CTR_HGARB])

    def _work(self, maxn: int) -> tuple:
        """Scratch buffers of the compiled split search for nodes of up to maxn records
        (kept between calls; not part of the model): W, S, class counts, a record buffer."""
        maxn = max(maxn, self._samp.shape[1]) if hasattr(self, "_samp") else maxn
        C = len(self.classes_)
        KB = self._k + self._BUFFER
        key = (C, self.n_features_, self._P, KB, self._HIST_RATIO)
        wk = getattr(self, "_wk", None)
        if wk is None or wk[0] != key or wk[1] < maxn or wk[2] < self._nvals_max:
            maxn = max(maxn, wk[1] if wk is not None and wk[0] == key else 0)
            W, S = _kern.make_work(maxn, self._nvals_max, self.n_features_, C, self._P, KB,
                                   self._HIST_RATIO)
            wk = (key, maxn, self._nvals_max, W, S, np.zeros(C, dtype=np.int64),
                  np.empty(max(maxn, 1), dtype=np.int64))
            self._wk = wk
        return wk[3], wk[4], wk[5], wk[6]

    def _compact_entries(self) -> None:
        """Drop freed segments and dead entries, keeping each segment's priority order."""
        cids = np.flatnonzero((self._c_attr >= 0).any(axis=1))
        P = self._P
        off = self._c_off[cids].ravel()
        ln = self._c_len[cids].ravel().astype(np.int64)
        idx = _ranges(off, ln)
        seg = np.repeat(np.arange(len(off)), ln)
        keep = self._er1[idx] >= 0
        idx, seg = idx[keep], seg[keep]
        newlen = np.bincount(seg, minlength=len(off)).astype(np.int64)
        newoff = np.cumsum(newlen) - newlen
        m = len(idx)
        self._er1[:m] = self._er1[idx]
        self._er2[:m] = self._er2[idx]
        self._eleft[:, :m] = self._eleft[:, idx]
        self._er1[m : self._eused] = -1
        self._c_off[cids] = newoff.reshape(-1, P)
        self._c_len[cids] = newlen.reshape(-1, P)
        self._eused = m
        self._egarb = 0

    def _trim_pools(self) -> None:
        """Release spare capacity of the node, cache and entry pools (after a fit)."""
        if self._egarb:
            self._compact_entries()
        cap = self._eused + max(1024, self._eused // 16)
        if cap < self._ecap:
            self._er1 = self._er1[:cap].copy()
            self._er2 = self._er2[:cap].copy()
            self._eleft = np.ascontiguousarray(self._eleft[:, :cap])
            self._ecap = cap
        if self._hgarb:
            self._compact_tables()
        cap = self._hused + max(1024, self._hused // 16)
        if cap < self._hcap:
            self._hr = self._hr[:cap].copy()
            self._hc = self._hc[:cap].copy()
            self._hcap = cap
        used = np.flatnonzero(self._n_used)
        top = int(used.max()) + 1 if used.size else 1
        cap = top + max(64, top // 16)
        if cap < self._ncap:
            for name, _fill in self._NODE_1D:
                setattr(self, name, getattr(self, name)[:cap].copy())
            self._n_cnt = self._n_cnt[:cap].copy()
            self._n_sattr = self._n_sattr[:cap].copy()
            self._nfree = np.flatnonzero(~self._n_used)[::-1].copy()
            self._nfree_n = len(self._nfree)
            self._ncap = cap
        cid = self._n_cid[used]
        cid = cid[cid >= 0]
        top = int(cid.max()) + 1 if cid.size else 1
        cap = top + max(16, top // 16)
        if cap < self._ccap:
            inuse = np.zeros(self._ccap, dtype=bool)
            inuse[cid] = True
            for name in ("_c_attr", "_c_off", "_c_len", "_c_all", "_c_cutp", "_c_cutv",
                         "_c_hoff", "_c_hlen"):
                setattr(self, name, getattr(self, name)[:cap].copy())
            self._cfree = np.flatnonzero(~inuse[:cap])[::-1].copy()
            self._cfree_n = len(self._cfree)
            self._ccap = cap

    # ================================================================== keyed choices

    def _nodekey(self, tree: np.ndarray, path: np.ndarray) -> np.ndarray:
        return _h2(self._tkeys[tree], np.asarray(path).astype(_U64))

    def _attr_order(self, nk: np.ndarray, tag: np.uint64) -> np.ndarray:
        h = _h2((nk ^ tag)[:, None], self._attr_u64[None, :])
        return np.argsort(h, axis=1, kind="stable")

    # ================================================================== split kernels

    def _greedy(self, tree, path, n, cnt, rows, off, want_cache):
        """Greedy split of each task; caches (prefix of candidate pairs) where want_cache
        (compiled kernel :func:`dare_kernels.greedy_tasks`)."""
        nk = self._nodekey(tree, path)
        wc = np.ascontiguousarray(want_cache, dtype=bool)
        (ok, attr, r1, r2, slot_attr, allf, cutp, cutv, elen, e_r1, e_r2,
         e_left, hlen, h_r, h_c) = _kern.greedy_tasks(
            nk, n.astype(np.int64), np.ascontiguousarray(cnt, dtype=np.int64),
            rows.astype(np.int64), off.astype(np.int64), wc, self._rank_rm, self._y, self._vals,
            self._vmix, self._voff, self._P, self._k, self._BUFFER, self._msl,
            self.criterion == "gini", self._tab(int(n.max(initial=0)) + 2),
            self._nvals_max, self._HIST_RATIO,
        )  # fmt: skip
        ctask = np.flatnonzero(wc & ok)
        cache = None
        if ctask.size:
            ln = elen[ctask]
            eoff = (np.cumsum(ln.ravel()) - ln.ravel()).reshape(ln.shape)
            hl = hlen[ctask]
            hoff = (np.cumsum(hl.ravel()) - hl.ravel()).reshape(hl.shape)
            cache = (
                ctask, slot_attr[ctask], allf[ctask], cutp[ctask], cutv[ctask], eoff, ln,
                e_r1, e_r2, e_left, hoff, hl, h_r, h_c,
            )  # fmt: skip
        return ok, attr, r1, r2, cache

    def _tab(self, n: int) -> np.ndarray:
        """x log x table for entropy scores (a dummy for Gini)."""
        return _xlogx(n) if self.criterion == "entropy" else _XLOGX[0][:1]

    def _random(self, tree, path, rows, off):
        """Random split of each task: first non-constant attribute in keyed order, first keyed
        draw of the attribute's stream inside [min, max) of the task's values."""
        ntask = len(tree)
        p = self.n_features_
        n = off[1:] - off[:-1]
        nk = self._nodekey(tree, path)
        order = self._attr_order(nk, _TAG_RATTR)
        cur = np.zeros(ntask, dtype=np.int64)
        attr = np.full(ntask, -1, dtype=np.int64)
        lo = np.zeros(ntask)
        hi = np.zeros(ntask)
        pend = np.arange(ntask)
        while pend.size:
            a = order[pend, cur[pend]]
            el = _ranges(off[pend], n[pend])
            x = self._X.ravel()[np.repeat(a * self._X.shape[1], n[pend]) + rows[el]]
            so = np.cumsum(n[pend]) - n[pend]
            mn = np.minimum.reduceat(x, so)
            mx = np.maximum.reduceat(x, so)
            nc = mn < mx
            attr[pend[nc]] = a[nc]
            lo[pend[nc]] = mn[nc]
            hi[pend[nc]] = mx[nc]
            rest = pend[~nc]
            cur[rest] += 1
            pend = rest[cur[rest] < p]
        ok = attr >= 0
        thr = np.zeros(ntask)
        draw = np.full(ntask, -1, dtype=np.int64)
        t = np.flatnonzero(ok)
        base = _h2(nk[t] ^ _TAG_DRAW, attr[t].astype(_U64))
        D = self._dom[attr[t]]
        j0 = 0
        while t.size and j0 < self._MAX_DRAWS:
            J = np.arange(j0, j0 + self._DRAW_CHUNK, dtype=_U64)
            u = (_h2(base[:, None], J[None, :]) >> _S11).astype(np.float64) * _INV53
            v = (2.0 * u - 1.0) * D[:, None]  # exact: u has 53 bits, D is a power of two
            hit = (v >= lo[t][:, None]) & (v < hi[t][:, None])
            anyh = hit.any(axis=1)
            first = hit.argmax(axis=1)
            w = np.flatnonzero(anyh)
            thr[t[w]] = v[w, first[w]]
            draw[t[w]] = j0 + first[w]
            keep = ~anyh
            t, base, D = t[keep], base[keep], D[keep]
            j0 += self._DRAW_CHUNK
        thr[t] = lo[t]  # fallback after _MAX_DRAWS misses (draw stays -1)
        return ok, attr, thr, draw

    def _decide(self, tree, path, depth, rows, off, want_cache=None):
        """The canonical state of each task's node from its records (CSR rows/off)."""
        C = len(self.classes_)
        ntask = len(tree)
        n = (off[1:] - off[:-1]).astype(np.int64)
        trow = np.repeat(np.arange(ntask, dtype=np.int64), n)
        lab = self._y[rows]
        cnt = np.bincount(trow * C + lab, minlength=ntask * C).reshape(ntask, C)
        d = _Decisions()
        d.n, d.cnt = n, cnt
        why = np.zeros(ntask, dtype=np.int8)
        why[depth >= self._maxd] = _W_DEPTH
        why[(why == 0) & (n < 2 * self._msl)] = _W_SMALL
        why[(why == 0) & (cnt.max(axis=1, initial=0) == n)] = _W_PURE
        kind = np.zeros(ntask, dtype=np.int8)
        attr = np.full(ntask, -1, dtype=np.int64)
        thr = np.zeros(ntask)
        r1 = np.full(ntask, -1, dtype=np.int64)
        r2 = np.full(ntask, -1, dtype=np.int64)
        draw = np.full(ntask, -1, dtype=np.int64)
        go_left = np.zeros(len(rows), dtype=bool)
        cand = why == 0
        rnd = np.flatnonzero(cand & (depth < self._drmax))
        grd = np.flatnonzero(cand & (depth >= self._drmax))
        d.cache_task = np.zeros(0, dtype=np.int64)
        if rnd.size:
            el = _ranges(off[rnd], n[rnd])
            soff = np.concatenate([[0], np.cumsum(n[rnd])])
            ok, a, t, j = self._random(tree[rnd], path[rnd], rows[el], soff)
            okr, bad = rnd[ok], rnd[~ok]
            why[bad] = _W_CONST
            kind[okr] = RANDOM
            attr[okr], thr[okr], draw[okr] = a[ok], t[ok], j[ok]
            el = _ranges(off[okr], n[okr])
            ar = np.repeat(attr[okr], n[okr])
            go_left[el] = self._X.ravel()[ar * self._X.shape[1] + rows[el]] <= np.repeat(
                thr[okr], n[okr]
            )
        if grd.size:
            el = _ranges(off[grd], n[grd])
            soff = np.concatenate([[0], np.cumsum(n[grd])])
            if want_cache is None:
                wc = n[grd] >= self._CACHE_MIN
            else:
                wc = want_cache[grd] & (n[grd] >= self._CACHE_MIN)
            ok, a, q1, q2, cache = self._greedy(
                tree[grd], path[grd], n[grd], cnt[grd], rows[el], soff, wc
            )
            okg, bad = grd[ok], grd[~ok]
            # no non-constant attribute at all -> CONST, else no split leaves msl records
            why[bad] = _W_MSL
            kind[okg] = GREEDY
            attr[okg], r1[okg], r2[okg] = a[ok], q1[ok], q2[ok]
            if bad.size:
                why[bad[self._all_constant(rows, off, bad)]] = _W_CONST
            v1 = self._vals[self._voff[attr[okg]] + r1[okg]]
            v2 = self._vals[self._voff[attr[okg]] + r2[okg]]
            thr[okg] = _midpoint(v1, v2)
            el = _ranges(off[okg], n[okg])
            ar = np.repeat(attr[okg], n[okg])
            go_left[el] = self._rank.ravel()[ar * self._rank.shape[1] + rows[el]] <= np.repeat(
                r1[okg], n[okg]
            )
            if cache is not None:
                (ct, d.cache_slots, d.cache_all, d.cache_cutp, d.cache_cutv, d.cache_off,
                 d.cache_len, d.e_r1, d.e_r2, d.e_left, d.cache_hoff, d.cache_hlen, d.h_r,
                 d.h_c) = cache  # fmt: skip
                d.cache_task = grd[ct]
        d.kind, d.why, d.attr, d.thr, d.r1, d.r2, d.draw, d.go_left = (
            kind, why, attr, thr, r1, r2, draw, go_left
        )
        return d

    def _all_constant(self, rows, off, tasks):
        n = off[1:] - off[:-1]
        res = np.ones(len(tasks), dtype=bool)
        el = _ranges(off[tasks], n[tasks])
        so = np.cumsum(n[tasks]) - n[tasks]
        for a in range(self.n_features_):
            x = self._X[a, rows[el]]
            res &= np.minimum.reduceat(x, so) == np.maximum.reduceat(x, so)
        return res

    # ================================================================== building

    def _install_caches(self, nodes: np.ndarray, d: _Decisions, sel: np.ndarray) -> None:
        """Store the cache rows of tasks d.cache_task[sel] on `nodes` (parallel to sel)."""
        if len(nodes) == 0:
            return
        self._uncache(nodes)
        cids = self._alloc_caches(len(nodes))
        ln = d.cache_len[sel]
        eo = d.cache_off[sel]
        tot = int(ln.sum())
        start = self._alloc_entries(tot)
        src = _ranges(eo.ravel(), ln.ravel())
        dst = np.arange(start, start + tot)
        self._er1[dst] = d.e_r1[src]
        self._er2[dst] = d.e_r2[src]
        self._eleft[:, dst] = d.e_left[src].T
        newoff = start + (np.cumsum(ln.ravel()) - ln.ravel()).reshape(ln.shape)
        self._c_attr[cids] = d.cache_slots[sel]
        self._c_off[cids] = newoff
        self._c_len[cids] = ln
        self._c_all[cids] = d.cache_all[sel]
        self._c_cutp[cids] = d.cache_cutp[sel]
        self._c_cutv[cids] = d.cache_cutv[sel]
        hl = d.cache_hlen[sel]
        htot = int(hl.sum())
        self._reserve_tables(htot)
        hsrc = _ranges(d.cache_hoff[sel].ravel(), hl.ravel())
        hdst = np.arange(self._hused, self._hused + htot)
        self._hr[hdst] = d.h_r[hsrc]
        self._hc[hdst] = d.h_c[hsrc]
        self._c_hoff[cids] = self._hused + (np.cumsum(hl.ravel()) - hl.ravel()).reshape(hl.shape)
        self._c_hlen[cids] = hl
        self._hused += htot
        self._n_cid[nodes] = cids

    def _grow_subtrees(self, stack: np.ndarray, ctr: np.ndarray, rows: np.ndarray) -> int:
        """Run the compiled builder on the tasks of `stack` until it is done, growing the
        pools whenever it stops short of room (it resumes where it stopped). Returns its
        work (records x levels), the unit of the batch cost estimate."""
        sp = int(ctr[_kern.CTR_SP])
        n_max = int((stack[:sp, 7] - stack[:sp, 6]).max(initial=0))
        tab = self._tab(n_max + 2)
        W, S, cnt, _rbuf = self._work(n_max)
        Pm = self._params()
        while True:
            N, CC, E, H, R, LAY = self._pools()
            if not _kern.build_subtrees(stack, ctr, rows, N, CC, E, H, R, LAY, Pm, tab, W, S,
                                        cnt):
                break
            sp, work = int(ctr[_kern.CTR_SP]), int(ctr[_kern.CTR_WORK])
            need_e, need_h = int(ctr[_kern.CTR_NEED_E]), int(ctr[_kern.CTR_NEED_H])
            self._put_ctr(ctr)
            self._grow_nodes(max(2, self._ncap // 2))
            self._grow_caches(max(1, self._ccap // 2))
            self._reserve_entries(max(need_e, self._ecap // 4))
            self._reserve_tables(max(need_h, self._hcap // 4))
            ctr = self._ctr()
            ctr[_kern.CTR_SP] = sp
            ctr[_kern.CTR_WORK] = work
        self._put_ctr(ctr)
        return int(ctr[_kern.CTR_WORK])

    # ================================================================== fit / predict

    def fit(self, ids: Any, X: Any, y: Any) -> DaREForest:
        """Train on (ids, X, y); ids are unique record ids (strings or ints)."""
        params = set(self.get_params(deep=False))
        for name in list(vars(self)):
            if name not in params:
                delattr(self, name)
        self._validate_params()
        rids = unique_ids(ids)
        if len(rids) == 0:
            raise ValueError("fit needs at least one record")
        Xa = check_features(X, len(rids), None)
        ya = self._check_y(y, len(rids))
        self.classes_, yi = np.unique(ya, return_inverse=True)
        self.n_features_ = int(Xa.shape[1])
        p = self.n_features_
        self._P = max(1, int(math.isqrt(p)))
        self._tkeys = np.array(
            [prf_u64(int(self.random_state), "dare-tree", t) for t in range(self._T)], dtype=_U64
        )
        self._attr_u64 = np.arange(p, dtype=_U64)
        self._init_store(rids, Xa, yi.astype(np.int32))
        self._rerank()
        self._update_domain()
        n = len(rids)
        est_nodes = self._T * min(2 ** (self._maxd + 1), 2 * n + 1)
        self._init_pools(
            ncap=max(64, est_nodes // 2), ccap=max(16, self._T * 16),
            ecap=max(1024, self._T * min(2 * n // self._CACHE_MIN + 1, 2**self._maxd)
                     * self._P * (self._k + self._BUFFER) // 2),
            scap=n,
        )  # fmt: skip
        work = self._build_trees(np.arange(self._T))
        self._trim_pools()
        # what the batch cost estimate starts from (not part of the model)
        self._costs = {"work": work, "n": n, "rho": None}
        self.generation_ = next(_GENERATIONS)
        return self

    def _build_trees(self, trees: np.ndarray) -> int:
        """Grow whole trees from the live records (compiled, depth first, a chunk of trees
        at a time so that the record buffer stays small)."""
        live = np.flatnonzero(self._alive[: self._nrec]).astype(np.int64)
        nl = len(live)
        work = 0
        chunk = max(1, 1_000_000 // max(1, nl))
        for t0 in range(0, len(trees), chunk):
            tr = trees[t0 : t0 + chunk].astype(np.int64)
            m = len(tr)
            roots = self._alloc_nodes(m)
            self._root[tr] = roots
            stack = np.zeros((m + self._maxd + 4, 8), dtype=np.int64)
            stack[:m, 0] = roots
            stack[:m, 1] = tr
            stack[:m, 2] = 1
            stack[:m, 5] = self._samp.shape[1]
            stack[:m, 6] = np.arange(m) * nl
            stack[:m, 7] = np.arange(1, m + 1) * nl
            ctr = self._ctr()
            ctr[_kern.CTR_SP] = m
            work += self._grow_subtrees(stack, ctr, np.tile(live, m))
        return work

    def _leaf_of(self, Xq: np.ndarray, trees: np.ndarray) -> np.ndarray:
        """Leaf node of each (tree, query row), following the served thresholds."""
        nq = Xq.shape[0]
        node = np.repeat(self._root[trees][:, None], nq, axis=1)
        qi = np.broadcast_to(np.arange(nq), node.shape)
        for _ in range(self._maxd + 1):
            internal = self._n_kind[node] != LEAF
            if not internal.any():
                break
            a = self._n_attr[node]
            go = Xq[qi, np.maximum(a, 0)] <= self._n_thr[node]
            node = np.where(internal, np.where(go, self._n_left[node], self._n_right[node]), node)
        return node

    def scores(self, X: Any) -> np.ndarray:
        """Mean over trees of the leaf class frequencies, shape (n, n_classes)."""
        self._check_fitted()
        Xq = check_features(X, None, self.n_features_)
        C = len(self.classes_)
        out = np.zeros((Xq.shape[0], C))
        step = max(1, 100_000 // max(1, Xq.shape[0]))
        for t0 in range(0, self._T, step):
            trees = np.arange(t0, min(self._T, t0 + step))
            leaf = self._leaf_of(Xq, trees)
            cnt = self._n_cnt[leaf].astype(np.float64)
            nn = np.maximum(self._n_n[leaf], 1).astype(np.float64)
            out += (cnt / nn[..., None]).sum(axis=0)
        return out / self._T

    def leaf_nodes(self, X: Any) -> np.ndarray:
        """Read-only: the leaf node id reached by every query in every tree, shape (T, n).

        Node ids index the rows of :meth:`leaves` (``leaves()["node"]``); they are pool slots,
        valid only until the forest is next updated."""
        self._check_fitted()
        Xq = check_features(X, None, self.n_features_)
        return self._leaf_of(Xq, np.arange(self._T)).astype(np.int64)

    def leaves(self) -> dict[str, np.ndarray]:
        """Read-only: every leaf of every tree with its cell of the input space.

        Returns arrays with one row per leaf: ``node`` (pool id, as :meth:`leaf_nodes`),
        ``tree``, ``path`` (heap path, root 1), ``depth``, ``counts`` (class counts, shape
        (L, n_classes)), ``n`` (records) and ``lo``, ``hi`` (shape (L, n_features)): a query q
        reaches the leaf iff ``lo < q <= hi`` in every coordinate (routing is ``x <= thr`` to
        the left), with -inf / +inf where no split bounds the coordinate. A leaf's class
        probabilities in :meth:`scores` are ``counts / max(n, 1)``."""
        self._check_fitted()
        p = self.n_features_
        cur = self._root[: self._T].astype(np.int64)
        lo = np.full((len(cur), p), -np.inf)
        hi = np.full((len(cur), p), np.inf)
        out_n, out_lo, out_hi = [], [], []
        while cur.size:
            leaf = self._n_kind[cur] == LEAF
            out_n.append(cur[leaf])
            out_lo.append(lo[leaf])
            out_hi.append(hi[leaf])
            cur, lo, hi = cur[~leaf], lo[~leaf], hi[~leaf]
            if not cur.size:
                break
            a = self._n_attr[cur].astype(np.int64)
            thr = self._n_thr[cur]
            r = np.arange(len(cur))
            lhi = hi.copy()
            lhi[r, a] = np.minimum(hi[r, a], thr)
            rlo = lo.copy()
            rlo[r, a] = np.maximum(lo[r, a], thr)
            cur = np.concatenate([self._n_left[cur], self._n_right[cur]]).astype(np.int64)
            lo = np.concatenate([lo, rlo])
            hi = np.concatenate([lhi, hi])
        node = np.concatenate(out_n)
        order = np.lexsort((self._n_path[node], self._n_tree[node]))
        node = node[order]
        return {
            "node": node,
            "tree": self._n_tree[node].astype(np.int64),
            "path": self._n_path[node].astype(np.int64),
            "depth": self._n_depth[node].astype(np.int64),
            "counts": self._n_cnt[node].astype(np.int64),
            "n": self._n_n[node].astype(np.int64),
            "lo": np.concatenate(out_lo)[order],
            "hi": np.concatenate(out_hi)[order],
        }

    # ================================================================== neighbourhood queries

    def _rank_of(self, attr: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return self._rank.ravel()[attr * self._rank.shape[1] + slots].astype(np.int64)

    # ================================================================== deletion

    def _path_nodes(self, slots: np.ndarray):
        """Nodes on the paths of the given records in every tree: (node, tree, depth, record#),
        tree-major and root first within a tree. Greedy nodes route by rank (x <= v1),
        random nodes by value (x <= threshold)."""
        T, m = self._T, len(slots)
        cur = np.repeat(self._root[:, None], m, axis=1)
        rec = np.broadcast_to(np.arange(m), (T, m))
        out = [cur]
        for _ in range(self._maxd):
            c0 = np.maximum(cur, 0)
            kind = np.where(cur >= 0, self._n_kind[c0], LEAF)
            if not (kind != LEAF).any():
                break
            a = np.maximum(self._n_attr[c0], 0).astype(np.int64)
            sl = slots[rec]
            go = np.where(
                kind == GREEDY,
                self._rank_of(a, sl) <= self._n_r1[c0],
                self._X.ravel()[a * self._X.shape[1] + sl] <= self._n_thr[c0],
            )
            cur = np.where(kind != LEAF, np.where(go, self._n_left[c0], self._n_right[c0]), -1)
            out.append(cur)
        P = np.stack(out, axis=2)  # (T, m, depth)
        tt, rr, dd = np.nonzero(P >= 0)
        return P[tt, rr, dd].astype(np.int64), tt, dd, rr

    def _node_rows(self, nodes: np.ndarray):
        """Live records of each node (CSR rows, off), from the layout ranges."""
        s = self._n_s[nodes].astype(np.int64)
        ln = self._n_e[nodes].astype(np.int64) - s
        el = _ranges(s, ln)
        S = self._samp.shape[1]
        sl = self._samp.ravel()[np.repeat(self._n_tree[nodes].astype(np.int64) * S, ln) + el]
        sl = sl.astype(np.int64)
        ok = sl >= 0
        cnt = np.bincount(np.repeat(np.arange(len(nodes)), ln)[ok], minlength=len(nodes))
        return sl[ok], np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)

    def _decide_nodes(self, nodes: np.ndarray, want_cache: np.ndarray) -> _Decisions:
        rows, off = self._node_rows(nodes)
        return self._decide(
            self._n_tree[nodes].astype(np.int64), self._n_path[nodes].astype(np.int64),
            self._n_depth[nodes].astype(np.int64), rows, off, want_cache,
        )  # fmt: skip

    def _same(self, nodes: np.ndarray, d: _Decisions) -> np.ndarray:
        kind = self._n_kind[nodes]
        same = d.kind == kind
        g = kind == GREEDY
        same &= ~g | ((d.attr == self._n_attr[nodes]) & (d.r1 == self._n_r1[nodes]))
        rn = kind == RANDOM
        same &= ~rn | (
            (d.attr == self._n_attr[nodes]) & (d.thr == self._n_thr[nodes])
            & (d.draw == self._n_draw[nodes])
        )  # fmt: skip
        return same

    def _set_r2(self, nodes: np.ndarray, r2: np.ndarray) -> None:
        if len(nodes) == 0:
            return
        a = self._n_attr[nodes].astype(np.int64)
        self._n_r2[nodes] = r2
        v1 = self._vals[self._voff[a] + self._n_r1[nodes]]
        v2 = self._vals[self._voff[a] + r2]
        self._n_thr[nodes] = _midpoint(v1, v2)

    def _outermost(self, nodes: np.ndarray) -> np.ndarray:
        """Drop nodes that lie below another node of the set."""
        nodes = np.unique(nodes)
        if len(nodes) <= 1:
            return nodes
        return nodes[~self._below(nodes, nodes)]

    def _rebuild(self, nodes: np.ndarray) -> int:
        """Retrain the subtrees rooted at `nodes` from their live records (compiled: the
        old subtrees are freed, the new ones grown depth first). Returns the records; the
        build work is added to _rebuilt_work."""
        if len(nodes) == 0:
            return 0
        if not hasattr(self, "_rebuilt_work"):
            self._rebuilt_work = 0
        nodes = np.asarray(nodes, dtype=np.int64)
        width = int((self._n_e[nodes].astype(np.int64) - self._n_s[nodes]).sum())
        rows = np.empty(max(width, 1), dtype=np.int64)
        stack = np.zeros((len(nodes) + self._maxd + 4, 8), dtype=np.int64)
        ctr = self._ctr()
        N, CC, _E, _H, _R, LAY = self._pools()
        m = _kern.prepare_rebuild(nodes, N, CC, LAY, ctr, rows, stack)
        self._rebuilt_work += self._grow_subtrees(stack, ctr, rows)
        return int(m)

    def _below(self, nodes: np.ndarray, roots: np.ndarray) -> np.ndarray:
        """Whether each node lies strictly below one of the roots."""
        out = np.zeros(len(nodes), dtype=bool)
        if len(roots) == 0 or len(nodes) == 0:
            return out
        t = self._n_tree[nodes]
        dep = self._n_depth[nodes].astype(np.int64)
        pa = self._n_path[nodes]
        for rt, rd, rp in zip(self._n_tree[roots].tolist(), self._n_depth[roots].tolist(),
                              self._n_path[roots].tolist(), strict=True):
            m = (t == rt) & (dep > rd)
            out[m] |= (pa[m] >> (dep[m] - rd)) == rp
        return out

    def _resolve(self, pn, ptree, pdepth, flag, r2_nodes, r2_vals, inst_nodes, inst_d, inst_sel,
                 extra, stats, single_path: bool) -> None:
        """Apply the outcome of checking the nodes on some paths: rebuild the outermost changed
        nodes, update thresholds and install recomputed caches of unchanged nodes above them.

        single_path: pn is one root-to-leaf path per tree (a deletion), so the outermost
        changed node of a tree is simply its shallowest flagged one."""
        fl = np.flatnonzero(flag)
        if single_path:
            big = np.iinfo(np.int64).max
            first = np.full(self._T, big, dtype=np.int64)
            np.minimum.at(first, ptree[fl], pdepth[fl])
            roots = pn[fl][pdepth[fl] == first[ptree[fl]]]
            if len(extra):
                roots = self._outermost(np.concatenate([roots, extra]))

            def keep_of(nodes):
                ok = self._n_depth[nodes] < first[self._n_tree[nodes]]
                if len(extra):
                    ok &= ~self._below(nodes, roots) & ~np.isin(nodes, roots)
                return ok
        else:
            roots = self._outermost(np.concatenate([pn[fl], extra]))

            def keep_of(nodes):
                return ~self._below(nodes, roots) & ~np.isin(nodes, roots)

        if len(r2_nodes):
            keep = keep_of(r2_nodes)
            self._set_r2(r2_nodes[keep], r2_vals[keep])
        if len(inst_nodes):
            keep = keep_of(inst_nodes)
            self._install_caches(inst_nodes[keep], inst_d, inst_sel[keep])
        stats["subtrees_retrained"] += len(roots)
        stats["records_retrained"] += self._rebuild(roots)

    def _delete_apply(self, r: int, stats: dict, dirty: np.ndarray, extra: list,
                      stop: bool) -> np.ndarray:
        """Remove record r from the counts, caches and value tables of the nodes on its
        paths, WITHOUT retraining (compiled: :func:`dare_delete.delete_record`): each node
        is re-evaluated against its stored split, and a tree's walk ends at the first node
        whose canonical state now differs, or (in a batch) that is already marked dirty.
        Random nodes whose stream domain changed are appended to `extra`.

        Deferring the retraining is exact: a node's counts, caches and layout range follow
        its records, and records are routed by the stored splits, so the nodes above the
        first changed one of each path are right; that one, and every node marked dirty by
        a batch, is retrained from its live records once, at the end, which gives its
        canonical subtree whatever happened below it.

        With `stop` (a deletion on its own) returns the changed nodes; in a batch they are
        marked in `dirty`."""
        c = int(self._y[r])
        self._alive[r] = False
        self._nlive -= 1
        self._class_n[c] -= 1
        self._samp[self._tt, self._pos[:, r]] = -1
        domchg = np.zeros(self.n_features_, dtype=bool)
        if self._drmax > 0:
            at = np.flatnonzero(np.abs(self._X[:, r]) >= self._absmax)
            if at.size:  # the domain moves only when the last record at the largest |x| goes
                self._absmax_n[at] -= 1
                at = at[self._absmax_n[at] <= 0]
            if at.size:
                dom = self._update_domain(at)
                if dom.size:
                    domchg[dom] = True
                    used = np.flatnonzero(self._n_used & (self._n_kind == RANDOM))
                    extra.append(used[np.isin(self._n_attr[used], dom)])
        flagged = np.empty(self._T, dtype=np.int64)
        counts = np.zeros(2, dtype=np.int64)
        W, S, cnt, rbuf = self._work(self._cap)
        tab = self._tab(int(self._nlive) + 2)
        Pm = self._params()
        GO = (self._roff, self._rstart, self._gorder, self._alive)
        ctr = self._ctr()
        ctr[_kern.CTR_AT_NODE] = -1
        while True:
            N, CC, E, H, R, LAY = self._pools()
            m = _del.delete_record(r, c, stop, domchg, dirty, flagged, self._root, N, CC, E, H,
                                   R, LAY, GO, Pm, tab, W, S, cnt, rbuf, ctr, counts)
            if m >= 0:
                break
            # short of room at one node: make it and resume there
            keep = ctr[_kern.CTR_AT_TREE : _kern.CTR_NFLAG + 1].copy()
            need_e, need_h = int(ctr[_kern.CTR_NEED_E]), int(ctr[_kern.CTR_NEED_H])
            self._put_ctr(ctr)
            self._reserve_entries(max(need_e, self._ecap // 8))
            self._reserve_tables(max(need_h, self._hcap // 8))
            ctr = self._ctr()
            ctr[_kern.CTR_AT_TREE : _kern.CTR_NFLAG + 1] = keep
        self._put_ctr(ctr)
        stats["nodes_touched"] += int(counts[_del.STAT_NODES])
        stats["caches_recomputed"] += int(counts[_del.STAT_CACHES])
        return flagged[:m]

    def _delete_slots(self, slots: list[int], stats: dict) -> None:
        """Delete records (slots) one after the other from the counts and caches, then
        retrain the outermost changed nodes once."""
        stop = len(slots) == 1
        dirty = np.zeros(1 if stop else self._ncap, dtype=bool)
        extra: list[np.ndarray] = []
        roots = np.zeros(0, dtype=np.int64)
        for r in slots:
            roots = self._delete_apply(r, stats, dirty, extra, stop)
        if not stop:
            roots = _del.outermost(self._root, dirty, self._n_kind, self._n_left, self._n_right)
        if extra:
            roots = self._outermost(np.concatenate([roots, *extra]))
        self._rebuilt_work = 0
        stats["subtrees_retrained"] += len(roots)
        stats["records_retrained"] += self._rebuild(roots)
        self._learn_costs(len(slots), self._rebuilt_work)

    # ================================================================== classes

    def _drop_empty_classes(self) -> None:
        gone = np.flatnonzero(self._class_n == 0)
        if gone.size == 0:
            return
        keep = np.flatnonzero(self._class_n > 0)
        remap = np.cumsum(self._class_n > 0) - 1
        self.classes_ = self.classes_[keep]
        self._class_n = self._class_n[keep]
        self._n_cnt = np.ascontiguousarray(self._n_cnt[:, keep])
        self._eleft = np.ascontiguousarray(self._eleft[keep])
        self._hc = np.ascontiguousarray(self._hc[:, keep])
        y = self._y[: self._nrec]
        self._y[: self._nrec] = np.where(np.isin(y, gone), 0, remap[y])

    def _insert_classes(self, labels: np.ndarray) -> None:
        new = np.union1d(self.classes_, labels)
        if len(new) == len(self.classes_):
            return
        pos = np.searchsorted(new, self.classes_)
        C = len(new)

        def widen(a: np.ndarray) -> np.ndarray:
            b = np.zeros((a.shape[0], C), dtype=a.dtype)
            b[:, pos] = a
            return b

        self._n_cnt = widen(self._n_cnt)
        self._eleft = np.ascontiguousarray(widen(self._eleft.T).T)
        self._hc = widen(self._hc)
        cn = np.zeros(C, dtype=np.int64)
        cn[pos] = self._class_n
        self._class_n = cn
        self._y[: self._nrec] = pos[self._y[: self._nrec]]
        self.classes_ = new

    # ================================================================== public updates

    def _report(self, op, rids, t0, stats) -> UpdateReport:
        self.generation_ = next(_GENERATIONS)
        return UpdateReport(
            op=op, record_ids=list(rids.tolist()), guarantee=self.guarantee,
            seconds=time.perf_counter() - t0, retrained=dict(stats),
            metrics={"n_records": float(self._nlive)},
        )  # fmt: skip

    def delete(self, ids: Any) -> UpdateReport:
        """Forget records by id; the forest is then identical to a retrain without them.

        Raises :class:`UnknownRecordError` (model unchanged) when an id is not live
        (never seen, or already deleted), :class:`DuplicateRecordError` when an id is
        named twice, ``ValueError`` when every live record would be deleted."""
        self._check_fitted()
        t0 = time.perf_counter()
        rids = ids_to_delete(ids, self._slot)
        if len(rids) and len(rids) >= self._nlive:
            raise ValueError("cannot delete every live record (a forest needs at least one)")
        stats = {
            "mode": "incremental", "subtrees_retrained": 0, "records_retrained": 0,
            "nodes_touched": 0, "caches_recomputed": 0,
        }  # fmt: skip
        if len(rids) == 0:
            return self._report("delete", rids, t0, stats)
        m = len(rids)
        incr, refit = self._estimate(m)
        stats.update(cost_incremental=round(incr), cost_refit=round(refit))
        if (incr > refit) if self._CHOOSE_BY_COST else (m > self._REFIT_FRACTION * self._nlive):
            gone = set(rids.tolist())
            keep = [i for i in self._slot if i not in gone]
            self._refit(keep)
            stats.update(mode="refit", subtrees_retrained=self._T, records_retrained=len(keep))
            return self._report("delete", rids, t0, stats)
        self._delete_slots([self._slot.pop(i) for i in rids.tolist()], stats)
        self._drop_empty_classes()
        return self._report("delete", rids, t0, stats)

    def _estimate(self, m: int) -> tuple[float, float]:
        """Estimated cost of deleting m records (incremental, refit), in units of build work
        (records x levels), so that a batch never costs more than a retrain (up to the
        estimate). Deterministic: it depends on the forest and its update history only.

        Refit: the forest's build work scaled to the records that stay. Incremental: per
        record, the nodes on its paths (_NODE_UNITS each) and a fixed part; plus the build
        work the batch retrains: one deletion retrains a share rho of the forest's work
        (measured, a running average), a batch of m the union of m such shares,
        1 - (1 - rho)^m of it, as each changed subtree is retrained once."""
        c = self._costs
        n = max(int(self._nlive), 1)
        work = c["work"] * n / max(c["n"], 1)
        path_len = c["work"] / max(c["n"] * self._T, 1)  # nodes a record passes, per tree
        rho = self._PRIOR_RHO if c["rho"] is None else c["rho"]
        refit = work * (n - m) / n
        per = self._T * path_len * self._NODE_UNITS + self._RECORD_UNITS
        incr = m * per + work * (1.0 - (1.0 - rho) ** m)
        return incr, refit

    def _learn_costs(self, m: int, work: int) -> None:
        """Fold the build work an incremental deletion of m records retrained into the
        running estimate of the share one deletion retrains."""
        c = self._costs
        total = c["work"] * max(int(self._nlive), 1) / max(c["n"], 1)
        share = min(work / max(total, 1.0), 0.999)
        rho = 1.0 - (1.0 - share) ** (1.0 / m)
        c["rho"] = rho if c["rho"] is None else (1 - self._EMA) * c["rho"] + self._EMA * rho

    def _refit(self, keep_ids: list[str]) -> None:
        sl = np.array([self._slot[i] for i in keep_ids], dtype=np.int64)
        ids = np.array(keep_ids, dtype=object)
        X = self._X[:, sl].T.copy()
        y = self.classes_[self._y[sl]]
        rho = self._costs["rho"]
        self.fit(ids, X, y)
        self._costs["rho"] = rho  # what deletions retrain is not forgotten by a refit

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records; the forest is then identical to a retrain with them.

        Labels never seen before are allowed (``classes_`` grows). Raises
        :class:`DuplicateRecordError` for an id already live (or named twice) and
        ``ValueError`` for a wrong shape or NaN/inf; the model is unchanged on any error."""
        self._check_fitted()
        t0 = time.perf_counter()
        rids = ids_to_add(ids, self._slot)
        Xa = check_features(X, len(rids), self.n_features_)
        ya = self._check_y(y, len(rids))
        try:
            np.union1d(self.classes_, ya)
        except TypeError:
            raise ValueError(
                f"labels {ya[:5].tolist()} cannot be compared with the model's classes "
                f"{self.classes_[:5].tolist()}"
            ) from None
        stats = {
            "mode": "incremental", "subtrees_retrained": 0, "records_retrained": 0,
            "nodes_touched": 0, "caches_recomputed": 0,
        }  # fmt: skip
        m = len(rids)
        if m == 0:
            return self._report("add", rids, t0, stats)
        if m > self._nlive:
            keep = list(self._slot)
            sl = np.array([self._slot[i] for i in keep], dtype=np.int64)
            self.fit(
                np.concatenate([np.array(keep, dtype=object), rids]),
                np.concatenate([self._X[:, sl].T, Xa]),
                np.concatenate([self.classes_[self._y[sl]], ya]),
            )
            stats.update(mode="refit", subtrees_retrained=self._T, records_retrained=self._nlive)
            return self._report("add", rids, t0, stats)
        self._add_records(rids, Xa, ya, stats)
        return self._report("add", rids, t0, stats)

    def _add_records(self, rids, Xa, ya, stats) -> None:
        self._insert_classes(np.unique(ya))
        m = len(rids)
        slots = np.arange(self._nrec, self._nrec + m, dtype=np.int64)
        self._grow_store(self._nrec + m)
        self._X[:, slots] = Xa.T
        yi = np.searchsorted(self.classes_, ya).astype(np.int32)
        self._y[slots] = yi
        self._ids[slots] = rids
        self._nrec += m
        remap = self._rerank()
        self._remap_ranks(remap)
        for i, sl in zip(rids.tolist(), slots.tolist(), strict=True):
            self._slot[i] = sl
        self._alive[slots] = True
        self._nlive += m
        if self._nlive >= 65_535 and self._eleft.dtype != np.int32:
            self._eleft = self._eleft.astype(np.int32)
        self._class_n += np.bincount(yi, minlength=len(self.classes_))
        dom = np.zeros(0, dtype=np.int64)
        if self._drmax > 0:
            above = np.abs(Xa) > self._absmax[None, :]
            self._absmax_n += (np.abs(Xa) == self._absmax[None, :]).sum(axis=0)
            dom = self._update_domain(np.flatnonzero(above.any(axis=0)))
        pn, ptree, pdepth, prec = self._path_nodes(slots)
        self._place(pn, ptree, prec, slots)
        C = len(self.classes_)
        u, inv = np.unique(pn, return_inverse=True)
        add = np.bincount(inv * C + yi[prec], minlength=len(u) * C).reshape(len(u), C)
        self._n_cnt[u] += add.astype(np.int32)
        self._n_n[u] += add.sum(axis=1).astype(np.int32)
        self._n_bound[u] = np.inf  # re-derived below; the next deletion re-scores them
        stats["nodes_touched"] += len(u)
        # every node on the new records' paths is re-derived from its records
        order = np.lexsort((self._n_depth[u], self._n_tree[u]))
        u = u[order]
        ut = self._n_tree[u].astype(np.int64)
        ud = self._n_depth[u].astype(np.int64)
        d = self._decide_nodes(u, np.ones(len(u), dtype=bool))
        same = self._same(u, d)
        flag = ~same
        lf = same & (d.kind == LEAF)
        self._n_why[u[lf]] = d.why[lf]
        g = same & (d.kind == GREEDY) & (d.r2 != self._n_r2[u])
        stats["caches_recomputed"] += int(d.cache_task.size)
        # cached-ness follows the node's size; nodes that must drop their cache
        was = self._n_cid[u] >= 0
        inst_sel = np.flatnonzero(same[d.cache_task]) if d.cache_task.size else np.zeros(0, int)
        inst_nodes = u[d.cache_task[inst_sel]] if d.cache_task.size else np.zeros(0, int)
        has_new = np.zeros(len(u), dtype=bool)
        if d.cache_task.size:
            has_new[d.cache_task] = True
        self._uncache(u[was & ~has_new & same])
        extra = np.zeros(0, dtype=np.int64)
        if dom.size:
            used = np.flatnonzero(self._n_used & (self._n_kind == RANDOM))
            extra = used[np.isin(self._n_attr[used], dom)]
        self._resolve(
            u, ut, ud, flag, u[g], d.r2[g], inst_nodes, d, inst_sel, extra, stats, False
        )

    def _remap_ranks(self, remap: list[np.ndarray] | None) -> None:
        """After re-ranking, translate the ranks stored in nodes and caches."""
        if remap is None:
            return
        flat = np.concatenate(remap)
        base = np.concatenate([[0], np.cumsum([len(m) for m in remap])])
        g = np.flatnonzero(self._n_used & (self._n_kind == GREEDY))
        a = self._n_attr[g].astype(np.int64)
        self._n_r1[g] = flat[base[a] + self._n_r1[g]]
        self._n_r2[g] = flat[base[a] + self._n_r2[g]]
        cids = np.flatnonzero((self._c_attr >= 0).any(axis=1))
        if cids.size:
            sa = self._c_attr[cids].ravel().astype(np.int64)
            ln = self._c_len[cids].ravel().astype(np.int64)
            E = _ranges(self._c_off[cids].ravel(), ln)
            ea = np.repeat(sa, ln)
            live = self._er1[E] >= 0
            E, ea = E[live], ea[live]
            self._er1[E] = flat[base[ea] + self._er1[E]]
            self._er2[E] = flat[base[ea] + self._er2[E]]
        cids, ss = np.nonzero(self._c_hlen > 0)
        if cids.size:
            ln = self._c_hlen[cids, ss].astype(np.int64)
            Hx = _ranges(self._c_hoff[cids, ss], ln)
            ha = np.repeat(self._c_attr[cids, ss].astype(np.int64), ln)
            self._hr[Hx] = flat[base[ha] + self._hr[Hx]]

    def _place(self, pn, ptree, prec, slots) -> None:
        """Put new records into free positions of their leaves' layout ranges."""
        leaf = self._n_kind[pn] == LEAF
        lt, ln_, lr = ptree[leaf], pn[leaf], prec[leaf]
        for _attempt in range(2):
            u, inv, cnt = np.unique(ln_, return_inverse=True, return_counts=True)
            s = self._n_s[u].astype(np.int64)
            w = self._n_e[u].astype(np.int64) - s
            el = _ranges(s, w)
            li = np.repeat(np.arange(len(u)), w)
            free = self._samp[self._n_tree[u][li], el] < 0
            nfree = np.bincount(li, weights=free, minlength=len(u)).astype(np.int64)
            short = nfree < cnt
            if not short.any():
                fpos = el[free]
                fo = np.cumsum(nfree) - nfree
                order = np.argsort(inv, kind="stable")
                k_in = np.arange(len(order)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
                target = np.empty(len(order), dtype=np.int64)
                target[order] = fpos[fo[inv[order]] + k_in]
                self._samp[lt, target] = slots[lr]
                self._pos[lt, slots[lr]] = target
                return
            need = np.zeros(self._ncap, dtype=np.int64)
            np.add.at(need, ln_, 1)
            for t in np.unique(self._n_tree[u[short]]).tolist():
                self._relayout(t, need)
        raise RuntimeError("could not place new records")  # pragma: no cover

    def _relayout(self, t: int, extra: np.ndarray) -> None:
        """Re-lay tree t's records leaf by leaf, leaving room for extra[leaf] new ones."""
        nodes = np.flatnonzero(self._n_used & (self._n_tree == t))
        dep = self._n_depth[nodes].astype(np.int64)
        dm = int(dep.max()) + 1
        key = (self._n_path[nodes] - (np.int64(1) << dep)) << (dm - dep)
        nodes = nodes[np.lexsort((dep, key))]
        leaves = nodes[self._n_kind[nodes] == LEAF]
        rows, off = self._node_rows(leaves)
        cnt = np.diff(off)
        width = cnt + extra[leaves] + np.maximum(2, cnt // 8)
        total = int(width.sum())
        if total > self._samp.shape[1]:
            samp = np.full((self._T, max(total, self._samp.shape[1] * 5 // 4)), -1, np.int32)
            samp[:, : self._samp.shape[1]] = self._samp
            self._samp = samp
        start = np.cumsum(width) - width
        self._samp[t] = -1
        q = _ranges(start, cnt)
        self._samp[t, q] = rows
        self._pos[t, rows] = q
        self._n_s[leaves] = start
        self._n_e[leaves] = start + width
        inner = nodes[self._n_kind[nodes] != LEAF]
        inner = inner[np.argsort(-self._n_depth[inner], kind="stable")]
        for d in np.unique(self._n_depth[inner])[::-1].tolist():
            nd = inner[self._n_depth[inner] == d]
            self._n_s[nd] = self._n_s[self._n_left[nd]]
            self._n_e[nd] = self._n_e[self._n_right[nd]]

    # ================================================================== hashing / verify / io

    def _canonical_nodes(self) -> np.ndarray:
        nodes = np.flatnonzero(self._n_used)
        dep = self._n_depth[nodes].astype(np.int64)
        dm = int(dep.max()) + 1
        key = (self._n_path[nodes] - (np.int64(1) << dep)) << (dm - dep)
        return nodes[np.lexsort((dep, key, self._n_tree[nodes]))]

    def _selected_candidates(self, nodes: np.ndarray):
        """The k selected pairs of every cache slot of `nodes` (canonically ordered): per slot
        (node index, slot, attribute, all-flag), per pair (slot index, v1, v2, left counts)."""
        k = self._k
        cached = np.flatnonzero(self._n_cid[nodes] >= 0)
        cid = self._n_cid[nodes[cached]].astype(np.int64)
        sa = self._c_attr[cid]
        sn, ss = np.nonzero(sa >= 0)
        a = sa[sn, ss].astype(np.int64)
        ln = self._c_len[cid[sn], ss].astype(np.int64)
        E = _ranges(self._c_off[cid[sn], ss], ln)
        seg = np.repeat(np.arange(len(sn)), ln)
        alive = self._er1[E] >= 0
        ca = np.cumsum(alive)
        before = np.concatenate([[0], ca])[np.cumsum(ln) - ln]
        sel = alive & (ca - alive - np.repeat(before, ln) < k)
        E, seg = E[sel], seg[sel]
        ea = a[seg]
        v1 = self._vals[self._voff[ea] + self._er1[E]]
        v2 = self._vals[self._voff[ea] + self._er2[E]]
        return (
            cached[sn].astype(np.int64), ss.astype(np.int64), a, self._c_all[cid[sn], ss],
            seg.astype(np.int64), v1, v2, self._eleft[:, E].T.astype(np.int64),
        )  # fmt: skip

    def content_hash(self) -> str:
        """SHA-256 over everything that determines predictions and future updates."""
        self._check_fitted()
        nodes = self._canonical_nodes()
        idx = np.full(self._ncap, -1, dtype=np.int64)
        idx[nodes] = np.arange(len(nodes))
        kind = self._n_kind[nodes]
        g = kind == GREEDY
        a = self._n_attr[nodes].astype(np.int64)
        v1 = np.zeros(len(nodes))
        v2 = np.zeros(len(nodes))
        v1[g] = self._vals[self._voff[a[g]] + self._n_r1[nodes[g]]]
        v2[g] = self._vals[self._voff[a[g]] + self._n_r2[nodes[g]]]
        thr = np.where(kind != LEAF, self._n_thr[nodes], 0.0)
        draw = np.where(kind == RANDOM, self._n_draw[nodes], -1).astype(np.int64)
        struct = np.stack([
            self._n_tree[nodes], self._n_depth[nodes], self._n_path[nodes], kind,
            self._n_why[nodes], np.where(kind != LEAF, a, -1), draw, self._n_n[nodes],
            idx[np.where(kind != LEAF, self._n_left[nodes], nodes)],
            idx[np.where(kind != LEAF, self._n_right[nodes], nodes)],
        ], axis=1).astype(np.int64)  # fmt: skip
        cnt = self._n_cnt[nodes].astype(np.int64)
        sel = self._selected_candidates(nodes)
        # each leaf's records, by id: leaf index of every live record in every tree
        live_ids = sorted(self._slot)
        lslots = np.array([self._slot[i] for i in live_ids], dtype=np.int64)
        leaves = nodes[kind == LEAF]
        rows, off = self._node_rows(leaves)
        owner = np.full((self._T, self._cap), -1, dtype=np.int64)
        owner[np.repeat(self._n_tree[leaves], np.diff(off)), rows] = np.repeat(
            idx[leaves], np.diff(off)
        )
        member = owner[:, lslots]
        h = hashlib.sha256()
        header = {
            "format": FORMAT,
            # a parameter at a default that changes nothing is left out, so that forests
            # hashed before it existed keep their hash
            "params": {key: (v if not isinstance(v, np.integer) else int(v))
                       for key, v in self.get_params(deep=False).items()
                       if not (key == "random_domain" and v is None)},
            "classes": [repr(c) for c in self.classes_.tolist()],
            "n_features": self.n_features_,
            "ids": live_ids,
        }  # fmt: skip
        h.update(json.dumps(header, sort_keys=True).encode())
        for arr in (
            struct, thr, v1, v2, cnt, sel[0], sel[1], sel[2], sel[4], sel[5], sel[6], sel[7],
            member,
            self._X[:, lslots], self._y[lslots].astype(np.int64),
        ):
            arr = np.ascontiguousarray(arr)
            h.update(str(arr.dtype).encode())
            h.update(repr(arr.shape).encode())
            h.update(arr.tobytes())
        return h.hexdigest()

    def _live_data(self):
        ids = sorted(self._slot)
        sl = np.array([self._slot[i] for i in ids], dtype=np.int64)
        return np.array(ids, dtype=object), self._X[:, sl].T.copy(), self.classes_[self._y[sl]]

    def verify(self) -> VerifyReport:
        """Retrain from scratch on the live records and compare content hashes."""
        self._check_fitted()
        t0 = time.perf_counter()
        ids, X, y = self._live_data()
        fresh = type(self)(**self.get_params(deep=False)).fit(ids, X, y)
        served = self.content_hash()
        retrained = fresh.content_hash()
        return VerifyReport(
            exact=served == retrained, served_hash=served, retrained_hash=retrained,
            seconds=time.perf_counter() - t0,
            detail={"n_records": len(ids), "n_trees": self._T},
        )  # fmt: skip

    _SAVED = (
        "_y", "_alive", "_class_n", "_n_tree", "_n_depth", "_n_path", "_n_kind", "_n_why",
        "_n_left", "_n_right", "_n_attr", "_n_thr", "_n_r1", "_n_r2", "_n_draw", "_n_n",
        "_n_cnt", "_n_s", "_n_e", "_n_cid", "_n_used", "_nfree", "_c_attr", "_c_off", "_c_len",
        "_c_all", "_c_cutp", "_c_cutv", "_cfree", "_er1", "_er2", "_eleft", "_samp", "_pos",
        "_root",
    )  # fmt: skip
    _SCALARS = (
        "_cap", "_nrec", "_nlive", "_ncap", "_nfree_n", "_ccap", "_cfree_n", "_ecap", "_eused",
        "_egarb",
    )  # fmt: skip

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (JSON) and ``path/arrays.npz`` (plain arrays, no pickle).

        Deleted records' slots are dropped first (:meth:`_compact_store`): the bundle holds
        the live records' ids, features and labels and nothing of a deleted one."""
        self._check_fitted()
        self._compact_store()
        p = Path(path)
        arrays = {name.lstrip("_"): getattr(self, name) for name in self._SAVED}
        arrays["X"] = self._X[:, : self._nrec]
        arrays["ids"] = np.array(self._ids[: self._nrec].tolist(), dtype=str)
        arrays["classes"] = np.asarray(self.classes_)
        if arrays["classes"].dtype == object:
            arrays["classes"] = arrays["classes"].astype(str)
        meta = {
            "format": FORMAT,
            "params": {k: (int(v) if isinstance(v, np.integer) else v)
                       for k, v in self.get_params(deep=False).items()},
            "n_features": self.n_features_,
            "scalars": {name: int(getattr(self, name)) for name in self._SCALARS},
            "content_hash": self.content_hash(),
        }  # fmt: skip
        write_bundle(p, meta, _ARRAYS, lambda fh: np.savez(fh, **arrays))

    @classmethod
    def load(cls, path: str | Path) -> DaREForest:
        """Read a bundle written by :meth:`save`; checks its content hash."""
        p = Path(path)
        meta = read_bundle_meta(p, FORMAT, "DaRE")
        self = cls(**meta["params"])
        self._validate_params()
        with np.load(read_bundle_payload(p, _ARRAYS), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        for name, v in meta["scalars"].items():
            setattr(self, name, int(v))
        for name in self._SAVED:
            setattr(self, name, arrays[name.lstrip("_")].copy())
        self.classes_ = arrays["classes"]
        self.n_features_ = int(meta["n_features"])
        pf = self.n_features_
        self._P = max(1, int(math.isqrt(pf)))
        self._tkeys = np.array(
            [prf_u64(int(self.random_state), "dare-tree", t) for t in range(self._T)], dtype=_U64
        )
        self._attr_u64 = np.arange(pf, dtype=_U64)
        self._tt = np.arange(self._T)
        X = np.zeros((pf, self._cap), dtype=np.float64)
        X[:, : self._nrec] = arrays["X"]
        self._X = X
        ids = np.empty(self._cap, dtype=object)
        ids[: self._nrec] = arrays["ids"].tolist()
        self._ids = ids
        self._slot = {
            ids[i]: i for i in np.flatnonzero(self._alive[: self._nrec]).tolist()
        }
        self._rerank()
        self._update_domain()
        self._c_hoff = np.zeros(self._c_attr.shape, dtype=np.int64)
        self._c_hlen = np.zeros(self._c_attr.shape, dtype=np.int32)
        self._init_bounds(self._ncap)
        self._rebuild_tables()
        work = int(self._n_n[self._n_used].sum())  # = what the builder went through
        self._costs = {"work": work, "n": self._nlive, "rho": None}
        got = self.content_hash()
        if got != meta["content_hash"]:
            raise ValueError(f"{p}: content hash mismatch after loading ({got} != "
                             f"{meta['content_hash']})")
        self.generation_ = next(_GENERATIONS)
        return self
