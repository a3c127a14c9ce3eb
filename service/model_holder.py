"""The version a serving process answers with, swapped atomically when the registry moves.

A watcher thread polls the registry; a new version is loaded off the request path, bound
to a fresh guard and installed with one reference assignment, so a request in flight
finishes on the version it started with and none fails. What an answer is, the guard
decides; this module chooses the version and records what answering cost.
See docs/sidecar.md (Service)."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from jobs.adaptive.budget import SeedBudgets
from jobs.orchestration.guarded_answers import GuardedAnswers, GuardedVersion
from jobs.orchestration.registry import Registry, VersionRefused, VersionUnavailable
from service import service_metrics as metrics
from service.usage import GuardUsage

log = logging.getLogger("obliviate.service")


class NoModelError(RuntimeError):
    """No version can be served: none is published yet, the one published may not be
    served (see the message), or this process could not confirm that the one it holds
    may still be served (it may hold records deleted since)."""


# a version refused for its files is loaded again at most this often (the pointer at every
# poll): loading and hashing a model every 0.1 s would take the CPU from the answers
RELOAD_REFUSED_S = 5.0


class ModelHolder:
    """Watches the registry and holds its current version, bound to a guard, for answers."""

    def __init__(self, registry: Registry, *, epsilon: float = 1.0, memo_size: int = 100_000,
                 epsilon_budget: float = 1000.0, poll_s: float = 0.1, guarded: bool = True,
                 usage: GuardUsage | None = None, budgets: SeedBudgets | None = None,
                 reserve_block: int = 32, noise_secret: bytes | None = None,
                 max_unconfirmed_s: float = 15.0) -> None:
        self.registry = registry
        # a version is destroyed a grace period after a deletion superseded it; a process
        # that cannot see the registry stops answering well before that
        self.max_unconfirmed_s = max_unconfirmed_s
        self._confirmed_at = -math.inf
        self.answers = GuardedAnswers(epsilon=epsilon, memo_size=memo_size, guarded=guarded,
                                      budgets=budgets, reserve_block=reserve_block,
                                      noise_secret=noise_secret)
        self.poll_s = poll_s
        self.usage = usage
        self._serving: GuardedVersion | None = None
        self.problem: str | None = None  # why the published version is not served, if so
        self._reload_at: tuple[str, float] | None = None  # (refused version, monotonic)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.process = f"{socket.gethostname()}:{os.getpid()}"
        metrics.GUARD_EPSILON.set(epsilon)
        metrics.GUARD_EPSILON_BUDGET.set(epsilon_budget)

    @property
    def guarded(self) -> bool:
        return self.answers.guarded

    # ------------------------------------------------------------------ swapping
    def start(self) -> ModelHolder:
        """Load the current version now (if any) and keep watching in the background."""
        self.refresh()
        self._thread = threading.Thread(target=self._watch, name="registry-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._flush_usage()

    def refresh(self) -> bool:
        """Install the registry's current version if it is not the one served; True if swapped.

        A version that may not be served is refused: the pointer names one destroyed,
        holding deleted records or never published (only a hand edit does that), or its
        files are not what was published (:meth:`Registry.load`). The process then keeps
        serving the version it has, while the ledger still lets that one be served (no
        deletion superseded it); without one it answers 503 saying what is wrong. A
        version it cannot confirm is no longer answered after ``max_unconfirmed_s``."""
        try:
            cur = self.registry.servable_current()
            if cur is None:
                return False
            if self._serving is not None and self._serving.version.version == cur.version:
                self._confirmed_at, self.problem = time.monotonic(), None
                return False
            r = self._reload_at
            if r is not None and r[0] == cur.version and time.monotonic() < r[1]:
                self._keep_serving()
                return False
            model = self.registry.load(cur.version)
        except VersionUnavailable:  # a deletion was published since: the next poll has it
            return False
        except VersionRefused as exc:
            self._refuse(exc)
            return False
        self.problem, self._reload_at = None, None
        served = self.answers.bind(cur, model)
        self._flush_usage()
        self._serving = served
        self._confirmed_at = time.monotonic()
        metrics.show_version(served)
        log.info("serving %s (%s, guard %s)", cur.version, model.kind,
                 "sound" if served.guard.sound else "noise-all")
        return True

    def _refuse(self, exc: VersionRefused) -> None:
        """Say once why the published version is not served; keep serving the installed one
        if the ledger still lets it be served."""
        # loaded again later (its files restored, say), not at every poll
        self._reload_at = (exc.version, time.monotonic() + RELOAD_REFUSED_S)
        if self.problem != str(exc):
            self.problem = str(exc)
            s = self._serving
            log.error("refusing to serve the current version: %s; %s (run `obliviate ledger "
                      "verify`)", exc, f"still serving {s.version.version}" if s is not None
                      else "no version to serve until one loads as published")
        self._keep_serving()

    def _keep_serving(self) -> None:
        """Confirm the installed version while the ledger lets it be served."""
        s = self._serving
        try:
            servable = s is not None and self.registry.get(s.version.version).unavailable is None
        except KeyError:  # its row is gone: nothing vouches for it any more
            servable = False
        if servable:
            self._confirmed_at = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
                self._flush_usage(min_interval_s=5.0)
            except Exception:  # keep serving the installed version; retry next tick
                log.exception("registry watch failed; still serving the installed version")

    # ------------------------------------------------------------------ answering
    @property
    def serving(self) -> GuardedVersion:
        s = self._serving
        if s is None and self.problem is not None:
            raise NoModelError(f"no model version can be served: {self.problem}; run "
                               "`obliviate ledger verify`, and point the model back to a "
                               "version that may be served")
        if s is None:
            raise NoModelError("no model version is published yet: train the first one "
                               "with `obliviate model train` (or run `obliviate worker "
                               "--train`); a plain `obliviate worker` only updates one")
        unconfirmed = time.monotonic() - self._confirmed_at
        if unconfirmed > self.max_unconfirmed_s:
            raise NoModelError(f"{s.version.version} could not be confirmed as the current "
                               f"version for {unconfirmed:.0f} s (registry unreachable, or "
                               "its pointer names a version that may not be served); not "
                               "answering with a version that may hold deleted records")
        return s

    def predict(self, X: np.ndarray, served: GuardedVersion | None = None
                ) -> tuple[np.ndarray, GuardedVersion, list[str]]:
        """Published labels for validated queries, the version that answered, and what
        each answer promises (certified, noised, exact or approximate). `served`: the
        version the request took from :attr:`serving` when it began (asking again could
        raise NoModelError in between, once the watcher has spent the confirmation's
        15 s loading a large version: a 500 at 10^6 rows)."""
        served = self.serving if served is None else served
        labels, cost = self.answers.answer(served, X)
        metrics.count_answers(cost)
        if self.usage is not None and cost.answers:
            self.usage.add(served.version.version, cost.certain, cost.noised, cost.fresh,
                           cost.epsilon_spent)
        return labels, served, list(cost.promises)

    def status(self) -> dict[str, Any]:
        s = self._serving
        return {"process": self.process, "guarded": self.guarded,
                "epsilon": self.answers.epsilon,
                "version": None if s is None else s.version.version,
                "mode": None if s is None else s.mode}

    def _flush_usage(self, min_interval_s: float = 0.0) -> None:
        if self.usage is not None:
            self.usage.flush(self.process, min_interval_s)
