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

Deletions run in one compiled kernel (:mod:`jobs.learners.dare.delete_kernels`) over all
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

Where the code is
-----------------
This module holds the estimator (parameters, fit, predict, hashing, verify, save and
load). :class:`DaREForest` takes its other halves from :mod:`~jobs.learners.dare.storage`
(record store, node/cache/entry pools, value group tables, the kernels' view of them),
:mod:`~jobs.learners.dare.split_search` (keyed choices, split search, building) and
:mod:`~jobs.learners.dare.updates` (deletion, addition, classes); the compiled kernels
are :mod:`~jobs.learners.dare.kernels` (search, building) and
:mod:`~jobs.learners.dare.delete_kernels` (a deletion's walk); keyed mixing and the helpers they
all share are in :mod:`~jobs.learners.dare.common`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError

from jobs.learners.base import (
    Learner,
    VerifyReport,
    check_features,
    read_bundle_meta,
    read_bundle_payload,
    unique_ids,
    write_bundle,
)
from jobs.learners.dare import kernels as _kern
from jobs.learners.dare.common import _GENERATIONS, _U64, GREEDY, LEAF, RANDOM, _ranges
from jobs.learners.dare.split_search import SplitSearch
from jobs.learners.dare.storage import ForestStore
from jobs.learners.dare.updates import ForestUpdates
from jobs.learners.keyed import prf_u64

FORMAT = "obliviate.dare/1"
_ARRAYS = "arrays.npz"

class DaREForest(ForestUpdates, SplitSearch, ForestStore, Learner, BaseEstimator):
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
    #: on a deletion's path costs 10-100 units, 20-45 on most tables (implied by timing
    #: batches of 1-1,000 deletions against a refit on tables of 1,400-26,000 records,
    #: distinct and tied, 2-10 classes, 14-64 features, d_rmax 0-3; the kernel is bound
    #: by memory, the builder by the data), a deleted record about 1,000 more (the Python
    #: around it). 100 had batches of 120 at 16k records refit in twice the time of the
    #: incremental path
    _NODE_UNITS = 50.0
    _RECORD_UNITS = 1000.0
    #: share of the forest's build work one deletion retrains, until measured, and the
    #: weight of the newest measurement in its running average
    _PRIOR_RHO = 0.005
    _EMA = 0.2
    #: batches of at least this many deletions learn and use a share of their own
    _BATCH_MIN = 8

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
        self._costs = {"work": work, "n": n, "rho": None, "rho_batch": None}
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
        # the value group tables only serve updates: built on the first one (_pools), so
        # that a version loaded to be served or guarded does not pay for them
        self._tables_stale = True
        work = int(self._n_n[self._n_used].sum())  # = what the builder went through
        self._costs = {"work": work, "n": self._nlive, "rho": None, "rho_batch": None}
        got = self.content_hash()
        if got != meta["content_hash"]:
            raise ValueError(f"{p}: content hash mismatch after loading ({got} != "
                             f"{meta['content_hash']})")
        self.generation_ = next(_GENERATIONS)
        return self
