"""The worker's update pass: claim pending requests, apply them to the current version's
learner, bring its guard up to date, publish the result.

A request the learner raises on when applied alone is quarantined (`failed`, with the
learner's error) and the rest of its batch applied: no request stops the stream. See
docs/sidecar.md#worker.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jobs.eval import FrozenScores, evaluate_unlearning
from jobs.learners.base import Learner, UpdateReport
from jobs.orchestration import worker_metrics as metrics
from jobs.orchestration.guard_pass import GuardPass
from jobs.orchestration.loaded_version import LoadedVersion
from jobs.orchestration.publisher import Publish, Publisher
from jobs.orchestration.served_model import ServedModel
from ledger.chain import as_utc, utc_now
from ledger.error_text import first_line
from ledger.models import Request
from ledger.store import Ledger

log = logging.getLogger("obliviate.worker")

Update = tuple[str, np.ndarray]  # ("add" | "delete", record ids): one learner call


class UpdatePass:
    """Claims and applies requests, one batch a pass."""

    def __init__(self, ledger: Ledger, loaded: LoadedVersion, publisher: Publisher,
                 guard: GuardPass, config: Any) -> None:
        """`config` is the worker's (:class:`jobs.orchestration.worker.WorkerConfig`)."""
        self.ledger, self.loaded, self.publisher = ledger, loaded, publisher
        self.guard, self.config = guard, config

    def claim(self) -> list[Request]:
        cfg = self.config
        batch = self.ledger.lifecycle.claim(cfg.max_batch, cfg.name, cfg.lease_s)
        # wait for company only when this request came alone: a backlog is a batch already
        if len(batch) == 1 and cfg.batch_window_s > 0:
            time.sleep(cfg.batch_window_s)
            batch += self.ledger.lifecycle.claim(cfg.max_batch - len(batch), cfg.name, cfg.lease_s,
                                       retake_own=False)
        return batch

    def apply(self, batch: list[Request]) -> None:
        model, parent = self.loaded.get()
        live = set(model.learner.record_ids_.tolist())
        named = {i for r in batch if r.op == "delete" for i in r.record_ids if i not in live}
        purged = self.ledger.records.purged(sorted(named))
        ok, failed, updates = plan(batch, live, purged)
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
            self.loaded.forget()  # maybe half updated: start again from the version's files
            model, parent = self.loaded.get()
            model, ok, reports, updates = self._isolate(model, ok, data, purged)
            self.loaded.model = model
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
        self.publisher.publish(model, parent.version, change, commit,
                               removes_records=bool(deleted))
        self.guard.applied()
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
            fine, failed, todo = plan(part, set(model.learner.record_ids_.tolist()), gone)
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


def plan(batch: Sequence[Request], live: set[str], purged: set[str]
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
