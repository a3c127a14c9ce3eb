"""Publishing a model version: files first, then one ledger transaction that records
the events and moves the pointer.

The order is what makes a crash safe: a version is never current half-written, and the
events that announce it carry its manifest's digest, so the ledger vouches for the
manifest. See docs/sidecar.md#crash-safety.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from jobs.adaptive.budget import BudgetPolicy, SeedBudgets
from jobs.orchestration.loaded_version import LoadedVersion
from jobs.orchestration.registry import (
    PublishConflict,
    Registry,
    manifest,
    manifest_sha256,
    version_tag,
)
from jobs.orchestration.served_model import ServedModel
from ledger.store import Ledger

log = logging.getLogger("obliviate.worker")

Publish = Callable[[Connection], None]
# commit(version, stamp, publish): write the ledger events (with `stamp` in their
# payload) and call publish(conn) in the same transaction
Commit = Callable[[str, dict[str, Any], Publish], None]


class Publisher:
    """Saves versions and publishes them through a ledger transaction."""

    def __init__(self, ledger: Ledger, registry: Registry, loaded: LoadedVersion,
                 budgets: SeedBudgets | None, budget: BudgetPolicy | None,
                 on_published: Callable[[dict[str, Any]], None]) -> None:
        """`on_published(manifest)` learns of each version this worker publishes."""
        self.ledger, self.registry, self.loaded = ledger, registry, loaded
        self.budgets, self.budget = budgets, budget
        self.on_published = on_published

    def publish(self, model: ServedModel, parent: str | None, change: dict[str, Any],
                commit: Commit, removes_records: bool = False) -> str:
        """Save `model` as the next version, then let `commit` write the ledger events
        (with `stamp`, the manifest's digest, in their payload) and call `publish(conn)`
        inside that same transaction (`removes_records`: it deleted records, so every
        earlier version is to be destroyed). PublishConflict when another worker moved
        the pointer first (the saved files are discarded)."""
        t0 = time.perf_counter()
        seq = self.registry.allocate_seq()
        man = manifest(model, seq=seq, parent=parent, ledger_seq=self.ledger.events.last_seq(),
                       training_set=self.ledger.records.digest(model.learner.record_ids_),
                       change=change)
        # a full training draws new seeds: it starts a seed lineage, updates keep theirs
        fresh_seeds = change["op"] in ("train", "retrain")
        man["seed_lineage"] = (version_tag(seq) if fresh_seeds or parent is None
                               else self.registry.get(parent).manifest.get("seed_lineage"))
        version = self.registry.save(model, seq, man)
        t1 = time.perf_counter()

        def publish(conn: Connection) -> None:
            self.registry.publish(conn, version, seq, parent, man, removes_records)
            if self.budgets is not None and fresh_seeds:
                self.budgets.open(conn, version, self.budget)

        try:
            commit(version, {"manifest_sha256": manifest_sha256(man)}, publish)
        except PublishConflict:
            self.registry.discard_unpublished(version)
            raise
        self.loaded.published(model, version)
        self.on_published(man)
        log.info("published %s (%s; saved in %.3f s, committed in %.3f s)", version,
                 change["op"], t1 - t0, time.perf_counter() - t1)
        return version

    def announce(self, kind: str, change: dict[str, Any]) -> Commit:
        """A commit that records the publication as a ledger event of its own."""
        def commit(version: str, stamp: dict[str, Any], publish: Publish) -> None:
            self.ledger.events.append(kind, {"change": change, **stamp}, version,
                                      in_transaction=publish)
        return commit
