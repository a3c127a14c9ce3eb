"""The contract every learner offers the worker.

Learners take arrays and record ids and know nothing of the ledger. They follow
scikit-learn's conventions: keyword-only hyperparameters in the constructor,
``fit(X, y, *, record_ids=None)``, fitted state in attributes ending in ``_``,
``random_state`` for every source of randomness.
See docs/learners.md (The interface)."""

from __future__ import annotations

import abc
import hashlib
import io
import json
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from jobs import sealing

Guarantee = Literal["exact", "approximate"]


class UnknownRecordError(KeyError):
    """A delete named a record id the model was never trained on, or already forgot."""

    def __init__(self, record_ids: list[str], reason: str = "unknown record id") -> None:
        self.record_ids = record_ids
        self.reason = reason
        shown = ", ".join(map(str, record_ids[:5])) + (" ..." if len(record_ids) > 5 else "")
        super().__init__(f"{reason}: {shown}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class DuplicateRecordError(ValueError):
    """An add named a record id the model already holds (or named one twice)."""


@dataclass(frozen=True)
class UpdateReport:
    """What one delete/add did: the worker copies it into the ledger's `applied` event."""

    op: Literal["delete", "add"]
    record_ids: list[str]
    guarantee: Guarantee
    seconds: float
    retrained: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "n_records": len(self.record_ids),
            "guarantee": self.guarantee,
            "seconds": self.seconds,
            "retrained": self.retrained,
            "metrics": self.metrics,
        }


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of retraining from scratch on the live records and comparing hashes."""

    exact: bool
    served_hash: str
    retrained_hash: str
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


class Learner(abc.ABC):
    """A model that can forget (and learn) individual records by id."""

    guarantee: Guarantee

    @abc.abstractmethod
    def fit(self, X: np.ndarray, y: np.ndarray, *, record_ids: np.ndarray | None = None
            ) -> Learner:
        """Train on (X, y), the rows named by `record_ids` (default: the row numbers, as
        strings; see :func:`training_ids`)."""

    @abc.abstractmethod
    def delete(self, ids: np.ndarray) -> UpdateReport: ...

    @abc.abstractmethod
    def add(self, ids: np.ndarray, X: np.ndarray, y: np.ndarray) -> UpdateReport: ...

    def prepare_updates(self) -> None:  # noqa: B027 - most learners keep nothing to rebuild
        """Build now what the first update after a load would build (a worker calls it when
        it starts, so that no request waits for it)."""

    @abc.abstractmethod
    def scores(self, X: np.ndarray) -> np.ndarray:
        """Per-class scores (probabilities or logits), shape (n, n_classes)."""

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.classes_[np.argmax(self.scores(X), axis=1)]

    @abc.abstractmethod
    def verify(self) -> VerifyReport: ...

    @abc.abstractmethod
    def save(self, path: str | Path) -> None: ...

    @classmethod
    @abc.abstractmethod
    def load(cls, path: str | Path) -> Learner: ...

    @abc.abstractmethod
    def content_hash(self) -> str:
        """SHA-256 over everything that determines predictions, bit for bit."""


def as_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """Record ids as a 1-D object array of ``str`` (ints and strings are both accepted)."""
    arr = np.asarray(ids, dtype=object)
    if arr.ndim == 0:
        raise ValueError(f"{what} must be a 1-D sequence of record ids, got a scalar")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    out = np.empty(len(arr), dtype=object)
    for k, v in enumerate(arr):
        if v is None:
            raise ValueError(f"{what}[{k}] is None; record ids must be strings or integers")
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, float | np.floating):
            raise ValueError(f"{what}[{k}] = {v!r} is a float; record ids must be strings or ints")
        out[k] = str(v)
    return out


def duplicate_ids(ids: np.ndarray) -> list[str]:
    """Ids that occur more than once, in order of their second occurrence."""
    seen: set[str] = set()
    dup: list[str] = []
    for i in ids:
        if i in seen:
            dup.append(i)
        seen.add(i)
    return dup


def check_features(X: Any, n: int | None, d: int | None,
                   dtype: type[np.floating] = np.float64) -> np.ndarray:
    """X as a finite, C-ordered 2-D `dtype` array with n rows and d columns (when given).

    Finiteness is checked after the conversion, so values beyond float32 are refused
    too; -0.0 becomes 0.0 so equal inputs have equal bytes.
    """
    try:
        arr = np.asarray(X, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"X must be a numeric 2-D array: {exc}") from None
    if arr.ndim != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_features), got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"X has {arr.shape[0]} rows but {n} record ids were given")
    if d is not None and arr.shape[1] != d:
        raise ValueError(f"X has {arr.shape[1]} features, the model expects {d}")
    out = arr.astype(dtype, copy=False)
    if not np.isfinite(out).all():
        bad = int((~np.isfinite(out)).any(axis=1).sum())
        raise ValueError(f"X contains NaN or infinite values (as {np.dtype(dtype).name}) "
                         f"in {bad} row(s)")
    return np.ascontiguousarray(out) + dtype(0.0)


def encode_labels(y: Any, classes: np.ndarray, n: int) -> np.ndarray:
    """`y` (n labels) as indices into `classes`; a label outside them raises ValueError
    (the model only predicts the classes it was built with)."""
    arr = np.asarray(y)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"y must be 1-D with {n} labels, got shape {arr.shape}")
    try:
        known = np.isin(arr, classes)
    except TypeError:
        known = np.array([any(v == c for c in classes) for v in arr.tolist()])
    if not known.all():
        unknown = sorted({repr(v) for v in arr[~known].tolist()})
        raise ValueError(
            f"unknown label(s) {', '.join(unknown[:5])}; the model's classes are "
            f"{classes.tolist()} (declare all labels with classes=... at construction)"
        )
    lookup = {c: k for k, c in enumerate(classes.tolist())}
    return np.array([lookup[v] for v in arr.tolist()], dtype=np.int64)


def unique_ids(ids: Any) -> np.ndarray:
    """`as_ids`, refusing an id named twice."""
    rids = as_ids(ids)
    dup = duplicate_ids(rids)
    if dup:
        raise DuplicateRecordError(f"record id(s) named more than once: {dup[:5]}")
    return rids


def training_ids(record_ids: Any, n_rows: int) -> np.ndarray:
    """The record ids of a fit on n_rows rows: `record_ids` (unique, one per row) or, when
    None, the row numbers as strings, so that scikit-learn's ``fit(X, y)`` (cross
    validation, pipelines) names its records too."""
    rids = unique_ids(np.arange(n_rows) if record_ids is None else record_ids)
    if len(rids) != n_rows:
        raise ValueError(f"X has {n_rows} rows but {len(rids)} record ids were given")
    return rids


def ids_to_delete(ids: Any, live: Container[str]) -> np.ndarray:
    """Ids a delete may name: unique, and each one live in the model."""
    rids = unique_ids(ids)
    unknown = [i for i in rids.tolist() if i not in live]
    if unknown:
        raise UnknownRecordError(unknown, "unknown or already deleted record id")
    return rids


def ids_to_add(ids: Any, live: Container[str]) -> np.ndarray:
    """Ids an add may name: unique, and none of them live in the model already."""
    rids = unique_ids(ids)
    clash = [i for i in rids.tolist() if i in live]
    if clash:
        raise DuplicateRecordError(f"record id(s) already in the model: {clash[:5]}")
    return rids


def records_to_add(ids: Any, X: Any, y: Any, live: Container[str], n_features: int,
                   classes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What an add of the network learners may take: new unique ids, finite float32
    features of the model's width, labels as indices of its classes (else an error, and
    nothing changed)."""
    rids = ids_to_add(ids, live)
    Xa = check_features(X, len(rids), n_features, dtype=np.float32)
    return rids, Xa, encode_labels(y, classes, len(rids))


META_FILE = "meta.json"


def write_bundle(path: str | Path, meta: dict[str, Any], payload_name: str,
                 write_payload: Callable[[BinaryIO], None]) -> None:
    """Write a model directory: the payload, then `meta.json`, each via a temp file.

    Each file appears whole or not at all, and `meta.json` (which names the content
    hash) is replaced last. Inside the registry both are sealed under the version's key
    (:mod:`jobs.sealing`).
    """
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tmp_payload, tmp_meta = p / (payload_name + ".tmp"), p / (META_FILE + ".tmp")
    buf = io.BytesIO()
    write_payload(buf)
    sealing.write_file(tmp_payload, buf.getbuffer())
    sealing.write_file(tmp_meta, json.dumps(meta, indent=1).encode())
    tmp_payload.replace(p / payload_name)
    tmp_meta.replace(p / META_FILE)


def read_bundle_meta(path: str | Path, fmt: str | tuple[str, ...], what: str
                     ) -> dict[str, Any]:
    """`meta.json` of a model directory, refusing one written for another format (`fmt`:
    the one it reads, or those)."""
    meta = json.loads(sealing.read_file(Path(path) / META_FILE))
    if meta.get("format") not in ((fmt,) if isinstance(fmt, str) else fmt):
        raise ValueError(f"{path} is not a {what} bundle ({meta.get('format')!r})")
    return meta


def read_bundle_payload(path: str | Path, payload_name: str) -> BinaryIO:
    """The payload of a model directory, as a file object (unsealed in memory)."""
    return io.BytesIO(sealing.read_file(Path(path) / payload_name))


def hash_arrays(*arrays: np.ndarray) -> str:
    """Content hash of arrays: dtype, shape and bytes all count."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()
