"""What went wrong in the worker's latest passes, and what the worker says about it.

A pass never ends the worker: an error no request is at fault for is logged in one line,
counted, and retried after a back-off; a current version the worker may not build on is
refused, with an alert gauge and one log line per reason. See docs/sidecar.md#worker.
"""

from __future__ import annotations

import logging
import time

from jobs.orchestration import worker_metrics as metrics
from jobs.orchestration.registry import VersionRefused
from ledger.error_text import first_line

log = logging.getLogger("obliviate.worker")


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
