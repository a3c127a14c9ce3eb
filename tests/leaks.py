"""Byte scans of saved model files, for the learners' tests (see :mod:`service.demo.residue`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from service.demo.residue import TraceScanner


def traces_found(path: str | Path, ids: Sequence[object], X: np.ndarray) -> set[tuple[str, str]]:
    """(record id, trace) of each trace of records ``(ids, X)`` in the files under `path`."""
    scanner = TraceScanner({str(i): x for i, x in zip(ids, np.asarray(X), strict=True)})
    return {(f.record_id, f.trace) for f in scanner.scan([path])}
