"""DaRE random forests (Brophy & Lowd, ICML 2021) whose updates are checkably exact.

A DaRE forest caches, at every decision node, the counts it needs to re-score
its candidate splits, so deleting (or adding) a record touches the counts along
the record's path in every tree and retrains a subtree only where the best
split changes. The paper promises that an update has the same *distribution*
as a retrain. This implementation promises more: after any sequence of
:meth:`DaREForest.delete` / :meth:`DaREForest.add` calls the forest is
bit-identical to ``DaREForest(same params).fit(X, y, record_ids=live ids)``, which
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
``Tuning.cache_min`` records keep, per sampled attribute, the first k + ``Tuning.buffer``
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
distinct value per ``Tuning.hist_ratio`` of the node's records therefore also keeps the
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

Deletions run in one compiled kernel (:mod:`jobs.learners.dare.delete_kernels`) over all
trees, and a tree's walk ends at its first changed node: that node is retrained
from its live records (:func:`build_kernels.build_subtrees`, depth first, the same
split search as training), so nothing below it needs updating. A batch applies
its records one after the other the same way, also ending a walk at a node an
earlier record of the batch changed (its counts still follow, for its parent's
checks), and retrains the outermost changed nodes once, at the end: a subtree
retrained from its records is the canonical one whatever happened below it, so
this is exact even for a node that flipped back. A batch refits from scratch
instead when that is estimated to cost less (:meth:`CostModel.estimate`,
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
(:func:`records.compact_store`): the value domains are re-derived from the
live records and a cache cut-off that still named a deleted value is lowered to a
live one, so a saved bundle holds nothing of a deleted record. Thresholds are
midpoints of two live values or keyed draws.

The content hash covers the structure, thresholds, counts, the selected
candidates of cached nodes with their counts, the keyed draw indices, each
leaf's records (by id) and the live training set; nothing in it depends on
the order of updates, memory layout or record slots.

Where the code is
-----------------
This module holds the estimator: the hyperparameters, the scikit-learn contract and the
public operations, each delegated to a module that works on the fitted state, one
:class:`~jobs.learners.dare.state.ForestState` (records, value index, domains, node /
cache / entry / table pools, layout, cost model): :mod:`~jobs.learners.dare.training`
(fit), :mod:`~jobs.learners.dare.split_search` (keyed choices, split search),
:mod:`~jobs.learners.dare.builder` (growing subtrees), :mod:`~jobs.learners.dare.deletion`
and :mod:`~jobs.learners.dare.addition` (updates), :mod:`~jobs.learners.dare.costs` (a
batch's choice), :mod:`~jobs.learners.dare.routing` (queries),
:mod:`~jobs.learners.dare.hashing` and :mod:`~jobs.learners.dare.bundle` (hash, save,
load), with :mod:`~jobs.learners.dare.pools`, :mod:`~jobs.learners.dare.records`,
:mod:`~jobs.learners.dare.values` and :mod:`~jobs.learners.dare.labels` for the state's
parts. The compiled kernels are :mod:`~jobs.learners.dare.search_kernels` (search),
:mod:`~jobs.learners.dare.build_kernels` (building) and
:mod:`~jobs.learners.dare.delete_kernels` (a deletion's walk); keyed mixing and the
helpers they all share are in :mod:`~jobs.learners.dare.common`.
"""

from __future__ import annotations

import math
import time
from numbers import Integral, Real
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, _fit_context
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_array, check_is_fitted, validate_data

from jobs.learners.base import (
    Learner,
    UpdateReport,
    VerifyReport,
    check_features,
    ids_to_add,
    ids_to_delete,
    training_ids,
)
from jobs.learners.dare import addition, builder, bundle, deletion, hashing, routing, training
from jobs.learners.dare.common import _GENERATIONS
from jobs.learners.dare.costs import BatchPolicy
from jobs.learners.dare.records import compact_store
from jobs.learners.dare.state import ForestState, SplitRule, Tuning


class _Integers(Interval):
    """Integers in an interval; a bool is not one."""

    def __init__(self, left: int | None, right: int | None, closed: str) -> None:
        super().__init__(Integral, left, right, closed=closed)

    def is_satisfied_by(self, val: Any) -> bool:
        return not isinstance(val, bool) and super().is_satisfied_by(val)


class _PowersOfTwo(Interval):
    """Positive finite powers of two: random-node draws scaled by one stay exact."""

    def __init__(self) -> None:
        super().__init__(Real, 0, None, closed="neither")

    def is_satisfied_by(self, val: Any) -> bool:
        return (not isinstance(val, bool) and super().is_satisfied_by(val)
                and math.isfinite(val) and math.frexp(float(val))[0] == 0.5)

    def __str__(self) -> str:
        return "a positive power of two"


def _labels(y: Any, n: int) -> np.ndarray:
    """`y` as n labels of one comparable kind (numbers or strings, finite)."""
    if y is None:
        raise ValueError("DaREForest requires y to be passed, but the target y is None")
    arr = np.asarray(y)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"y must be 1-D with {n} labels, got shape {arr.shape}")
    if arr.dtype == object:
        raise ValueError("Unknown label type: y must be a numeric or string array (not "
                         "objects: the classes are saved as plain arrays)")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError("y contains NaN or infinite labels")
    return arr


def _update_stats() -> dict[str, Any]:
    return {"mode": "incremental", "subtrees_retrained": 0, "records_retrained": 0,
            "nodes_touched": 0, "caches_recomputed": 0}


class DaREForest(ClassifierMixin, Learner, BaseEstimator):
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
    #: the implementation's thresholds (a subclass may set others: the tests do)
    tuning: ClassVar[Tuning] = Tuning()
    batch_policy: ClassVar[BatchPolicy] = BatchPolicy()

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "n_estimators": [_Integers(1, None, closed="left")],
        "max_depth": [_Integers(0, 60, closed="both")],
        "k": [_Integers(1, None, closed="left")],
        "d_rmax": [_Integers(0, None, closed="left")],
        "criterion": [StrOptions({"gini", "entropy"})],
        "min_samples_leaf": [_Integers(1, None, closed="left")],
        "random_domain": [None, _PowersOfTwo()],
        "random_state": [_Integers(None, None, closed="neither")],
    }

    def __init__(
        self,
        *,
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

    # ================================================================== fitted state

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "state_")

    def _fitted(self) -> ForestState:
        check_is_fitted(self, msg="this %(name)s is not fitted yet; call fit() first")
        return self.state_

    def _rule(self, n_features: int) -> SplitRule:
        t = self.tuning
        return SplitRule(
            n_trees=int(self.n_estimators), max_depth=int(self.max_depth),
            d_rmax=int(self.d_rmax), min_samples_leaf=int(self.min_samples_leaf),
            n_sampled=max(1, math.isqrt(n_features)), k=int(self.k), buffer=t.buffer,
            gini=self.criterion == "gini", cache_min=t.cache_min, max_draws=t.max_draws,
            draw_chunk=t.draw_chunk, hist_ratio=t.hist_ratio,
        )  # fmt: skip

    @property
    def classes_(self) -> np.ndarray:
        """The live records' labels (they change as classes appear and vanish)."""
        return self._fitted().records.classes

    @property
    def n_features_in_(self) -> int:
        return self._fitted().n_features

    @property
    def n_classes_(self) -> int:
        return len(self.classes_)

    @property
    def n_records_(self) -> int:
        """Number of live training records."""
        return int(self._fitted().records.n_live)

    @property
    def record_ids_(self) -> np.ndarray:
        """Live record ids, sorted."""
        return np.array(sorted(self._fitted().records.slot), dtype=object)

    # ================================================================== fit / predict

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X: Any, y: Any, *, record_ids: Any = None) -> DaREForest:
        """Train on (X, y); record_ids are unique record ids (strings or ints), by default
        the row numbers."""
        for name in ("state_", "generation_"):
            self.__dict__.pop(name, None)
        Xa = check_features(check_array(X, dtype=np.float64, ensure_all_finite=False), None,
                            None)
        rids = training_ids(record_ids, len(Xa))
        if len(rids) == 0:
            raise ValueError("fit needs at least one record")
        self.state_ = training.train(self._rule(Xa.shape[1]), rids, Xa, _labels(y, len(rids)),
                                     int(self.random_state), self.random_domain,
                                     self.batch_policy)
        self.generation_ = next(_GENERATIONS)
        return self

    def _queries(self, X: Any) -> np.ndarray:
        """X as the forest reads queries: scikit-learn's checks (2-D, dense, real, the
        fitted width), then :func:`check_features` (finite; a canonical copy, -0.0 is 0.0)."""
        self._fitted()
        Xc = validate_data(self, X, reset=False, dtype=np.float64, ensure_all_finite=False)
        return check_features(Xc, None, None)

    def scores(self, X: Any) -> np.ndarray:
        """Mean over trees of the leaf class frequencies, shape (n, n_classes)."""
        return routing.scores(self._fitted(), self._queries(X))

    def leaf_nodes(self, X: Any) -> np.ndarray:
        """Read-only: the leaf node id reached by every query in every tree, shape (T, n).

        Node ids index the rows of :meth:`leaves` (``leaves()["node"]``); they are pool slots,
        valid only until the forest is next updated."""
        st = self._fitted()
        return routing.leaf_of(st, self._queries(X), np.arange(st.rule.n_trees)).astype(np.int64)

    def leaves(self) -> dict[str, np.ndarray]:
        """Read-only: every leaf of every tree with its cell of the input space.

        Returns arrays with one row per leaf: ``node`` (pool id, as :meth:`leaf_nodes`),
        ``tree``, ``path`` (heap path, root 1), ``depth``, ``counts`` (class counts, shape
        (L, n_classes)), ``n`` (records) and ``lo``, ``hi`` (shape (L, n_features)): a query q
        reaches the leaf iff ``lo < q <= hi`` in every coordinate (routing is ``x <= thr`` to
        the left), with -inf / +inf where no split bounds the coordinate. A leaf's class
        probabilities in :meth:`scores` are ``counts / max(n, 1)``."""
        return routing.leaves(self._fitted())

    # ================================================================== updates

    def _report(self, op: str, rids: np.ndarray, t0: float, stats: dict[str, Any]
                ) -> UpdateReport:
        self.generation_ = next(_GENERATIONS)
        return UpdateReport(
            op=op, record_ids=list(rids.tolist()), guarantee=self.guarantee,
            seconds=time.perf_counter() - t0, retrained=dict(stats),
            metrics={"n_records": float(self.state_.records.n_live)},
        )  # fmt: skip

    def delete(self, ids: Any) -> UpdateReport:
        """Forget records by id; the forest is then identical to a retrain without them.

        Raises :class:`UnknownRecordError` (model unchanged) when an id is not live
        (never seen, or already deleted), :class:`DuplicateRecordError` when an id is
        named twice, ``ValueError`` when every live record would be deleted."""
        st = self._fitted()
        builder.ensure_tables(st)
        t0 = time.perf_counter()
        rids = ids_to_delete(ids, st.records.slot)
        if len(rids) and len(rids) >= st.records.n_live:
            raise ValueError("cannot delete every live record (a forest needs at least one)")
        stats = _update_stats()
        if len(rids):
            self.state_ = deletion.delete(st, rids, stats, int(self.random_state))
        return self._report("delete", rids, t0, stats)

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records; the forest is then identical to a retrain with them.

        Labels never seen before are allowed (``classes_`` grows). Raises
        :class:`DuplicateRecordError` for an id already live (or named twice) and
        ``ValueError`` for a wrong shape or NaN/inf; the model is unchanged on any error."""
        st = self._fitted()
        builder.ensure_tables(st)
        t0 = time.perf_counter()
        rids = ids_to_add(ids, st.records.slot)
        Xa = check_features(X, len(rids), st.n_features)
        ya = _labels(y, len(rids))
        try:
            np.union1d(self.classes_, ya)
        except TypeError:
            raise ValueError(
                f"labels {ya[:5].tolist()} cannot be compared with the model's classes "
                f"{self.classes_[:5].tolist()}"
            ) from None
        stats = _update_stats()
        if len(rids):
            self.state_ = addition.add(st, rids, Xa, ya, stats, int(self.random_state))
        return self._report("add", rids, t0, stats)

    # ================================================================== hashing / verify / io

    def content_hash(self) -> str:
        """SHA-256 over everything that determines predictions and future updates."""
        st = self._fitted()
        header = {
            "format": bundle.FORMAT,
            # a parameter at a default that changes nothing is left out, so that forests
            # hashed before it existed keep their hash
            "params": {key: (v if not isinstance(v, np.integer) else int(v))
                       for key, v in self.get_params(deep=False).items()
                       if not (key == "random_domain" and v is None)},
            "classes": [repr(c) for c in self.classes_.tolist()],
            "n_features": st.n_features,
        }  # fmt: skip
        return hashing.content_hash(st, header)

    def verify(self) -> VerifyReport:
        """Retrain from scratch on the live records and compare content hashes."""
        rec = self._fitted().records
        t0 = time.perf_counter()
        ids = sorted(rec.slot)
        sl = np.array([rec.slot[i] for i in ids], dtype=np.int64)
        fresh = type(self)(**self.get_params(deep=False)).fit(
            rec.X[:, sl].T.copy(), rec.classes[rec.y[sl]], record_ids=np.array(ids, dtype=object))
        served = self.content_hash()
        retrained = fresh.content_hash()
        return VerifyReport(
            exact=served == retrained, served_hash=served, retrained_hash=retrained,
            seconds=time.perf_counter() - t0,
            detail={"n_records": len(ids), "n_trees": int(self.n_estimators)},
        )  # fmt: skip

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (JSON) and ``path/arrays.npz`` (plain arrays, no pickle).

        Deleted records' slots are dropped first (:func:`records.compact_store`): the bundle
        holds the live records' ids, features and labels and nothing of a deleted one."""
        st = self._fitted()
        compact_store(st)
        bundle.save(st, path, self.get_params(deep=False), self.content_hash())

    @classmethod
    def load(cls, path: str | Path) -> DaREForest:
        """Read a bundle written by :meth:`save`; checks its content hash."""
        meta, arrays = bundle.read(path)
        self = cls(**meta["params"])
        self._validate_params()
        self.state_ = bundle.restore(meta, arrays, self._rule(int(meta["n_features"])),
                                     int(self.random_state), self.random_domain,
                                     self.batch_policy)
        got = self.content_hash()
        if got != meta["content_hash"]:
            raise ValueError(f"{Path(path)}: content hash mismatch after loading ({got} != "
                             f"{meta['content_hash']})")
        self.generation_ = next(_GENERATIONS)
        return self
