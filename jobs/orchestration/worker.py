"""The background worker: pending ledger requests in, published model versions out.

One pass: claim what is pending (after a short batching window), apply it to
the current version's learner, bring its guard up to date, save the result as
a new version, and, in ONE ledger transaction, purge the deleted records,
append `applied` events naming the version and make it current. The service
swaps to it at once. The guard update is bounded in time (``guard_grow_s``):
the forest guard leaves the subtrees it had no time to grow as worst-case
pairs, which is sound and certifies fewer answers, so a deletion is served
within about one update whatever the guard would cost in full. When the queue
is empty the worker checks exactness (retrain from scratch, compare hashes)
and completes such a guard in a separate process, and appends `verified`
(publishing the completed guard as a version of its own if the version is
still current). Should the guard update fail, the version goes out in
noise-all mode (sound) and the background refit publishes its guard.

A version that removed records makes every earlier version unservable in the
same transaction; the idle passes destroy those versions once the grace period
is over (:mod:`jobs.orchestration.retention`) and run the ledger's purge maintenance, which
erases purged rows and destroyed keys from the database's files.

A pass never ends the worker. A request the learner raises on when applied alone is
quarantined: `failed` with the learner's error, the rest of its batch applied. Any other
error (database, disk, a publication) fails no request: it is logged in one line and
counted, and the claims are retried after a back-off. A current version the worker may
not build on (the pointer names one destroyed or never published, or its files are not
what was published) is refused until the pointer is fixed, with an alert and a log line.

Crash safety follows from the order: files are written before the
transaction that publishes them, and requests stay `claimed` (retaken by the
same worker name on restart, or by anyone after the lease) until the version
holding them is current. A version is never current half-written, and a
request is never applied twice: each claimed request belongs to one worker,
and publishing is a compare-and-set on the version it was built from.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection

from jobs.adaptive.budget import BudgetPolicy, SeedBudgets
from jobs.eval import FrozenScores, evaluate_unlearning
from jobs.learners.base import Learner, UpdateReport
from jobs.orchestration import worker_metrics as metrics
from jobs.orchestration.guard_job import (
    GuardJob,
    GuardProcess,
    GuardResult,
    remove_orphaned_job_dirs,
)
from jobs.orchestration.registry import (
    ModelVersion,
    PublishConflict,
    Registry,
    VersionRefused,
    VersionUnavailable,
    first_line,
    manifest,
    manifest_sha256,
    version_tag,
)
from jobs.orchestration.retention import destroy_due, sweep
from jobs.orchestration.served_model import ServedModel, fresh_seed, guard_owed
from jobs.sealing import sealed_with
from ledger.chain import as_utc, utc_now
from ledger.db import single_sqlite_worker
from ledger.models import Request
from ledger.store import Ledger

log = logging.getLogger("obliviate.worker")


class RollbackRefused(ValueError):
    """A rollback that would serve deleted records or another training set."""


class NoVersion(RuntimeError):
    """No model version is published yet: there is nothing to build on."""

Publish = Callable[[Connection], None]
Commit = Callable[[str, dict[str, Any], Publish], None]
Update = tuple[str, np.ndarray]  # ("add" | "delete", record ids): one learner call


@dataclass(frozen=True)
class WorkerConfig:
    name: str = f"worker-{socket.gethostname()}"
    batch_window_s: float = 0.1  # after claiming a lone request, wait this long for more
    max_batch: int = 1000
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
    """Turns pending requests into verified model versions (see the module docstring)."""

    def __init__(self, ledger: Ledger, registry: Registry,
                 config: WorkerConfig | None = None) -> None:
        self.ledger = ledger
        self.registry = registry
        self.config = config or WorkerConfig()
        self._model: ServedModel | None = None
        self._version: ModelVersion | None = None
        self._guard_job: GuardJob | None = None
        self._guard_process = GuardProcess() if self.config.guard_process else None
        self._guard_owed_since: float | None = None  # monotonic time the debt began
        # the requests the running job verifies when its version was published guarded
        # (None: the job refits a noise-all version's guard and publishes it)
        self._check_requests: list[str] | None = None
        self._unverified_since: float | None = None  # monotonic: first unverified apply
        self._check_started = 0.0
        self._last_update = 0.0
        self._last_retention = 0.0
        self.trouble = PassTrouble(self.config.backoff_s, self.config.max_backoff_s)
        self.stop_event = threading.Event()
        self.budgets = SeedBudgets(ledger.engine, registry.name) if self.config.budget else None

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
        return self._publish(model, None, change, self._announce("model_trained", change))

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
            model, cur = self._current()
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
        return self._publish(restored, cur.version, change,
                             self._announce("rolled_back", change))

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
        """Load the current version and run one throwaway deletion on a copy, so the
        first real request does not pay for loading and compiling."""
        for d in [*remove_orphaned_job_dirs(), *self.registry.store.remove_leftovers()]:
            log.info("removed %s, left by a process that is gone", d)
        if self._guard_process is not None:
            self._guard_process.start()
        try:
            model, _ = self._current()
        except NoVersion:
            return
        except VersionRefused as exc:  # the loop keeps refusing it, and says so
            self.trouble.refused(exc)
            return
        spare = copy.deepcopy(model)
        ids = spare.learner.record_ids_
        if len(ids) > 1:
            spare.learner.delete(ids[:1])

    def step(self) -> bool:
        """One pass; False when there was nothing to do, or when it failed.

        A pass never raises. A current version that may not be built on (the pointer
        names one destroyed or never published, or its files are not what was published)
        is refused: nothing is claimed or applied on top of it, an alert gauge is up and
        the log says why, until the pointer names one that loads. Any other error is no
        request's fault (database, disk, a publication that failed): it is logged and
        counted, nothing is marked failed, and the next pass waits a back-off (the
        claims are retaken then). A request the learner cannot apply is quarantined
        instead (:meth:`_isolate`)."""
        if self.trouble.waiting():
            return False
        try:
            did = self._pass()
        except VersionRefused as exc:
            self._model = None
            self.trouble.refused(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - see the docstring: never the worker's end
            self._model = None
            self.trouble.failed(exc)
            return False
        self.trouble.cleared()
        return did

    def _pass(self) -> bool:
        try:
            self._current()  # VersionRefused: nothing is built on what the pointer names
        except NoVersion:
            self.trouble.no_version()
            return False
        self.trouble.accepted()
        if self._guard_overdue():
            return self._guard_pass(overdue=True)
        if self._check_due() and self._guard_pass():
            return True
        batch = self._claim()
        if batch:
            self._last_update = time.monotonic()
            try:
                self._apply(batch)
            except PublishConflict as exc:
                log.info("lost a publication race (%s); retrying on the new version", exc)
                self._model = None
            except Exception:
                metrics.UPDATE_FAILURES.inc()
                self._model = None
                raise
            return True
        return self._rotate_spent_seeds() or self._guard_pass() or self._retention_pass()

    # ------------------------------------------------------------------ apply
    def _claim(self) -> list[Request]:
        cfg = self.config
        batch = self.ledger.lifecycle.claim(cfg.max_batch, cfg.name, cfg.lease_s)
        # wait for company only when this request came alone: a backlog is a batch already
        if len(batch) == 1 and cfg.batch_window_s > 0:
            time.sleep(cfg.batch_window_s)
            batch += self.ledger.lifecycle.claim(cfg.max_batch - len(batch), cfg.name, cfg.lease_s,
                                       retake_own=False)
        return batch

    def _current(self) -> tuple[ServedModel, ModelVersion]:
        """The current version, loaded as published; NoVersion before the first one,
        VersionRefused when it may not be built on."""
        for _ in range(5):
            cur = self.registry.servable_current()
            if cur is None:
                raise NoVersion("no model version is published; run `obliviate model train`")
            if (self._version is not None and self._version.version == cur.version
                    and self._model is not None):
                return self._model, self._version
            try:
                self._model = self.registry.load(cur.version)
            except VersionUnavailable:  # another worker published a deletion meanwhile
                continue
            self._version = cur
            return self._model, self._version
        raise VersionUnavailable(f"the current version {cur.version} cannot be loaded: "
                                 f"{cur.unavailable or 'its files or key are gone'}")

    def _apply(self, batch: list[Request]) -> None:
        model, parent = self._current()
        live = set(model.learner.record_ids_.tolist())
        named = {i for r in batch if r.op == "delete" for i in r.record_ids if i not in live}
        purged = self.ledger.records.purged(sorted(named))
        ok, failed, updates = _plan(batch, live, purged)
        for req, reason in failed:
            self.ledger.lifecycle.mark_failed(req.request_id, reason)
        if not ok:
            return
        data = self._additions(updates)
        deleted = _ids(updates, "delete")
        probe = (EvaluationProbe.capture(self.ledger, model, deleted)
                 if self.config.evaluate and deleted else None)
        t0 = time.perf_counter()
        try:
            reports = _learn(model.learner, updates, data)
        except Exception:  # noqa: BLE001 - some request the learner cannot take: find which
            self._model = None  # maybe half updated: start again from the version's files
            model, parent = self._current()
            model, ok, reports, updates = self._isolate(model, ok, data, purged)
            self._model = model
            if not ok:
                return
            deleted = _ids(updates, "delete")
            probe = None  # captured for deletions of which some may not be applied now
        seconds = time.perf_counter() - t0
        metrics.UPDATE_SECONDS.labels(learner=model.kind).observe(seconds)
        guard = self._update_guard(model, deleted, _ids(updates, "add"),
                                   self.config.guard_grow_s)
        change = {"op": "update", "requests": len(ok), "seconds": seconds,
                  "updates": [r.as_dict() for r in reports], "guard": guard}
        request_ids = [r.request_id for r in ok]
        detail = {"guarantee": model.learner.guarantee, "retrained": _retrained(reports),
                  "update_seconds": round(seconds, 6),
                  "guard_seconds": round(guard["seconds"], 6)}
        if self.config.evaluate and deleted:
            detail["evaluation"] = (
                probe.evaluate(model) if probe is not None else
                {"skipped": "the learner holds out no records: there are no non-members to "
                            "compare the forgotten with"} if model.holdout_ids().size == 0 else
                {"skipped": "the batch was applied part by part (a request in it was "
                            "quarantined)"})

        def commit(version: str, stamp: dict[str, Any], publish: Publish) -> None:
            self.ledger.lifecycle.mark_applied(request_ids, version, {**detail, **stamp},
                                     in_transaction=publish)

        # with no update at all (every record named is gone already) the version is the
        # parent's model again, published so that the requests are verified as usual
        self._publish(model, parent.version, change, commit, removes_records=bool(deleted))
        if self._unverified_since is None:
            self._unverified_since = time.monotonic()
        if deleted:
            self.ledger.maintenance.run()
        now = utc_now()
        for r in ok:
            metrics.APPLIED.labels(op=r.op).inc()
            if r.op == "delete":
                metrics.DELETION_LATENCY.observe((now - as_utc(r.received_at)).total_seconds())

    def _additions(self, updates: Sequence[Update]) -> dict[str, tuple[np.ndarray, int]]:
        """Features and label of each record to add, read before the learner is called: an
        error here is the database's, no request's."""
        ids = _ids(updates, "add")
        if not ids:
            return {}
        X, y = self.ledger.records.data(ids)
        return {i: (X[k], int(y[k])) for k, i in enumerate(ids)}

    def _isolate(self, model: ServedModel, requests: list[Request],
                 data: dict[str, tuple[np.ndarray, int]], purged: set[str]
                 ) -> tuple[ServedModel, list[Request], list[UpdateReport], list[Update]]:
        """The batch's application raised: apply its requests part by part, each part on a
        copy of the model, and halve a part that raises down to the single requests the
        learner cannot take. Those are quarantined (:meth:`_quarantine`); the others are
        applied, in their order. Returns the model with them, the requests, the learner's
        reports and the updates made."""
        ok: list[Request] = []
        reports: list[UpdateReport] = []
        updates: list[Update] = []
        gone = set(purged)  # records no longer in the model: purged, or deleted by a part
        half = len(requests) // 2
        parts = [requests[:half], requests[half:]] if half else [requests]
        while parts:
            part = parts.pop(0)
            fine, failed, todo = _plan(part, set(model.learner.record_ids_.tolist()), gone)
            for req, reason in failed:  # e.g. a deletion of a record a quarantined add named
                self.ledger.lifecycle.mark_failed(req.request_id, reason)
            trial = copy.deepcopy(model)
            try:
                done = _learn(trial.learner, todo, data)
            except Exception as exc:  # noqa: BLE001 - the learner's error: whose?
                if len(fine) == 1:
                    self._quarantine(fine[0], exc)
                else:
                    half = len(fine) // 2
                    parts[:0] = [fine[:half], fine[half:]]
                continue
            model = trial
            ok += fine
            reports += done
            updates += todo
            gone.update(_ids(todo, "delete"))
        return model, ok, reports, updates

    def _quarantine(self, req: Request, exc: Exception) -> None:
        """A request the learner raised on when applied alone: its fault, so it ends `failed`
        with the learner's error as the reason and is never retried; the worker goes on."""
        self.ledger.lifecycle.mark_failed(req.request_id, f"the learner cannot apply it: "
                                                f"{first_line(exc)}")
        metrics.QUARANTINED.labels(op=req.op).inc()
        log.error("quarantined a request (%s) the learner cannot apply (%s): it is failed, "
                  "with the reason in its ledger event; the worker goes on", req.op,
                  type(exc).__name__)

    @staticmethod
    def _update_guard(model: ServedModel, deleted: list[str], added: list[str],
                      grow_seconds: float) -> dict[str, Any]:
        """Bring the guard up to date before the version is published, so that no answer
        waits in noise-all. Should that fail, the version goes out with a stale guard
        (noise-all, sound) and owes a refit, as it would without this step: a deletion is
        never held back by its guard."""
        t0 = time.perf_counter()
        try:
            guard = model.update_guard(deleted, added, grow_seconds)
        except Exception:
            log.exception("updating the guard failed; the version is published in noise-all "
                          "mode and its guard refitted in the background")
            return {**model.guard_record(), "seconds": time.perf_counter() - t0,
                    "error": "update failed"}
        metrics.BOUND_SECONDS.labels(learner=model.kind).observe(guard["seconds"])
        return guard

    # ------------------------------------------------------------------ seed lineages
    def _rotate_spent_seeds(self) -> bool:
        """Private prediction mode: retrain with fresh seeds once the current lineage's
        budget is spent (or when the current version has no lineage: its seeds may have
        been exposed by answers that were not private). A crash before the retrain is
        published leaves the lineage exhausted, so the next pass retrains again."""
        if self.budgets is None:
            return False
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
        model, parent = self._current()
        t0 = time.perf_counter()
        ids = model.learner.record_ids_
        X, y = self.ledger.records.data(ids.tolist())
        params = {**model.params(), "random_state": fresh_seed()}
        fresh = ServedModel.train(model.kind, ids, X, y, params)
        change = {"op": "retrain", "reason": reason, "n_records": len(ids),
                  "seconds": time.perf_counter() - t0}
        log.info("seeds rotated (%s); retrained in %.2f s", reason["why"], change["seconds"])
        try:
            self._publish(fresh, parent.version, change, self._announce("seeds_rotated", change))
        except PublishConflict:
            self._model = None
            return True
        self._model = fresh
        return True

    # ------------------------------------------------------------------ guard and verify
    @property
    def busy(self) -> bool:
        """A guard job is computing (its result is published by a later pass)."""
        return self._guard_job is not None

    def _check_due(self) -> bool:
        """Under a stream with no pause the guard pass must still run between claims: to
        collect a finished job, or to start the check requests have waited too long for."""
        if self._guard_job is not None:
            return self._guard_job.done()
        since = self._unverified_since
        return since is not None and time.monotonic() - since >= self.config.guard_max_wait_s

    def _guard_overdue(self) -> bool:
        since = self._guard_owed_since
        return since is not None and time.monotonic() - since >= self.config.guard_max_wait_s

    def _track_guard_debt(self, man: dict[str, Any]) -> None:
        """Start the clock when the current version owes a guard refit; stop it when not."""
        if not guard_owed(man):
            self._guard_owed_since = None
        elif self._guard_owed_since is None:
            self._guard_owed_since = time.monotonic()

    def _guard_pass(self, overdue: bool = False) -> bool:
        """Start, or finish, the exactness check (and, for a version published without
        its guard, the guard refit) off the update path.

        It can take seconds (a retrain from scratch), so it runs in a separate process
        while updates keep flowing, on the current version. A version published with
        its guard up to date (the usual case) only owes the check: the job then verifies
        the requests applied when it started, on that version, even if newer versions
        were published meanwhile (they are in it). It starts when no request came for
        ``guard_after_idle_s``, or under a stream with no pause once requests have
        waited ``guard_max_wait_s`` for it. A version published without its guard
        (noise-all: the guard update failed) owes the refit too: its result is
        published only if that version is still current (otherwise it is stale and
        dropped), and once it has owed one for ``guard_max_wait_s`` (``overdue``) the
        refit starts at once and no request is claimed until it is published. A version
        this step published is not re-verified: if its exactness check failed, its
        requests stay `applied` and the failure is counted.
        """
        cur = self.registry.current()
        if cur is None:
            return False
        self._track_guard_debt(cur.manifest)  # another worker may have paid it
        overdue = overdue and self._guard_overdue()
        job = self._guard_job
        if job is not None:
            if job.version != cur.version and self._check_requests is None:
                log.info("guard for %s is stale (current %s); cancelled", job.version,
                         cur.version)
                job.cancel()
                self._guard_job = None
                return True
            if not job.done():
                return False
            self._guard_job = None
            self._finish_guard(job)
            return True
        now = time.monotonic()
        due = (overdue or now - self._last_update >= self.config.guard_after_idle_s
               or (self._unverified_since is not None
                   and now - self._unverified_since >= self.config.guard_max_wait_s))
        # a version the guard job published is not checked again, unless what it carried
        # over left it coarse (per-shard bounds of some shards only)
        if not due or (cur.manifest["change"]["op"] == "guard"
                       and not self._refinable(cur.manifest["guard"])):
            return False
        applied = [r.request_id for r in self.ledger.lifecycle.requests_with_status("applied")]
        if self.registry.current().version != cur.version:
            return True  # published meanwhile: the requests read may not be in `cur`
        if (not applied and not guard_owed(cur.manifest)
                and not self._refinable(cur.manifest["guard"])):
            self._unverified_since = None
            return False
        self._check_requests = None if guard_owed(cur.manifest) else applied
        self._check_started = now
        self._guard_job = GuardJob(cur.version, self.registry.path(cur.version),
                                   self.registry.key(cur.version),
                                   self.registry.vouched_manifest(cur),
                                   self.config.verify_exactness, self._guard_process,
                                   self.config.shard_bound_s)
        return True

    def _refinable(self, guard: dict[str, Any]) -> bool:
        """A coarse guard that the guard job would make finer with this configuration."""
        return _guard_coarse(guard) and (guard["rule"] not in ("sisa-vote", "lucid")
                                         or self.config.shard_bound_s > 0)

    def _finish_guard(self, job: GuardJob) -> None:
        try:
            result = job.result()
        except RuntimeError as exc:
            metrics.UPDATE_FAILURES.inc()
            log.error("refitting the guard for %s failed; it is retried:\n%s", job.version, exc)
            job.discard()
            self._guard_owed_since = time.monotonic()  # updates flow again meanwhile
            return
        check = result.check
        # an approximate learner is not retrain-identical by design: its check measures
        # the gap to a retrain, which the `verified` event records
        failed = bool(check) and check.get("guarantee") == "exact" and not check["exact"]
        if failed:
            metrics.VERIFY_FAILURES.inc()
            log.error("exactness check failed for %s: %s != %s", job.version,
                      check["served_hash"], check["retrained_hash"])
        in_place, self._check_requests = self._check_requests, None
        cur = self.registry.current()
        refined = (cur is not None and cur.version == job.version
                   and _guard_coarse(cur.manifest["guard"]) and result.guard["ready"]
                   and not _guard_coarse(result.guard))
        # published with its guard: only the check was owed (or the version it completed
        # a coarse guard for is no longer current)
        if in_place is not None and not refined:
            self._carry_guard(job, result, cur)
            job.discard()
            if in_place and not failed:
                self.ledger.lifecycle.mark_verified(in_place, job.version, {
                    "guard": result.guard, "exactness": check, "in_place": True},
                    skip_settled=True)
            # requests applied while the check ran have waited since it started, at most
            self._unverified_since = (self._check_started if self.ledger.lifecycle
                                      .requests_with_status("applied") else None)
            return
        model, parent = self._current()
        with sealed_with(self.registry.key(parent.version)):
            model.load_guard(result.guard_dir)
        job.discard()
        metrics.BOUND_SECONDS.labels(learner=model.kind).observe(result.guard["seconds"])
        applied = self.ledger.lifecycle.requests_with_status("applied")
        change = {"op": "guard", "guard": result.guard, "exactness": check,
                  "requests": len(applied)}
        request_ids = [r.request_id for r in applied]
        if request_ids and not failed:
            detail = {"guard": result.guard, "exactness": check}

            def commit(version: str, stamp: dict[str, Any], publish: Publish) -> None:
                self.ledger.lifecycle.mark_verified(request_ids, version, {**detail, **stamp},
                                          in_transaction=publish)
        else:
            commit = self._announce("guard_refreshed", change)
        try:
            self._publish(model, parent.version, change, commit)
        except PublishConflict:
            self._model = None
            return
        if request_ids and not failed:
            self._unverified_since = None

    def _carry_guard(self, job: GuardJob, result: GuardResult, cur: ModelVersion | None
                     ) -> None:
        """A job's guard state that makes the current version's guard finer without being
        complete, or that was computed for a superseded version but still holds for the
        current one (SISA: the bounds of shards no update has retrained since): publish
        it with the current version, so that bounds arrive one job at a time, during a
        stream too."""
        if cur is None or not self._refinable(cur.manifest["guard"]):
            return
        try:
            key = self.registry.key(job.version)
        except VersionUnavailable:  # destroyed meanwhile: its files no longer open
            return
        model, parent = self._current()
        with sealed_with(key):
            finer = model.adopt_guard(result.guard_dir)
        if not finer:
            return
        guard = {**model.guard_record(), "seconds": result.guard["seconds"]}
        if job.version != cur.version:
            guard["carried_from"] = job.version
        change = {"op": "guard", "guard": guard, "requests": 0}
        try:
            self._publish(model, parent.version, change,
                          self._announce("guard_refreshed", change))
        except PublishConflict:
            self._model = None

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
        if self._guard_process is not None:
            self._guard_process.close()  # ends a job in hand too
        if self._guard_job is not None:
            self._guard_job.cancel()
            self._guard_job = None

    # ------------------------------------------------------------------ publish
    def _publish(self, model: ServedModel, parent: str | None, change: dict[str, Any],
                 commit: Commit, removes_records: bool = False) -> str:
        """Save `model` as the next version, then let `commit` write the ledger events
        (with `stamp`, the manifest's digest, in their payload, so the ledger vouches for
        the manifest) and call `publish(conn)` inside that same transaction
        (`removes_records`: it deleted records, so every earlier version is to be
        destroyed)."""
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
                self.budgets.open(conn, version, self.config.budget)

        try:
            commit(version, {"manifest_sha256": manifest_sha256(man)}, publish)
        except PublishConflict:
            self.registry.discard_unpublished(version)
            raise
        self._version = self.registry.get(version)
        self._track_guard_debt(man)
        log.info("published %s (%s; saved in %.3f s, committed in %.3f s)", version,
                 change["op"], t1 - t0, time.perf_counter() - t1)
        return version

    def _announce(self, kind: str, change: dict[str, Any]) -> Commit:
        """A commit that records the publication as a ledger event of its own."""
        def commit(version: str, stamp: dict[str, Any], publish: Publish) -> None:
            self.ledger.events.append(kind, {"change": change, **stamp}, version,
                                     in_transaction=publish)
        return commit


class PassTrouble:
    """What went wrong in the worker's latest passes, and what it says about it: the
    back-off after passes that failed through no request's fault (logged in one line,
    counted), and a current version it refuses to build on (an alert gauge, and one log
    line per reason saying what the pointer names and why)."""

    def __init__(self, backoff_s: float, max_backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.in_a_row = 0
        self.retry_at = 0.0  # monotonic: no pass before then
        self.refusal: str | None = None  # why the current version is refused, while it is
        self._idle_said = False

    def waiting(self) -> bool:
        return time.monotonic() < self.retry_at

    def _back_off(self) -> float:
        self.in_a_row += 1
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.in_a_row - 1))
        self.retry_at = time.monotonic() + delay
        return delay

    def failed(self, exc: Exception) -> None:
        metrics.PASS_ERRORS.inc()
        delay = self._back_off()
        # one line (the traceback at DEBUG): a message's later lines may hold ids (SQL
        # parameters), which no log line at INFO or above carries
        log.error("a worker pass failed (%d in a row), through no request's fault: %s; "
                  "nothing is marked failed, the claims are retried in %.1f s",
                  self.in_a_row, first_line(exc), delay)
        log.debug("the failed pass", exc_info=exc)

    def refused(self, exc: VersionRefused) -> None:
        metrics.POINTER_REFUSED.set(1)
        self._back_off()
        if str(exc) != self.refusal:
            self.refusal = str(exc)
            log.error("refusing to build on the current version: %s. No request is applied "
                      "on top of it until the pointer names a version that loads as "
                      "published; run `obliviate ledger verify`", exc)

    def accepted(self) -> None:
        """The current version may be built on."""
        metrics.POINTER_REFUSED.set(0)
        if self.refusal is not None:
            log.info("the current version loads as published again; requests flow")
            self.refusal = None
        self._idle_said = False

    def no_version(self) -> None:
        metrics.POINTER_REFUSED.set(0)
        if not self._idle_said:
            log.info("no model version is published yet: requests wait for the first one "
                     "(`obliviate model train`, or `obliviate worker --train`)")
            self._idle_said = True

    def cleared(self) -> None:
        """A pass went through."""
        self.in_a_row = 0


def _guard_coarse(guard: dict[str, Any]) -> bool:
    """A guard record (as in a manifest) that is sound but that an update ran out of time
    refining: a refit certifies more answers (not one whose LOO set the guard job will not
    train: `skipped`)."""
    bound = guard.get("bound") or {}
    return bool(guard["ready"]) and bound.get("complete") is False and not bound.get("skipped")


@dataclass
class EvaluationProbe:
    """What :func:`jobs.eval.evaluate_unlearning` needs about one deletion, read before it
    is applied (the raw records are purged when it is published): the forgotten, the
    retained and the held-out records, and the model's scores on them as it was."""

    X: dict[str, np.ndarray]
    y: dict[str, np.ndarray]
    before: FrozenScores

    @classmethod
    def capture(cls, ledger: Ledger, model: ServedModel, deleted: Sequence[str]
                ) -> EvaluationProbe | None:
        """None when the model holds out no records (nothing unseen to compare with)."""
        held = set(model.holdout_ids().tolist())
        if not held:
            return None
        live = ledger.records.live()
        gone = set(deleted)
        where = {"forget": [r in gone for r in live.record_ids],
                 "test": [r in held and r not in gone for r in live.record_ids],
                 "retain": [r not in held and r not in gone for r in live.record_ids]}
        X = {k: live.X[np.array(m, dtype=bool)] for k, m in where.items()}
        y = {k: live.y[np.array(m, dtype=bool)] for k, m in where.items()}
        return cls(X, y, FrozenScores(model.learner, *X.values()))

    def evaluate(self, model: ServedModel) -> dict[str, float]:
        """The updated model against its state before (frozen attacker included)."""
        t0 = time.perf_counter()
        out = evaluate_unlearning(
            model.learner, X_retain=self.X["retain"], y_retain=self.y["retain"],
            X_forget=self.X["forget"], y_forget=self.y["forget"], X_test=self.X["test"],
            y_test=self.y["test"], original=self.before)
        out = {k: round(v, 6) if math.isfinite(v) else None for k, v in out.items()}
        out["seconds"] = round(time.perf_counter() - t0, 6)
        return out


def _plan(batch: Sequence[Request], live: set[str], purged: set[str]
          ) -> tuple[list[Request], list[tuple[Request, str]], list[Update]]:
    """The requests the model can apply, the rest with the reason, and the learner calls
    that apply them: the record ids to add, then those to delete (one call each).

    A deletion naming a record that is gone already -- purged by an earlier request,
    or deleted by one before it in this batch (both were accepted while the record
    was live) -- is still applied to the records it names that remain: the record
    is gone, as asked. Additions go first; that is the arrival order's result too,
    since an addition names only new record ids, which no deletion before it can
    have named.
    """
    ok: list[Request] = []
    failed: list[tuple[Request, str]] = []
    held = set(live)
    add: list[str] = []
    delete: list[str] = []
    for r in sorted(batch, key=lambda q: q.op != "add"):
        ids = list(r.record_ids)
        if r.op == "delete":
            missing = [i for i in ids if i not in held and i not in live and i not in purged]
            if missing:
                failed.append((r, f"record {missing[0]!r} is not in the model"))
                continue
            remaining = [i for i in ids if i in held]
            held.difference_update(remaining)
            delete += remaining
        else:
            clash = [i for i in ids if i in held]
            if clash:
                failed.append((r, f"record {clash[0]!r} is already in the model"))
                continue
            held.update(ids)
            add += ids
        ok.append(r)
    updates = [(op, np.array(ids, dtype=object)) for op, ids in (("add", add),
                                                                 ("delete", delete)) if ids]
    return ok, failed, updates


def _ids(updates: Sequence[Update], op: str) -> list[str]:
    return [i for o, ids in updates if o == op for i in ids.tolist()]


def _learn(learner: Learner, updates: Sequence[Update],
           data: dict[str, tuple[np.ndarray, int]]) -> list[UpdateReport]:
    """The learner's calls that apply `updates`: the only errors that are a request's fault."""
    reports = []
    for op, ids in updates:
        if op == "delete":
            reports.append(learner.delete(ids))
        else:
            X = np.array([data[i][0] for i in ids.tolist()], dtype=np.float64)
            reports.append(learner.add(ids, X, np.array([data[i][1] for i in ids.tolist()])))
    return reports


def _retrained(reports: Sequence[UpdateReport]) -> dict[str, Any]:
    return {"records": sum(len(r.record_ids) for r in reports),
            "detail": [r.retrained for r in reports]}


def worker_name() -> str:
    """OBLIVIATE_WORKER_NAME, else one per host: a restart on the host retakes its claims."""
    return os.environ.get("OBLIVIATE_WORKER_NAME") or WorkerConfig.name
