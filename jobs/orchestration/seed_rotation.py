"""Private prediction mode's retrain with fresh seeds, once a seed lineage's budget is spent.

Answers in private mode are differentially private in the shard seeds, under a budget per
seed lineage; a spent budget makes the worker retrain on the same records with fresh seeds,
which starts a new lineage. See docs/guard.md#private-prediction-mode.
"""

from __future__ import annotations

import logging
import time

from jobs.adaptive.budget import SeedBudgets
from jobs.orchestration.loaded_version import LoadedVersion
from jobs.orchestration.publisher import Publisher
from jobs.orchestration.registry import PublishConflict, Registry
from jobs.orchestration.served_model import ServedModel, fresh_seed
from ledger.store import Ledger

log = logging.getLogger("obliviate.worker")


class SeedRotation:
    """Retrains the current version with fresh seeds when its lineage's budget is spent."""

    def __init__(self, ledger: Ledger, registry: Registry, loaded: LoadedVersion,
                 publisher: Publisher, budgets: SeedBudgets) -> None:
        self.ledger, self.registry, self.loaded = ledger, registry, loaded
        self.publisher, self.budgets = publisher, budgets

    def run(self) -> bool:
        """Retrain with fresh seeds once the current lineage's budget is spent (or when the
        current version has no lineage: its seeds may have been exposed by answers that
        were not private). A crash before the retrain is published leaves the lineage
        exhausted, so the next pass retrains again."""
        cur = self.registry.current()
        if cur is None:
            return False
        lineage = cur.manifest.get("seed_lineage")
        budget = self.budgets.get(lineage) if lineage else None
        if budget is not None and not budget.exhausted:
            return False
        if budget is None:
            reason = {"why": "no seed lineage: private prediction mode starts on fresh seeds"}
        else:
            reason = {"why": "privacy budget of the seeds spent", "lineage": lineage,
                      "answers": budget.answers_reserved,
                      "epsilon_spent": budget.epsilon_spent,
                      "epsilon_budget": budget.epsilon_budget, "delta": budget.delta}
        model, parent = self.loaded.get()
        t0 = time.perf_counter()
        ids = model.learner.record_ids_
        X, y = self.ledger.records.data(ids.tolist())
        params = {**model.params(), "random_state": fresh_seed()}
        fresh = ServedModel.train(model.kind, ids, X, y, params)
        change = {"op": "retrain", "reason": reason, "n_records": len(ids),
                  "seconds": time.perf_counter() - t0}
        log.info("seeds rotated (%s); retrained in %.2f s", reason["why"], change["seconds"])
        try:
            self.publisher.publish(fresh, parent.version, change,
                                   self.publisher.announce("seeds_rotated", change))
        except PublishConflict:
            self.loaded.forget()
        return True
