"""Per-shard LOO sets and bounds for a sharded MLP ensemble, and its certainty rules.

The ensemble: ``S`` shards, record ``r`` in shard ``prf_u64(seed, "shard", r) % S``
(as :mod:`jobs.learners.sisa` assigns shards); shard ``s``'s model is the full
network of :func:`jobs.idp.loo.train_loo` on the shard's records, so the same
call also gives every single-deletion model of that shard. The ensemble
answers the majority vote of the shards' labels (ties to the lowest class).
NOTE: this is a one-slice ensemble trained with the LOO schedule, not the
sliced :class:`jobs.learners.sisa.SISAEnsemble`; it is what the bound needs.

Deleting a record changes one shard's network only (to that shard's N_{-x}),
so with per-shard bounds ``beta[s, c]`` (:func:`jobs.idp.bab.compute_bounds` on
each shard's LOO set) two rules say when a vote is certain (0-iDP):

* :func:`jobs.idp.guard.sisa_certain` (DESIGN.md "Beyond LUCID, for SISA"):
  certain iff no single fragile shard (margin <= its bound), moving its vote
  anywhere, changes the winner;
* the naive rule (:func:`naive_certain`): certain only if EVERY shard is above
  its bound -- what one would do treating the ensemble as one network whose
  every part must be stable.

Both are sound; the SISA rule answers more queries without noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jobs.idp.bab import BoundReport, compute_bounds
from jobs.idp.guard import sisa_certain, top_margin, vote_winner
from jobs.idp.loo import LOOSet, train_loo
from jobs.learners.keyed import prf_u64


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


__all__ = ["ShardedLOO", "compute_shard_bounds", "naive_certain", "shard_of", "shard_seed",
           "train_sharded_loo"]
