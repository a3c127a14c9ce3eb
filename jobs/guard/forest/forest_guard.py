"""A sound iDP label guard for DaRE forests, from exact leave-one-out forests.

A query is certain when no single record's deletion can make another class win: per tree
and record the change is a closed form at the record's leaf where fragility finds every
split stable, and otherwise the subtree DaRE would grow without it (an exact pair) or the
worst a tree can do (a worst-case pair, under the state budget). Tied to the forest's
content hash; updated incrementally; noise-all on a mismatch.
See docs/DESIGN.md (Beyond LUCID, for DaRE forests)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jobs.guard.forest.pairs import (
    ForestStructure,
    FragilePairs,
    below_dropped,
    fragile_pairs,
    grow_pairs,
    highest_pairs,
    match_rows,
    merge_kept,
    path_keys,
)
from jobs.guard.forest.routing_kernels import LEAF_SCAN, PairIndex, QueryArrays, gains, route
from jobs.guard.label_guard import LabelGuard
from jobs.learners.base import (
    check_features,
    hash_arrays,
    read_bundle_meta,
    read_bundle_payload,
    write_bundle,
)
from jobs.learners.dare import view as dv
from jobs.learners.dare.forest import DaREForest

SOUND = "sound"
NOISE_ALL = "noise-all"
FORMAT = "obliviate.forest-guard/2"
_TABLES = "pairs.npz"
# The grown subtrees of the fragile pairs are the guard's state. It may take at most this
# many times the forest's own saved size (as arrays); the pairs whose subtrees are
# smallest are grown first, the others are charged the worst a tree can do below their
# node (few at large n: near-ties high up in a tree; many at small n, where most splits
# are near-ties).
STATE_BUDGET = 1.5  # the default of ForestGuard(state_budget=)
# Growing a pair's subtree costs about its node's records times the levels below it, and a
# near-tie node high up a tree makes many of its records fragile: growing all of those
# would cost (records at the node)^2. Pairs at nodes with more records than this are
# worst-case pairs, which keeps fit and update near-linear. Measured on the census-like
# table (one process, CPU seconds of a fit / certified share of 2,000 held-out rows):
# 1,024: 2.9 s / 0.914 at 2.6*10^4 rows, 4.6 s / 0.940 at 10^5, 58 s / 0.972 at 10^6;
# 8,192: 15.2 s / 0.961, 24.8 s / 0.957, 70 s / 0.977 (docs/benchmarks.md, bench_scale).
GROW_ROWS = 8192  # the default of ForestGuard(grow_rows=)
# An update whose changed nodes hold more than this share of all (node, record) pairs
# refits instead. Measured (one run each, 2 cores): at 16k records 10 deletions change 75%
# of them and update in 3.4 s, 50 change 92% (6.8 s), 200 change 98% (8.8 s), where a
# fit takes 7.6 s; at 2k, 3 change 57% (0.6 s), 10 change 78% (1.4 s), a fit takes
# 1.1-1.6 s. An update pays for what it keeps only when it keeps enough
REFIT_SHARE = 0.9
_PAIR_BYTES = 12  # node, record, root (int32)
# what the saved state stores (the kernels read int64; thresholds stay exact float64)
_SAVED_DTYPES = {"node": np.int32, "prec": np.int32, "root": np.int32, "leaf": np.bool_,
                 "attr": np.int16, "thr": np.float64, "left": np.int32, "right": np.int32,
                 "cnt": np.int32, "n": np.int32}


@dataclass
class ForestFitReport:
    seconds: float
    n_records: int
    n_trees: int
    n_leaves: int
    #: (record, tree) pairs where the record is fragile somewhere on its path
    fragile_pairs: int
    forest_hash: str
    detail: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the guard


class ForestGuard:
    """Label-only, eps-iDP answers from a DaRE forest (docs/DESIGN.md, "Beyond LUCID, for DaRE
    forests").

    Build with :meth:`fit` (or :meth:`load` a saved one); :meth:`certain` gives (class
    indices, certainty mask), :meth:`answer` publishes labels through :class:`LabelGuard`.
    """

    def __init__(self, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
                 random_state: int | None = None, state_budget: float = STATE_BUDGET,
                 grow_rows: float = GROW_ROWS) -> None:
        if not state_budget >= 0:
            raise ValueError(f"state_budget must be >= 0, got {state_budget!r}")
        if not grow_rows >= 0:
            raise ValueError(f"grow_rows must be >= 0, got {grow_rows!r}")
        self.forest = forest
        self.state_budget = state_budget
        self.grow_rows = grow_rows
        self.guard = LabelGuard(max(2, forest.n_classes_), epsilon=epsilon,
                                memo_size=memo_size, random_state=random_state)
        self.forest_hash: str | None = None
        self.fit_report: ForestFitReport | None = None
        self._st: ForestStructure | None = None
        self._pairs: FragilePairs | None = None
        self._ids: np.ndarray | None = None  # what the pairs' record positions name
        self._P: np.ndarray | None = None
        self._query: QueryArrays | None = None
        self._summary: dict[str, Any] = {}
        self._checked: tuple[int, str, bool] | None = None  # (generation, hash, matches)

    @classmethod
    def fit(cls, forest: DaREForest, epsilon: float = 1.0, memo_size: int = 100_000,
            random_state: int | None = None, state_budget: float = STATE_BUDGET,
            grow_rows: float = GROW_ROWS) -> ForestGuard:
        """Compute the fragile pairs and their subtrees for `forest`; `state_budget`: the
        most the subtrees may take, as a multiple of the forest's saved size; `grow_rows`:
        the most records a pair's node may hold for its subtree to be grown (both inf:
        every pair exact, whatever it costs)."""
        self = cls(forest, epsilon=epsilon, memo_size=memo_size, random_state=random_state,
                   state_budget=state_budget, grow_rows=grow_rows)
        self.refit()
        return self

    def refit(self, nodes: np.ndarray | None = None) -> ForestFitReport:
        """Bring the guard up to date with the forest as it is now; sound mode afterwards.

        `nodes` (the forest's node ids): every node whose records changed since the last
        fit (the paths of the updated records and the retrained subtrees); the pairs at
        all other nodes are kept (docs/guard.md, "DaRE forests"). None recomputes everything."""
        return self._refit(nodes, ForestStructure.of(self.forest), time.perf_counter())

    def _refit(self, nodes: np.ndarray | None, st: ForestStructure, t0: float,
               grow_seconds: float = math.inf) -> ForestFitReport:
        """refit() with the forest's structure as it is now (`st`), timed from `t0`; pairs
        not grown within `grow_seconds` stay worst-case (:attr:`complete` False)."""
        h = self.forest.content_hash()
        C = st.cnt.shape[1]
        incremental = nodes is not None and self._pairs is not None
        if incremental:
            v = dv.view(self.forest)
            nodes = np.asarray(nodes, dtype=np.int64)
            nodes = nodes[(nodes >= 0) & (nodes < len(v.used))]
            # random nodes are recomputed always: a deletion that moves a value domain
            # reaches all of them (there are few)
            nodes = np.union1d(nodes[v.used[nodes]],
                               np.flatnonzero(v.used & (v.kind == dv.RANDOM)))
            touched = np.array(sorted({st.node_of[int(u)] for u in nodes.tolist()}),
                               dtype=np.int64)
            kept, dropped = self._kept(st, touched)
        tally: dict[str, float] = {}
        node, prec, dom = fragile_pairs(self.forest, st, nodes if incremental else None, tally)
        if incremental:
            node, prec, dom = highest_pairs(st, *below_dropped(self.forest, st, touched, dropped,
                                                           node, prec, dom))
            node, prec, dom, kept = merge_kept(st, node, prec, dom, kept)
        node_bytes = 23 + 4 * C  # a grown node as saved: see _SAVED_DTYPES
        budget = self.state_budget * dv.saved_nbytes(self.forest) - _PAIR_BYTES * len(node)
        if incremental:
            budget -= _PAIR_BYTES * len(kept.node) + node_bytes * len(kept.leaf)
        fresh, late = grow_pairs(self.forest, st, node, prec, dom,
                                  int(min(max(budget / node_bytes, 0), 2**62)), self.grow_rows,
                                  time.perf_counter() + grow_seconds)
        pairs = FragilePairs.concat([kept, fresh], C) if incremental else fresh
        # kept pairs an earlier update left worst-case for time stay worst-case
        complete = late == 0 and (not incremental or self.complete)
        rep = ForestFitReport(
            seconds=time.perf_counter() - t0, n_records=int(self.forest.n_records_),
            n_trees=int(self.forest.n_estimators), n_leaves=int((st.kind == dv.LEAF).sum()),
            fragile_pairs=int(len(pairs.node)), forest_hash=h,
            detail={"incremental": bool(incremental), "pairs_grown": int(len(node)),
                    "exact_pairs": int((pairs.root >= 0).sum()),
                    "subtree_nodes": int(len(pairs.leaf)), "deferred_pairs": late,
                    "complete": complete, **tally})
        self._install(st, pairs, rep)
        return rep

    def update(self, deleted: Sequence[str] = (), added: Sequence[str] = (),
               grow_seconds: float | None = None) -> ForestFitReport:
        """After the forest deleted and added these records (one batch or several since the
        last fit): recompute what they can have changed and keep the rest. The changed
        nodes: the deleted records' paths before, the added ones' after, and every node
        whose split or counts moved, with its subtree.

        `grow_seconds`: grow the new pairs' subtrees for at most this long (once the
        fragile pairs are known; the records with the most pairs first); the pairs not
        grown by then are worst-case pairs, which is sound and certifies fewer queries:
        :attr:`complete` turns False until a fit. The worker publishes with such a guard at
        once and refits it when the stream pauses."""
        t0 = time.perf_counter()
        if grow_seconds is None:
            grow_seconds = math.inf
        elif not grow_seconds >= 0:
            raise ValueError(f"grow_seconds must be >= 0, got {grow_seconds!r}")
        if (self._st is None or self._pairs is None
                or not np.array_equal(self._classes, self.forest.classes_)):
            # a class that came or went renumbers every count
            return self._refit(None, ForestStructure.of(self.forest), t0, grow_seconds)
        old = self._st
        new = ForestStructure.of(self.forest)
        gone = np.asarray(list(deleted), dtype=object)
        old_pos = np.searchsorted(self._ids, gone)
        found = (old_pos < len(self._ids)) & (
            self._ids[np.minimum(old_pos, len(self._ids) - 1)] == gone)
        ids = self.forest.record_ids_
        on_paths = np.concatenate([
            path_keys(old, old_pos[found]),
            path_keys(new, np.searchsorted(ids, np.asarray(list(added), dtype=object)))])
        new_keys = new.keys()
        # a node whose split moved (or that is new) sends other records to its children:
        # its whole subtree changed; one whose counts alone moved holds fewer or more
        # records, and only itself changed (its children are on the same paths)
        i = match_rows(old.keys(), new_keys)
        j = np.maximum(i, 0)
        split = ((i < 0) | (old.kind[j] != new.kind) | (old.attr[j] != new.attr)
                 | (old.thr[j] != new.thr))
        counts = ~split & ((old.n[j] != new.n) | (old.cnt[j] != new.cnt).any(axis=1))
        cover = np.zeros(len(new.kind) + 1, dtype=np.int64)
        top = np.flatnonzero(split)
        np.add.at(cover, top, 1)
        np.add.at(cover, top + new.size[top], -1)
        split = np.cumsum(cover[:-1]) > 0
        changed = split | counts | (match_rows(on_paths, new_keys) >= 0)
        # a big batch (or a forest refitted from scratch) changes most nodes: recomputing
        # them one by one, keeping the few others, then costs more than a fit; not so when
        # growth is bounded in time: what is kept keeps its subtrees, a fit would not
        if math.isinf(grow_seconds) and new.n[changed].sum() > REFIT_SHARE * new.n.sum():
            return self._refit(None, new, t0, grow_seconds)
        nodes = np.unique(new.forest_node[changed])
        return self._refit(nodes.astype(np.int64), new, t0, grow_seconds)

    @property
    def complete(self) -> bool:
        """Every pair the state budget admits has its subtree (no update ran out of time
        since the last fit)."""
        return self.fit_report is not None and bool(self.fit_report.detail.get("complete",
                                                                               True))

    def _kept(self, st: ForestStructure, touched: np.ndarray
              ) -> tuple[FragilePairs, tuple[np.ndarray, np.ndarray]]:
        """The last fit's pairs at nodes that did not change (with their subtrees), moved to
        the new compact ids and record positions, pairs of deleted records dropped; and
        (node, record) of the live records' pairs at `touched` nodes (compact ids)."""
        old_st, old = self._st, self._pairs
        remap_node = match_rows(st.keys(), old_st.keys())
        ids = self.forest.record_ids_
        held = self._ids[old.prec]
        at = np.searchsorted(ids, held)
        ok = (at < len(ids)) & (ids[np.minimum(at, len(ids) - 1)] == held)
        node = remap_node[old.node]
        hit = np.isin(node, touched)
        keep = (node >= 0) & ok & ~hit
        gone = (node >= 0) & ok & hit
        return (old.select(keep, node=node, prec=np.where(ok, at, -1)),
                (node[gone], at[gone]))

    def _install(self, st: ForestStructure, pairs: FragilePairs, rep: ForestFitReport) -> None:
        self._st, self._pairs, self._P = st, pairs, st.probabilities()
        self._ids = self.forest.record_ids_
        self._classes = self.forest.classes_.copy()
        f_off, f_rec, f_root = pairs.by_node(len(st.kind), True)
        w_off, w_rec, _ = pairs.by_node(len(st.kind), False)
        self._query = QueryArrays(st.kernel(), PairIndex(f_off, f_rec, f_root, w_off, w_rec),
                                  pairs.pool(), int(self.forest.n_records_),
                                  int(st.depth.max(initial=0)), LEAF_SCAN)
        self.forest_hash = rep.forest_hash
        self.fit_report = rep
        self._summary = self._summarise()
        self._checked = (self.forest.generation_, rep.forest_hash, True)

    @property
    def tol(self) -> float:
        return 1e-9 + 8.0 * float(self.forest.n_estimators) * 2.0**-53

    # ---------------------------------------------------------------- persistence

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (forest hash, fit report, summary) and ``path/pairs.npz``
        (no pickle): the pairs and their subtrees, nodes named by (tree, path)."""
        arrays = self._saved_arrays()
        meta = {
            "format": FORMAT,
            "forest_hash": self.forest_hash,
            "n_classes": int(self.forest.n_classes_),
            # the budget later updates keep to (JSON has no inf: None)
            "state_budget": None if math.isinf(self.state_budget) else self.state_budget,
            "grow_rows": None if math.isinf(self.grow_rows) else self.grow_rows,
            "tables_hash": _tables_hash(arrays),
            "fit_report": asdict(self.fit_report),
            "summary": self._summary,
        }
        write_bundle(Path(path), meta, _TABLES, lambda fh: np.savez(fh, **arrays))

    def _saved_arrays(self) -> dict[str, np.ndarray]:
        if self._st is None or self.fit_report is None:
            raise RuntimeError("nothing to save: the guard has not been fitted")
        arrays = {k: a.astype(_SAVED_DTYPES[k]) for k, a in self._pairs.arrays().items()}
        return arrays | {"node_tree": self._st.tree, "node_path": self._st.path}

    def state_hash(self) -> str:
        """The forest's hash and the hash of the tables :meth:`save` writes: the same
        before saving and after loading, so a manifest can name the guard it published."""
        return f"{self.forest_hash}:{_tables_hash(self._saved_arrays())}"

    @classmethod
    def load(cls, path: str | Path, forest: DaREForest, epsilon: float = 1.0,
             memo_size: int = 100_000, random_state: int | None = None) -> ForestGuard:
        """Read the state written by :meth:`save` for `forest`.

        Raises ValueError when `forest` is not the forest it was fitted to (content hash)
        or the state does not match its recorded hash: pairs of another forest would
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
        names = sorted((*FragilePairs.ARRAYS, "node_tree", "node_path"))
        if sorted(arrays) != names or _tables_hash(arrays) != meta["tables_hash"]:
            raise ValueError(f"{p}: the guard's state does not match its recorded hash")
        st = ForestStructure.of(forest)
        pairs = FragilePairs(**{
            k: arrays[k].astype(np.float64 if k == "thr" else bool if k == "leaf" else np.int64)
            for k in FragilePairs.ARRAYS})
        # equal hashes imply equal trees; checked because the kernels do not check bounds
        if not (np.array_equal(st.tree, arrays["node_tree"])
                and np.array_equal(st.path, arrays["node_path"])
                and pairs.fits(len(st.kind), forest.n_records_, forest.n_features_in_,
                               forest.n_classes_)):  # fmt: skip
            raise ValueError(f"{p}: the guard's state does not fit the forest's nodes")
        budget, rows = meta.get("state_budget", STATE_BUDGET), meta.get("grow_rows", GROW_ROWS)
        self = cls(forest, epsilon=epsilon, memo_size=memo_size, random_state=random_state,
                   state_budget=math.inf if budget is None else float(budget),
                   grow_rows=math.inf if rows is None else float(rows))
        self._install(st, pairs, ForestFitReport(**meta["fit_report"]))
        return self

    def _summarise(self) -> dict[str, Any]:
        rep = self.fit_report
        T = rep.n_trees
        return {
            "rule": "forest-loo-fragility",
            "forest_hash": rep.forest_hash,
            "n_records": rep.n_records,
            "n_trees": T,
            "n_leaves": rep.n_leaves,
            "fragile_pairs": rep.fragile_pairs,
            "fragile_share": round(rep.fragile_pairs / max(1, rep.n_records * T), 6),
            "entries": int(rep.detail.get("entries", 0)),
            "fit_seconds": round(float(rep.seconds), 3),
            "complete": self.complete,
            # a record is met once per tree: it moves a class probability by at most 1/T
            # there, so by at most 1 over the forest
            "delta_max_bound": 1.0,
        }

    @property
    def bound_summary(self) -> dict[str, Any]:
        """Small JSON-able record of what the guard rests on, for a model manifest."""
        return dict(self._summary)

    # ---------------------------------------------------------------- binding

    def _sound(self) -> bool:
        """Whether the state is the forest's; re-hashes only when `generation_` moved."""
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
        return route(Q, self._query.trees)

    def _scores(self, rows: np.ndarray) -> np.ndarray:
        """Forest scores from the leaves, with DaREForest.scores' own numpy arithmetic
        (same chunks of trees, same reductions), so the labels are bit for bit its argmax."""
        T, n = rows.shape
        out = np.zeros((n, self._P.shape[1]))
        step = max(1, 100_000 // max(1, n))
        for t0 in range(0, T, step):
            out += self._P[rows[t0:t0 + step]].sum(axis=0)
        return out / T

    def bounds(self, X: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(scores (n, C), delta (n,), H (n, C, C)) with delta(q) = max_x,c |p_{-x,c} - p_c|
        and H[q, a, b] = max_x of how far class b gains on class a at q. Raises when the
        forest no longer matches the guard."""
        if not self._sound():
            raise RuntimeError("the forest changed since the guard was fitted; call refit()")
        Q = check_features(X, None, self.forest.n_features_in_)
        H, delta = gains(Q, self._query)
        return self._scores(self._rows(Q)), delta, H

    def certain(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Predicted class index (lowest on ties) and whether every LOO forest agrees."""
        Q = check_features(X, None, self.forest.n_features_in_)
        if not self._sound():
            return np.argmax(self.forest.scores(Q), axis=1), np.zeros(len(Q), dtype=bool)
        scores, _delta, H = self.bounds(Q)
        w = np.argmax(scores, axis=1)
        rows = np.arange(len(Q))
        margin = scores[rows, w][:, None] - scores
        need = H[rows, w, :] + self.tol
        need[rows, w] = -np.inf
        return w, (margin > need).all(axis=1)

    def answer(self, X: Any) -> np.ndarray:
        """Published labels (values of forest.classes_): certain ones as is, the rest through
        the exponential mechanism per grid cell (everything noised when the forest moved)."""
        Xq = np.asarray(X, dtype=np.float64) + 0.0
        labels, certain = self.certain(Xq)
        idx = self.guard.answer(Xq, labels, certain,
                                lambda C: np.argmax(self.forest.scores(C), axis=1))
        return self.forest.classes_[idx]


def _tables_hash(arrays: dict[str, np.ndarray]) -> str:
    return hash_arrays(*(arrays[k] for k in sorted(arrays)))
