"""The worker's guard pass: the exactness check, and the guard refits, off the update path.

A check retrains from scratch (seconds), so it runs in a background job while updates keep
flowing, and the requests it covers are marked `verified` when it matches. A version
published without its guard (noise-all: the guard update failed), or with a guard an update
ran out of time refining, gets its guard refitted and published as a version of its own.
See docs/sidecar.md#the-guard-job-exactness-checks-and-refits.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from jobs.orchestration import worker_metrics as metrics
from jobs.orchestration.guard_job import GuardJob, GuardProcess, GuardResult
from jobs.orchestration.loaded_version import LoadedVersion
from jobs.orchestration.publisher import Publish, Publisher
from jobs.orchestration.registry import (
    ModelVersion,
    PublishConflict,
    Registry,
    VersionUnavailable,
)
from jobs.orchestration.served_model import ServedModel, exact_owed, guard_owed
from jobs.sealing import sealed_with
from ledger.store import Ledger

log = logging.getLogger("obliviate.worker")


class GuardPass:
    """The guard job in hand and the clocks that decide when the next one starts."""

    def __init__(self, ledger: Ledger, registry: Registry, loaded: LoadedVersion,
                 publisher: Publisher, config: Any) -> None:
        """`config` is the worker's (:class:`jobs.orchestration.worker.WorkerConfig`)."""
        self.ledger, self.registry, self.loaded = ledger, registry, loaded
        self.publisher, self.config = publisher, config
        self.process = GuardProcess() if config.guard_process else None
        self.job: GuardJob | None = None
        self.owed_since: float | None = None  # monotonic time the guard debt began
        # the requests the running job verifies when its version was published guarded
        # (None: the job refits a noise-all version's guard and publishes it)
        self.check_requests: list[str] | None = None
        self.unverified_since: float | None = None  # monotonic: first unverified apply
        self.check_started = 0.0
        self.last_update = 0.0  # monotonic: when the latest batch was claimed

    # ------------------------------------------------------------------ what the worker asks
    @property
    def busy(self) -> bool:
        """A guard job is computing (its result is published by a later pass)."""
        return self.job is not None

    def check_due(self) -> bool:
        """Under a stream with no pause the guard pass must still run between claims: to
        collect a finished job, or to start the check requests have waited too long for."""
        if self.job is not None:
            return self.job.done()
        since = self.unverified_since
        return since is not None and time.monotonic() - since >= self.config.guard_max_wait_s

    def overdue(self) -> bool:
        since = self.owed_since
        return since is not None and time.monotonic() - since >= self.config.guard_max_wait_s

    def track_debt(self, man: dict[str, Any]) -> None:
        """Start the clock when the current version owes a guard refit; stop it when not."""
        if not guard_owed(man):
            self.owed_since = None
        elif self.owed_since is None:
            self.owed_since = time.monotonic()

    def updated(self) -> None:
        """A batch was claimed (the guard waits for a pause)."""
        self.last_update = time.monotonic()

    def applied(self) -> None:
        """A version with requests to verify was published."""
        if self.unverified_since is None:
            self.unverified_since = time.monotonic()

    def close(self) -> None:
        if self.process is not None:
            self.process.close()  # ends a job in hand too
        if self.job is not None:
            self.job.cancel()
            self.job = None

    # ------------------------------------------------------------------ the pass
    def run(self, overdue: bool = False) -> bool:
        """Start, or finish, the exactness check (and, for a version published without
        its guard, the guard refit) off the update path.

        A version published with its guard up to date (the usual case) only owes the
        check: the job then verifies the requests applied when it started, on that
        version, even if newer versions were published meanwhile (they are in it). It
        starts when no request came for ``guard_after_idle_s``, or under a stream with no
        pause once requests have waited ``guard_max_wait_s`` for it. A version published
        without its guard owes the refit too: its result is published only if that
        version is still current (otherwise it is stale and dropped), and once it has
        owed one for ``guard_max_wait_s`` (``overdue``) the refit starts at once and no
        request is claimed until it is published. A version this pass published is not
        re-verified: if its exactness check failed, its requests stay `applied` and the
        failure is counted."""
        cur = self.registry.current()
        if cur is None:
            return False
        self.track_debt(cur.manifest)  # another worker may have paid it
        overdue = overdue and self.overdue()
        if self.job is not None:
            return self._collect(cur)
        now = time.monotonic()
        due = (overdue or now - self.last_update >= self.config.guard_after_idle_s
               or (self.unverified_since is not None
                   and now - self.unverified_since >= self.config.guard_max_wait_s))
        # a version the guard job published is not checked again, unless what it carried
        # over left it coarse (per-shard bounds of some shards only)
        if not due or (cur.manifest["change"]["op"] == "guard"
                       and not self._refinable(cur.manifest["guard"])):
            return False
        return self._start(cur, now)

    def _collect(self, cur: ModelVersion) -> bool:
        job = self.job
        if job.version != cur.version and self.check_requests is None:
            log.info("guard for %s is stale (current %s); cancelled", job.version,
                     cur.version)
            job.cancel()
            self.job = None
            return True
        if not job.done():
            return False
        self.job = None
        self._finish(job)
        return True

    def _start(self, cur: ModelVersion, now: float) -> bool:
        applied = [r.request_id for r in self.ledger.lifecycle.requests_with_status("applied")]
        if self.registry.current().version != cur.version:
            return True  # published meanwhile: the requests read may not be in `cur`
        if (not applied and not guard_owed(cur.manifest)
                and not self._refinable(cur.manifest["guard"])):
            self.unverified_since = None
            return False
        self.check_requests = None if guard_owed(cur.manifest) else applied
        self.check_started = now
        self.job = GuardJob(cur.version, self.registry.path(cur.version),
                            self.registry.key(cur.version), self.registry.vouched_manifest(cur),
                            self.config.verify_exactness, self.process,
                            self.config.shard_bound_s)
        return True

    def _refinable(self, guard: dict[str, Any]) -> bool:
        """A coarse guard that the guard job would make finer with this configuration."""
        return guard_coarse(guard) and (guard["rule"] not in ("sisa-vote", "lucid")
                                        or self.config.shard_bound_s > 0)

    def _finish(self, job: GuardJob) -> None:
        try:
            result = job.result()
        except RuntimeError as exc:
            metrics.UPDATE_FAILURES.inc()
            log.error("refitting the guard for %s failed; it is retried:\n%s", job.version, exc)
            job.discard()
            self.owed_since = time.monotonic()  # updates flow again meanwhile
            return
        check = result.check
        # an approximate learner is not retrain-identical by design: its check measures
        # the gap to a retrain, which the `verified` event records
        failed = bool(check) and check.get("guarantee") == "exact" and not check["exact"]
        if failed:
            metrics.VERIFY_FAILURES.inc()
            log.error("exactness check failed for %s: %s != %s", job.version,
                      check["served_hash"], check["retrained_hash"])
        in_place, self.check_requests = self.check_requests, None
        if result.exact_dir is not None:
            self._publish_exact(job, result, failed)
            return
        cur = self.registry.current()
        refined = (cur is not None and cur.version == job.version
                   and guard_coarse(cur.manifest["guard"]) and result.guard["ready"]
                   and not guard_coarse(result.guard))
        # published with its guard: only the check was owed (or the version it completed
        # a coarse guard for is no longer current)
        if in_place is not None and not refined:
            self._verify_in_place(job, result, cur, in_place if not failed else [])
            return
        self._publish_guard(job, result, failed)

    def _verify_in_place(self, job: GuardJob, result: GuardResult, cur: ModelVersion | None,
                         requests: list[str]) -> None:
        self._carry(job, result, cur)
        job.discard()
        if requests:
            self.ledger.lifecycle.mark_verified(requests, job.version, {
                "guard": result.guard, "exactness": result.check, "in_place": True},
                skip_settled=True)
        # requests applied while the check ran have waited since it started, at most
        self.unverified_since = (self.check_started if self.ledger.lifecycle
                                 .requests_with_status("applied") else None)

    def _publish_guard(self, job: GuardJob, result: GuardResult, failed: bool) -> None:
        """Publish the current version again with the job's guard (and verify the requests
        applied, unless the check failed)."""
        model, parent = self.loaded.get()
        with sealed_with(self.registry.key(parent.version)):
            model.load_guard(result.guard_dir)
        job.discard()
        metrics.BOUND_SECONDS.labels(learner=model.kind).observe(result.guard["seconds"])
        applied = self.ledger.lifecycle.requests_with_status("applied")
        change = {"op": "guard", "guard": result.guard, "exactness": result.check,
                  "requests": len(applied)}
        request_ids = [r.request_id for r in applied] if not failed else []
        if request_ids:
            detail = {"guard": result.guard, "exactness": result.check}

            def commit(version: str, stamp: dict[str, Any], publish: Publish) -> None:
                self.ledger.lifecycle.mark_verified(request_ids, version, {**detail, **stamp},
                                                    in_transaction=publish)
        else:
            commit = self.publisher.announce("guard_refreshed", change)
        try:
            self.publisher.publish(model, parent.version, change, commit)
        except PublishConflict:
            self.loaded.forget()
            return
        if request_ids:
            self.unverified_since = None

    def _publish_exact(self, job: GuardJob, result: GuardResult, failed: bool) -> None:
        """Publish the exact retrain of the current (approximate) version in its place,
        and mark the requests applied `verified` in that transaction: only now is a
        version without their records exact (unless its retrain did not reproduce its
        hash; then it is published, the requests stay `applied` and the failure counts).
        Every earlier version is to be destroyed: the approximate ones were trained on the
        records they forgot."""
        model, parent = self.loaded.get()
        if parent.version != job.version:  # the stale job was cancelled in _collect
            job.discard()
            return
        with sealed_with(self.registry.key(parent.version)):
            exact = ServedModel.load(result.exact_dir)
        job.discard()
        if set(exact.learner.record_ids_.tolist()) != set(model.learner.record_ids_.tolist()):
            raise RuntimeError(f"the exact retrain of {job.version} holds other records")
        applied = self.ledger.lifecycle.requests_with_status("applied")
        change = {"op": "exact_retrain", "replaces": self._approximate_since(parent.version),
                  "exactness": result.check, "requests": len(applied)}
        request_ids = [r.request_id for r in applied] if not failed else []
        if request_ids:
            def commit(version: str, stamp: dict[str, Any], publish: Publish) -> None:
                self.ledger.lifecycle.mark_verified(
                    request_ids, version, {"exactness": result.check,
                                           "replaces": change["replaces"], **stamp},
                    in_transaction=publish)
        else:
            commit = self.publisher.announce("model_trained", change)  # a retrain
        try:
            self.publisher.publish(exact, parent.version, change, commit, removes_records=True)
        except PublishConflict:
            self.loaded.forget()
            return
        if self.owed_since is not None:
            metrics.EXACT_SECONDS.observe(time.monotonic() - self.owed_since)
        self.owed_since = None
        if request_ids:
            self.unverified_since = None

    def _approximate_since(self, version: str) -> list[str]:
        """`version` and its approximate ancestors back to the last exact one: the
        versions an exact retrain of `version` replaces (newest first)."""
        out: list[str] = []
        v: str | None = version
        while v is not None:
            try:
                man = self.registry.get(v).manifest
            except (KeyError, VersionUnavailable):
                break
            if not exact_owed(man):
                break
            out.append(v)
            v = man.get("parent")
        return out

    def _carry(self, job: GuardJob, result: GuardResult, cur: ModelVersion | None) -> None:
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
        model, parent = self.loaded.get()
        with sealed_with(key):
            finer = model.adopt_guard(result.guard_dir)
        if not finer:
            return
        guard = {**model.guard_record(), "seconds": result.guard["seconds"]}
        if job.version != cur.version:
            guard["carried_from"] = job.version
        change = {"op": "guard", "guard": guard, "requests": 0}
        try:
            self.publisher.publish(model, parent.version, change,
                                   self.publisher.announce("guard_refreshed", change))
        except PublishConflict:
            self.loaded.forget()


def guard_coarse(guard: dict[str, Any]) -> bool:
    """A guard record (as in a manifest) that is sound but that an update ran out of time
    refining: a refit certifies more answers (not one whose LOO set the guard job will not
    train: `skipped`)."""
    bound = guard.get("bound") or {}
    return bool(guard["ready"]) and bound.get("complete") is False and not bound.get("skipped")
