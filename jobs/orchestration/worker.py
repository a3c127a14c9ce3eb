"""The background worker: pending ledger requests in, published model versions out.

A pass claims what is pending, applies it, brings the guard up to date and publishes
(:mod:`~jobs.orchestration.update_pass`); when the queue is quiet it checks exactness and
refits guards (:mod:`~jobs.orchestration.guard_pass`), rotates spent seeds
(:mod:`~jobs.orchestration.seed_rotation`) and destroys superseded versions
(:mod:`~jobs.orchestration.retention`). A pass never ends the worker.
See docs/sidecar.md (Worker)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from jobs.adaptive.budget import BudgetPolicy, SeedBudgets
from jobs.orchestration import worker_metrics as metrics
from jobs.orchestration.guard_job import remove_orphaned_job_dirs
from jobs.orchestration.guard_pass import GuardPass
from jobs.orchestration.loaded_version import LoadedVersion, NoVersion
from jobs.orchestration.pass_trouble import PassTrouble
from jobs.orchestration.publisher import Publisher
from jobs.orchestration.registry import PublishConflict, Registry, VersionRefused
from jobs.orchestration.retention import destroy_due, sweep
from jobs.orchestration.seed_rotation import SeedRotation
from jobs.orchestration.served_model import ServedModel
from jobs.orchestration.update_pass import UpdatePass
from ledger.db import single_sqlite_worker
from ledger.store import Ledger

log = logging.getLogger("obliviate.worker")


class RollbackRefused(ValueError):
    """A rollback that would serve deleted records or another training set."""


@dataclass(frozen=True)
class WorkerConfig:
    name: str = f"worker-{socket.gethostname()}"
    batch_window_s: float = 0.1  # after claiming a lone request, wait this long for more
    # the most requests a pass claims: enough that a pass costing a minute or two (a forest
    # guard at 10^6 rows) keeps up with a stream of tens a second; at 1,000 the backlog grew
    # without end there (bench_scale's e2e at 10^6: 1,000 per 121 s pass against 20/s)
    max_batch: int = 10_000
    poll_s: float = 0.1
    lease_s: float = 300.0
    verify_exactness: bool = True
    guard_process: bool = True  # refit the guard in a child process (else a thread)
    guard_after_idle_s: float = 1.0  # start a refit once no request came for this long
    # a stream that never pauses would leave every answer noised: once the current version
    # has owed its guard this long, updates wait for the refit (inf: never wait)
    guard_max_wait_s: float = 60.0
    # an update grows the forest guard's new subtrees for at most this long (the rest are
    # worst-case pairs until the background refit): deletion -> served stays about one
    # update (inf: grow them all before publishing)
    guard_grow_s: float = 0.25
    # the guard job computes each SISA shard's LUCID bound for at most this long (anytime:
    # sound whenever it stops); 0: no bounds, every shard counts as fragile
    shard_bound_s: float = 0.0
    # measure each deletion's privacy (jobs.eval) into its `applied` event: seconds per pass
    evaluate: bool = False
    # versions superseded by a deletion are destroyed this long after it
    # (jobs.orchestration.retention)
    destroy_grace_s: float = 30.0
    # private prediction mode (SISA): every seed lineage gets this budget, and a spent
    # one is replaced by a retrain with fresh seeds (jobs.adaptive.budget)
    budget: BudgetPolicy | None = None
    # after a pass that failed through no request's fault (database, disk, publication)
    # the next waits this long, doubled per failure in a row up to max_backoff_s
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("batch_window_s", "poll_s", "lease_s", "guard_after_idle_s",
                     "guard_max_wait_s", "destroy_grace_s", "guard_grow_s", "shard_bound_s",
                     "backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not value >= 0:  # NaN fails too
                raise ValueError(f"worker setting {name} must be >= 0 seconds, got {value}")
        if self.max_batch < 1:
            raise ValueError(f"worker setting max_batch must be >= 1, got {self.max_batch}")


class Worker:
    """Turns pending requests into verified model versions: the loop that runs the passes,
    which are objects of their own over one loaded version and one publisher."""

    def __init__(self, ledger: Ledger, registry: Registry,
                 config: WorkerConfig | None = None) -> None:
        self.ledger = ledger
        self.registry = registry
        self.config = config or WorkerConfig()
        self.loaded = LoadedVersion(registry)
        budgets = SeedBudgets(ledger.engine, registry.name) if self.config.budget else None
        # every version published starts or stops the guard pass's debt clock
        self.publisher = Publisher(ledger, registry, self.loaded, budgets, self.config.budget,
                                   on_published=lambda man: self.guard.track_debt(man))
        self.guard = GuardPass(ledger, registry, self.loaded, self.publisher, self.config)
        self.updates = UpdatePass(ledger, self.loaded, self.publisher, self.guard, self.config)
        self.seeds = (SeedRotation(ledger, registry, self.loaded, self.publisher, budgets)
                      if budgets is not None else None)
        self.trouble = PassTrouble(self.config.backoff_s, self.config.max_backoff_s)
        self.stop_event = threading.Event()
        self._last_retention = 0.0

    @property
    def busy(self) -> bool:
        """A guard job is computing (its result is published by a later pass)."""
        return self.guard.busy

    # ------------------------------------------------------------------ first version
    def bootstrap(self, kind: str, params: dict[str, Any] | None = None,
                  fit_guard: bool = True) -> str:
        """Train on the ledger's live records and publish the first version (if none).

        Without `fit_guard` the first version is published at once in noise-all mode
        and the guard is refitted in the background like after any update.
        """
        try:
            cur = self.registry.servable_current()
        except VersionRefused as exc:  # a pointer there is: the loop refuses it, and says so
            return exc.version
        if cur is not None:
            return cur.version
        live = self.ledger.records.live()
        if len(live.record_ids) == 0:
            raise RuntimeError("the ledger holds no training records; run `obliviate ledger "
                               "init` first")
        t0 = time.perf_counter()
        model = ServedModel.train(kind, live.record_ids, live.X, live.y, params, fit_guard)
        change = {"op": "train", "n_records": len(live.record_ids),
                  "seconds": time.perf_counter() - t0}
        return self.publisher.publish(model, None, change,
                                      self.publisher.announce("model_trained", change))

    def rollback(self, version: str) -> str:
        """Publish an earlier version again, as the next version; RollbackRefused when that
        would serve deleted records or a model of another training set."""
        try:
            target = self.registry.get(version)
        except KeyError:
            raise RollbackRefused(f"there is no published version {version!r}") from None
        if target.unavailable:
            raise RollbackRefused(f"refused: {target.unavailable}")
        try:
            _, cur = self.loaded.get()
            restored = self.registry.load(version)
        except VersionRefused as exc:
            raise RollbackRefused(f"refused: {exc}") from None
        if cur.version == version:
            raise RollbackRefused(f"{version} is the current version already")
        live = self.ledger.records.live()
        count, root = self.ledger.records.digest(live.record_ids)
        had = target.manifest["training_set"]
        if (had["count"], had["merkle_root"]) != (count, root):
            raise RollbackRefused(
                f"refused: {version} was trained on {had['count']} records, the ledger's "
                f"training set is {count} records now (another set: requests applied since "
                f"{version} would be undone without a ledger record of it)")
        change = {"op": "rollback", "to": version, "from": cur.version}
        return self.publisher.publish(restored, cur.version, change,
                                      self.publisher.announce("rolled_back", change))

    # ------------------------------------------------------------------ loop
    def run(self, max_seconds: float | None = None) -> None:
        """Work until SIGTERM/SIGINT (or `max_seconds`); a pass in progress finishes first."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop_event.set())
        with single_sqlite_worker(self.ledger.url):
            self.warm_up()
            log.info("worker %s started", self.config.name)
            while not self.stop_event.is_set():
                if deadline is not None and time.monotonic() > deadline:
                    break
                self.ledger.heads.maybe_sign()  # an idle tail gets its signed head too
                if not self.step():
                    self.stop_event.wait(self.config.poll_s)
            self.close()
        log.info("worker %s stopped", self.config.name)

    def warm_up(self) -> None:
        """Load the current version and build what its learner's first update would, so
        the first real request does not pay for it (the kernels are compiled at install:
        jobs.orchestration.warm_kernels)."""
        for d in [*remove_orphaned_job_dirs(), *self.registry.store.remove_leftovers()]:
            log.info("removed %s, left by a process that is gone", d)
        if self.guard.process is not None:
            self.guard.process.start()
        try:
            model, _ = self.loaded.get()
        except NoVersion:
            return
        except VersionRefused as exc:  # the loop keeps refusing it, and says so
            self.trouble.refused(exc)
            return
        model.learner.prepare_updates()

    def step(self) -> bool:
        """One pass; False when there was nothing to do, or when it failed.

        A pass never raises. A current version that may not be built on (the pointer
        names one destroyed or never published, or its files are not what was published)
        is refused: nothing is claimed or applied on top of it, an alert gauge is up and
        the log says why, until the pointer names one that loads. Any other error is no
        request's fault (database, disk, a publication that failed): it is logged and
        counted, nothing is marked failed, and the next pass waits a back-off (the
        claims are retaken then). A request the learner cannot apply is quarantined
        instead (:meth:`UpdatePass.apply`)."""
        if self.trouble.waiting():
            return False
        try:
            did = self._pass()
        except VersionRefused as exc:
            self.loaded.forget()
            self.trouble.refused(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - see the docstring: never the worker's end
            self.loaded.forget()
            self.trouble.failed(exc)
            return False
        self.trouble.cleared()
        return did

    def _pass(self) -> bool:
        try:
            self.loaded.get()  # VersionRefused: nothing is built on what the pointer names
        except NoVersion:
            self.trouble.no_version()
            return False
        self.trouble.accepted()
        if self.guard.overdue():
            return self.guard.run(overdue=True)
        if self.guard.check_due() and self.guard.run():
            return True
        # under a steady stream too (at most once a second): were it to wait for a pass
        # without a batch, a model store filled by versions past their grace would fail
        # every publish, so every pass, for ever
        retained = self._retention_pass()
        batch = self.updates.claim()
        if batch:
            self.guard.updated()
            try:
                self.updates.apply(batch)
            except PublishConflict as exc:
                log.info("lost a publication race (%s); retrying on the new version", exc)
                self.loaded.forget()
            except Exception:
                metrics.UPDATE_FAILURES.inc()
                self.loaded.forget()
                raise
            return True
        rotated = self.seeds is not None and self.seeds.run()
        return rotated or self.guard.run() or retained

    def _retention_pass(self) -> bool:
        """At most once a second: destroy the versions a deletion superseded once their
        grace period is over, sweep files no servable version owns, and run the ledger's
        purge maintenance if it is due (a throttled run after the last deletion)."""
        now = time.monotonic()
        if now - self._last_retention < 1.0:
            return False
        self._last_retention = now
        destroyed = destroy_due(self.registry, self.ledger, self.config.destroy_grace_s)
        swept = sweep(self.registry)
        ran = self.ledger.maintenance.run()["ran"]
        return bool(destroyed or swept or ran)

    def close(self) -> None:
        self.guard.close()


def worker_name() -> str:
    """OBLIVIATE_WORKER_NAME, else one per host: a restart on the host retakes its claims."""
    return os.environ.get("OBLIVIATE_WORKER_NAME") or WorkerConfig.name
