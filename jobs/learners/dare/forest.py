"""DaRE random forests (Brophy & Lowd, ICML 2021) whose updates are checkably exact.

After any sequence of :meth:`DaREForest.delete` / :meth:`DaREForest.add` calls the forest is
bit-identical to ``DaREForest(same params).fit`` on the live records, because every random
choice is a keyed function of the seed and the node, never a shared stream; ``verify``
retrains and compares content hashes. This module is the estimator; the fitted state
(:class:`~jobs.learners.dare.state.ForestState`) is worked on by the modules beside it.
See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

import json
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
        Key of every random choice (docs/learners.md, "How a DaRE update equals a retrain").
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
        self._hash_memo = None  # nor keep the old state alive
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
            self._hash_memo = None  # the state changes in place
            self.state_ = deletion.delete(st, rids, stats, int(self.random_state))
        return self._report("delete", rids, t0, stats)

    def prepare_updates(self) -> None:
        """The value group tables a saved forest leaves out (a minute at 10^6 records)."""
        builder.ensure_tables(self._fitted())

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
            self._hash_memo = None  # the state changes in place
            self.state_ = addition.add(st, rids, Xa, ya, stats, int(self.random_state))
        return self._report("add", rids, t0, stats)

    # ================================================================== hashing / verify / io

    def content_hash(self) -> str:
        """SHA-256 over everything that determines predictions and future updates."""
        st = self._fitted()
        header = {
            "format": bundle.MODEL_FORMAT,
            # a parameter at a default that changes nothing is left out, so that forests
            # hashed before it existed keep their hash
            "params": {key: (v if not isinstance(v, np.integer) else int(v))
                       for key, v in self.get_params(deep=False).items()
                       if not (key == "random_domain" and v is None)},
            "classes": [repr(c) for c in self.classes_.tolist()],
            "n_features": st.n_features,
        }  # fmt: skip
        # remembered as (state, header, hash) until the state changes: a worker pass asks
        # three times (manifest, bundle, guard), 0.6 s each at 10^5 rows
        key = json.dumps(header, sort_keys=True)
        memo = getattr(self, "_hash_memo", None)
        if memo is not None and memo[0] is st and memo[1] == key:
            return memo[2]
        digest = hashing.content_hash(st, header)
        self._hash_memo = (st, key, digest)
        return digest

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
