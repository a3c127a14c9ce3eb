"""Per-shard LOO sets and bounds for a sharded MLP ensemble, and its certainty rules.

For the served ensemble (``schedule="loo"``), :func:`ensemble_loo_set` rebuilds a shard's
LOO set whose base network is the served shard and whose ``N_{-x}`` is the shard after
``delete([x])``, and :func:`shard_bounds` bounds it, each row tied to its shard network's
hash. :func:`train_sharded_loo` and :func:`naive_certain` serve benchmarks and tests.
See docs/guard.md (SISA ensembles)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from jobs.guard.label_guard import sisa_certain, top_margin, vote_winner
from jobs.guard.lucid.branch_and_bound import BoundReport, compute_bounds
from jobs.learners.keyed import prf_u64
from jobs.learners.networks.loo_training import (
    LOOConfig,
    LOOSet,
    MLPParams,
    loo_work,
    train_loo,
    train_single,
    train_slots,
)

if TYPE_CHECKING:
    from jobs.learners.sisa.ensemble import SISAEnsemble


def shard_seed(seed: int, shard: int) -> int:
    """Training seed of shard ``shard`` (keyed, so shards start from different weights)."""
    return int(prf_u64(seed, "shard-seed", shard) % (2**31))


def shard_of(ids: Sequence[object], n_shards: int, seed: int) -> np.ndarray:
    """Shard index of each record id (keyed PRF, stable under deletions)."""
    return np.array([prf_u64(seed, "shard", r) % n_shards for r in ids], dtype=np.int64)


@dataclass
class ShardedLOO:
    """One LOO set per shard (None for a shard without records) and, once computed,
    one bound report per shard."""

    n_shards: int
    seed: int
    n_classes: int
    shards: list[LOOSet | None]
    reports: list[BoundReport | None] | None = None

    @property
    def active(self) -> np.ndarray:
        return np.array([s is not None for s in self.shards], dtype=bool)

    def shard_logits(self, X: np.ndarray) -> np.ndarray:
        """Full-network logits per shard, ``(S, n, C)`` (zeros for inactive shards)."""
        X = np.asarray(X, dtype=np.float64)
        out = np.zeros((self.n_shards, len(X), self.n_classes))
        for s, loo in enumerate(self.shards):
            if loo is not None:
                out[s] = loo.logits(X, [0])[0]
        return out

    def shard_betas(self) -> np.ndarray:
        """``(S, C)`` serving bounds (``max(beta, 0)``); +inf where none was computed."""
        betas = np.full((self.n_shards, self.n_classes), np.inf)
        for s, rep in enumerate(self.reports or []):
            if rep is not None:
                sb = rep.serving_beta()
                betas[s] = [sb.get(c, np.inf) for c in range(self.n_classes)]
        return betas

    def vote(self, X: np.ndarray) -> np.ndarray:
        winner, _ = sisa_certain(self.shard_logits(X), np.zeros((self.n_shards, self.n_classes)),
                                 self.active)
        return winner

    def certain(self, X: np.ndarray, rule: str = "sisa") -> tuple[np.ndarray, np.ndarray]:
        """(winner, certain) under ``rule`` = ``"sisa"`` or ``"naive"``."""
        scores = self.shard_logits(X)
        betas = self.shard_betas()
        if rule == "sisa":
            return sisa_certain(scores, betas, self.active)
        if rule == "naive":
            return naive_certain(scores, betas, self.active)
        raise ValueError(f"rule must be 'sisa' or 'naive', not {rule!r}")


def naive_certain(shard_scores: np.ndarray, shard_betas: np.ndarray,
                  active: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Majority vote; certain only if every active shard's margin exceeds its bound."""
    S, n, C = shard_scores.shape
    active = np.ones(S, dtype=bool) if active is None else np.asarray(active, dtype=bool)
    votes = np.zeros((n, C), dtype=np.int64)
    certain = np.ones(n, dtype=bool)
    for s in np.flatnonzero(active):
        labels, margins = top_margin(shard_scores[s])
        np.add.at(votes, (np.arange(n), labels), 1)
        certain &= margins > shard_betas[s][labels]
    return vote_winner(votes), certain


def train_sharded_loo(X: np.ndarray, y: np.ndarray, ids: Sequence[object], *, n_shards: int,
                      seed: int = 0, n_classes: int | None = None,
                      **loo_kwargs: object) -> ShardedLOO:
    """``train_loo`` on each shard's records (same hyper-parameters; seed :func:`shard_seed`)."""
    X = np.asarray(X)
    y = np.asarray(y)
    ids = list(ids)
    C = int(n_classes) if n_classes is not None else int(y.max()) + 1
    shard = shard_of(ids, n_shards, seed)
    shards: list[LOOSet | None] = []
    for s in range(n_shards):
        rows = np.flatnonzero(shard == s)
        if len(rows) == 0:
            shards.append(None)
            continue
        shards.append(train_loo(X[rows], y[rows], [ids[i] for i in rows], n_classes=C,
                                seed=shard_seed(seed, s), **loo_kwargs))
    return ShardedLOO(n_shards, seed, C, shards)


def compute_shard_bounds(sharded: ShardedLOO, time_budget_s: float, solver: str = "highs",
                         **bound_kwargs: object) -> list[BoundReport | None]:
    """:func:`compute_bounds` per shard, ``time_budget_s`` EACH; stored on ``sharded``."""
    reports: list[BoundReport | None] = []
    for loo in sharded.shards:
        reports.append(None if loo is None
                       else compute_bounds(loo, time_budget_s, solver, **bound_kwargs))
    sharded.reports = reports
    return reports


# --------------------------------------------------------------------------- served ensemble


class ShardMismatchError(RuntimeError):
    """The rebuilt LOO set's base network is not the served shard network (bounds for it
    would not be sound for what is served)."""


def ensemble_loo_set(ensemble: SISAEnsemble, s: int, *, chunk_size: int = 512,
                     check: bool = True) -> LOOSet | None:
    """Shard ``s``'s LOO set for a fitted ``schedule="loo"`` :class:`SISAEnsemble`.

    Network 0 is the served shard network; network ``1 + j`` is the shard model
    after deleting ``record_ids[j]`` -- both bit for bit (same device type, torch
    build, CPU capability and thread count). ``None`` for an empty shard.

    The shard trains with ``B = ceil(n_s / batch_size)`` batches (a function of
    its live set), so its single-deletion models use ``B' = ceil((n_s - 1) /
    batch_size)``. When ``B' == B`` one :func:`train_loo` call gives all of them;
    otherwise the LOO networks come from :func:`train_loo` with ``B'`` and network
    0 from :func:`train_single` with ``B`` (``meta["loo_n_batches"]`` records
    ``B'``; ``config.n_batches`` is ``B``). With ``check`` (default), network 0 is
    compared with the served weights and :class:`ShardMismatchError` raised if
    they differ.
    """
    s = int(s)
    ids, X, y = ensemble.shard_records(s)
    if not ids:
        return None
    if ensemble.config_["n_slices"] > 1:
        loo = _sliced_loo_set(ensemble, s, ids, X, y, chunk_size)
    else:
        loo = _one_slice_loo_set(ensemble, s, ids, X, y, chunk_size)
    if check and not loo.full().equal(ensemble.shard_params(s)):
        raise ShardMismatchError(
            f"shard {s}: the rebuilt LOO base network differs from the served shard "
            "network (different platform, thread count or torch build?)")
    return loo


def shard_loo_work(ensemble: SISAEnsemble, s: int) -> float:
    """What :func:`ensemble_loo_set` costs for shard ``s``, in
    :func:`jobs.learners.networks.loo_training.loo_work`
    units (a sliced shard: every stage's records and epochs)."""
    slices = ensemble.shard_slices(s)
    widths = [ensemble.n_features_in_, *ensemble.config_["hidden"], len(ensemble.classes_)]
    work = 0.0
    for r in range(ensemble.config_["n_slices"]):
        n = int((slices <= r).sum())
        if n:
            work += loo_work(n, ensemble.shard_training_args(s, n, stage=r)["epochs"], widths)
    return work


def _one_slice_loo_set(ensemble: SISAEnsemble, s: int, ids: list[str], X: np.ndarray,
                       y: np.ndarray, chunk_size: int) -> LOOSet:
    kw = ensemble.shard_training_args(s)
    kw_loo = ensemble.shard_training_args(s, len(ids) - 1)  # ``init`` as kw's
    classes = ensemble.classes_
    if kw["n_batches"] == kw_loo["n_batches"]:
        loo = train_loo(X, y, ids, chunk_size=chunk_size, classes=classes, **kw)
    else:
        loo = train_loo(X, y, ids, chunk_size=chunk_size, classes=classes, **kw_loo)
        base = train_single(X, y, ids, **kw)
        for W, Wb in zip(loo.weights, base.weights, strict=True):
            W[0] = Wb
        for b, bb in zip(loo.biases, base.biases, strict=True):
            b[0] = bb
        loo.config = replace(loo.config, n_batches=int(kw["n_batches"]))
    loo.meta.update(shard=s, loo_n_batches=int(kw_loo["n_batches"]),
                    ensemble_seed=str(ensemble.seed_))
    return loo


def _sliced_loo_set(ensemble: SISAEnsemble, s: int, ids: list[str], X: np.ndarray,
                    y: np.ndarray, chunk_size: int) -> LOOSet:
    """A sliced shard's LOO set, stage by stage. Deleting x of slice j keeps checkpoints
    0..j-1 and retrains stages j..R-1 without x (and with one live record fewer in each
    stage's batch count), so N_{-x} is the base network up to stage j - 1 and a network of
    its own from there on: every stage trains the base network and, continuing from their
    own checkpoints, the LOO networks of the records of slices 0..r (those of slice r
    start from the base's checkpoint r - 1)."""
    slices = ensemble.shard_slices(s)
    R = ensemble.config_["n_slices"]
    rid = np.asarray(ids)
    base: MLPParams | None = None  # None: the schedule's seeded start (a user's: ``init``)
    own: list[MLPParams | None] = [None] * len(ids)  # None: still the base network
    for r in range(R):
        sel = np.flatnonzero(slices <= r)
        kw = ensemble.shard_training_args(s, len(sel), stage=r)
        base = kw.pop("init", base)
        kw_loo = ensemble.shard_training_args(s, len(sel) - 1, stage=r)
        kw_loo.pop("init", None)
        if len(sel):
            Ws, bs = train_slots(X[sel], y[sel], rid[sel].tolist(), rid[sel].tolist(),
                                 init=[own[j] if slices[j] < r else base for j in sel],
                                 chunk_size=chunk_size, **kw_loo)
            for i, j in enumerate(sel):
                own[j] = MLPParams([W[i] for W in Ws], [b[i] for b in bs])
        base = train_single(X[sel], y[sel], rid[sel].tolist(), init=base, **kw)
    assert base is not None
    nets = [base, *own]
    Ws = [np.stack([n.weights[li] for n in nets]) for li in range(len(base.weights))]
    bs = [np.stack([n.biases[li] for n in nets]) for li in range(len(base.biases))]
    kw = ensemble.shard_training_args(s, len(ids))
    cfg = LOOConfig(n_features=X.shape[1], n_classes=len(ensemble.classes_),
                    hidden=tuple(kw["hidden"]), epochs=kw["epochs"],
                    batch_size=kw["batch_size"], n_batches=kw["n_batches"], lr=kw["lr"],
                    weight_decay=kw["weight_decay"], seed=kw["seed"])
    return LOOSet(cfg, rid, Ws, bs, classes=ensemble.classes_,
                  meta={"shard": s, "n_slices": R, "ensemble_seed": str(ensemble.seed_),
                        "tombstones": kw["tombstones"], "schedule": "sliced"})


def shard_bound_reports(ensemble: SISAEnsemble, shards: Sequence[int] | None = None, *,
                        time_budget_s: float = 60.0, solver: str = "highs",
                        chunk_size: int = 512, **bound_kwargs: Any
                        ) -> dict[int, BoundReport | None]:
    """:func:`compute_bounds` on :func:`ensemble_loo_set` for each listed shard (default:
    all), ``time_budget_s`` EACH. ``None`` for a shard with at most one record: deleting
    its record removes its vote, which the vote rule covers only with ``beta = +inf``."""
    sizes = ensemble.shard_sizes_  # NotFittedError for an unfitted ensemble
    S = len(sizes)
    todo = range(S) if shards is None else sorted({int(s) for s in shards})
    out: dict[int, BoundReport | None] = {}
    for s in todo:
        if not 0 <= s < S:
            raise ValueError(f"shard index {s} out of range 0..{S - 1}")
        if sizes[s] <= 1:
            out[s] = None
            continue
        loo = ensemble_loo_set(ensemble, s, chunk_size=chunk_size)
        assert loo is not None
        out[s] = compute_bounds(loo, time_budget_s, solver, **bound_kwargs)
    return out


@dataclass(frozen=True)
class ShardBounds:
    """Per-shard serving bounds, each tied to the content hash of the shard network whose
    LOO set it was computed on (``networks[s]``, :meth:`SISAEnsemble.shard_hash`; None:
    no bound). They are read only through :meth:`for_ensemble`, which gives ``+inf`` (the
    bound-free vote rule, sound) to a shard whose network is not the one bounded: a bound
    carried over from another state of the ensemble, or onto a network changed since,
    is refused rather than served."""

    networks: tuple[str | None, ...]
    beta: np.ndarray  # (S, C); +inf where networks[s] is None

    @classmethod
    def none(cls, n_shards: int, n_classes: int) -> ShardBounds:
        return cls((None,) * n_shards, np.full((n_shards, n_classes), np.inf))

    def current(self, ensemble: SISAEnsemble) -> np.ndarray:
        """Per shard: whether its bound is the one of the ensemble's shard network now."""
        return np.array([h is not None and h == ensemble.shard_hash(s)
                         for s, h in enumerate(self.networks)], dtype=bool)

    def for_ensemble(self, ensemble: SISAEnsemble) -> np.ndarray:
        """``(S, C)`` bounds for ``sisa_certain(ensemble.shard_logits(X), ...)``."""
        S, C = len(ensemble.shard_sizes_), len(ensemble.classes_)
        if self.beta.shape != (S, C):
            raise ValueError(f"bounds for {self.beta.shape} shards x classes, the ensemble "
                             f"has {(S, C)}")
        return self.masked(self.current(ensemble))

    def masked(self, current: np.ndarray) -> np.ndarray:
        """The bounds with +inf for the shards that are not `current` (:meth:`current`)."""
        return np.where(current[:, None], self.beta, np.inf)


def shard_bounds(ensemble: SISAEnsemble, shards: Sequence[int] | None = None, *,
                 previous: ShardBounds | None = None, time_budget_s: float = 60.0,
                 solver: str = "highs", reports: dict[int, BoundReport | None] | None = None,
                 chunk_size: int = 512, **bound_kwargs: Any) -> ShardBounds:
    """Sound per-shard serving bounds for a fitted ``schedule="loo"`` ensemble.

    Recomputes the listed ``shards`` (default: all) from their own LOO sets (dual
    bounds, ``max(beta, 0)``, ``time_budget_s`` per shard); every other shard keeps its
    bound from ``previous`` where that was computed on the network it has now (after a
    deletion or an addition: every shard but the touched one), else it has none.
    Shards with at most one record get none. ``reports``, when a dict, is filled with
    the :class:`BoundReport` of each recomputed shard (for manifests).
    """
    S, C = len(ensemble.shard_sizes_), len(ensemble.classes_)
    base = ShardBounds.none(S, C) if previous is None else previous
    beta = base.for_ensemble(ensemble).copy()
    keep = base.current(ensemble)
    networks = [h if k else None for h, k in zip(base.networks, keep, strict=True)]
    got = shard_bound_reports(ensemble, shards, time_budget_s=time_budget_s, solver=solver,
                              chunk_size=chunk_size, **bound_kwargs)
    for s, rep in got.items():
        if rep is None:
            beta[s], networks[s] = np.inf, None
        else:
            sb = rep.serving_beta()
            beta[s] = [sb.get(c, np.inf) for c in range(C)]
            networks[s] = ensemble.shard_hash(s)
    if reports is not None:
        reports.update(got)
    return ShardBounds(tuple(networks), beta)


__all__ = ["ShardBounds", "ShardMismatchError", "ShardedLOO", "compute_shard_bounds",
           "ensemble_loo_set", "naive_certain", "shard_bound_reports", "shard_bounds",
           "shard_loo_work", "shard_of", "shard_seed", "train_sharded_loo"]
