"""What a batch of deletions is estimated to cost, incrementally or as a refit, so that
a batch never costs more than a retrain (up to the estimate). Not part of the model: the
estimate steers how an update is computed, never what it computes.
See docs/learners.md (DaRE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchPolicy:
    """How a batch deletion chooses between the incremental path and a refit."""

    #: refit when that is estimated to be cheaper (:meth:`CostModel.estimate`); without
    #: the estimate (False), when the batch is larger than refit_fraction of the records
    choose_by_cost: bool = True
    refit_fraction: float = 0.25
    #: costs in units of build work (one record through one level of the builder): a node
    #: on a deletion's path costs 10-100 units, 20-45 on most tables (implied by timing
    #: batches of 1-1,000 deletions against a refit on tables of 1,400-26,000 records,
    #: distinct and tied, 2-10 classes, 14-64 features, d_rmax 0-3; the kernel is bound
    #: by memory, the builder by the data), a deleted record about 1,000 more (the Python
    #: around it). 100 had batches of 120 at 16k records refit in twice the time of the
    #: incremental path
    node_units: float = 50.0
    record_units: float = 1000.0
    #: share of the forest's build work one deletion retrains, until measured, and the
    #: weight of the newest measurement in its running average
    prior_rho: float = 0.005
    ema: float = 0.2
    #: batches of at least this many deletions learn and use a share of their own
    batch_min: int = 8


@dataclass
class CostModel:
    """The forest's build work at its last fit and what deletions were measured to
    retrain since (rho: a single deletion's share of the build work; rho_batch: a
    batch's, per deletion)."""

    policy: BatchPolicy
    n_trees: int
    work: int  # build work of the last fit
    n: int  # records at the last fit
    rho: float | None = None
    rho_batch: float | None = None

    def refitted(self, work: int, n: int) -> CostModel:
        """The model after a refit: its work, the shares deletions were measured to
        retrain (a refit learns nothing about them, and does not forget them)."""
        return CostModel(self.policy, self.n_trees, work, n, self.rho, self.rho_batch)

    def _rho_key(self, m: int) -> str:
        """Which learned share a batch of m deletions reads and updates (see estimate)."""
        return "rho_batch" if m >= self.policy.batch_min else "rho"

    def estimate(self, m: int, n_live: int) -> tuple[float, float]:
        """Estimated cost of deleting m of n_live records (incremental, refit), in units
        of build work (records x levels). Deterministic: it depends on the forest and
        its update history only.

        Refit: the forest's build work scaled to the records that stay. Incremental: per
        record, the nodes on its paths (node_units each) and a fixed part; plus the
        build work the batch retrains: one deletion retrains a share rho of the forest's
        work (measured, a running average), a batch of m the union of m such shares,
        1 - (1 - rho)^m of it, as each changed subtree is retrained once. Batches learn
        their own rho: single deletions retrain rarely but much (a near-tie high in a
        tree flips), and a batch retrains what its deletions changed in sum, so the
        singles' rho had batches of 150 at 16k records estimated at twice the work they
        retrained (and refit, which learns nothing, for good)."""
        pol = self.policy
        n = max(int(n_live), 1)
        work = self.work * n / max(self.n, 1)
        path_len = self.work / max(self.n * self.n_trees, 1)  # nodes a record passes, per tree
        rho = next((r for r in (getattr(self, self._rho_key(m)), self.rho) if r is not None),
                   pol.prior_rho)
        refit = work * (n - m) / n
        per = self.n_trees * path_len * pol.node_units + pol.record_units
        incr = m * per + work * (1.0 - (1.0 - rho) ** m)
        return incr, refit

    def plan(self, m: int, n_live: int) -> tuple[bool, dict[str, Any]]:
        """Whether a batch of m deletions refits, and what the report says of the choice.

        A refit learns nothing about what batches retrain: the first batch goes
        incremental unless that is estimated at more than twice a refit, so that a prior
        that is too high is not kept for good."""
        pol = self.policy
        incr, refit = self.estimate(m, n_live)
        said: dict[str, Any] = {"cost_incremental": round(incr), "cost_refit": round(refit)}
        if (pol.choose_by_cost and m >= pol.batch_min and self.rho_batch is None
                and refit < incr <= 2 * refit):
            said["measuring"] = True
            return False, said
        if pol.choose_by_cost:
            return incr > refit, said
        return m > pol.refit_fraction * n_live, said

    def learn(self, m: int, work: int, n_live: int) -> None:
        """Fold the build work an incremental deletion of m records retrained (leaving
        n_live) into the running estimate of the share one deletion retrains."""
        total = self.work * max(int(n_live), 1) / max(self.n, 1)
        share = min(work / max(total, 1.0), 0.999)
        rho = 1.0 - (1.0 - share) ** (1.0 / m)
        key = self._rho_key(m)
        old = getattr(self, key)
        setattr(self, key, rho if old is None else (1 - self.policy.ema) * old
                + self.policy.ema * rho)
