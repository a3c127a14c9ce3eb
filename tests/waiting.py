"""Waiting for an event instead of sleeping for a time it hopes is long enough (too short on
a busy machine, too long on an idle one). No side effects: benchmarks import it too."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str,
             interval_s: float = 0.05) -> T:
    """Call `condition` until it returns something truthy, and return that; AssertionError
    naming `what` and the last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} "
                                 f"(last: {value!r})")
        time.sleep(interval_s)
