"""Training tables the record store can be seeded from: bundled, synthetic or CSV.

Every table keeps its raw features (`raw`, in the features' own units) and gets an
input transform fitted to it (:mod:`ledger.transform`: per feature its name, min
and max, widened to round numbers); `X` is the table in the model's input space,
[0, 1] per feature, which is what the ledger stores and the models train on. The
transform is stored with the ledger's schema, so queries and additions in raw
units are scaled the same way. Every row gets a record id and a subject (the
person it belongs to).

scikit-learn (and with it SciPy) is imported only for the bundled and synthetic
tables: a CSV needs neither.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ledger.transform import InputTransform

# loader names in sklearn.datasets
BUNDLED = {
    "breast_cancer": "load_breast_cancer",
    "digits": "load_digits",
    "wine": "load_wine",
    "iris": "load_iris",
}
NAMES = (*BUNDLED, "synthetic", "census")


@dataclass(frozen=True)
class Dataset:
    name: str
    record_ids: list[str]
    subject_ids: list[str]
    X: np.ndarray  # the model's input space: transform.scale(raw)
    y: np.ndarray
    raw: np.ndarray | None = None  # the features in their own units
    transform: InputTransform | None = None

    @property
    def feature_names(self) -> tuple[str, ...]:
        return self.transform.names if self.transform else tuple(
            f"x{j}" for j in range(self.X.shape[1]))


def scale_unit(X: np.ndarray) -> np.ndarray:
    """Min-max scale each column to [0, 1] (constant columns become 0), fitted on X itself.
    The sidecar stores its scaling instead (:class:`InputTransform`); kept for callers
    that scale a table of their own."""
    X = np.asarray(X, dtype=np.float64)
    lo, hi = X.min(axis=0), X.max(axis=0)
    span = np.where(hi > lo, hi - lo, 1.0)
    return (X - lo) / span


def from_raw(name: str, raw: np.ndarray, y: np.ndarray, record_ids: list[str],
             subject_ids: list[str], feature_names: list[str] | None = None,
             transform: InputTransform | None = None) -> Dataset:
    """A table in raw units; `transform` (default: fitted to it) scales it."""
    raw = np.asarray(raw, dtype=np.float64)
    transform = transform or InputTransform.fit(raw, feature_names)
    return Dataset(name, record_ids, subject_ids, transform.scale(raw),
                   np.asarray(y, dtype=np.int64), raw, transform)


def _ids(n: int, records_per_subject: int) -> tuple[list[str], list[str]]:
    width = len(str(max(n - 1, 1)))
    return ([f"r{i:0{width}d}" for i in range(n)],
            [f"s{i // records_per_subject:0{width}d}" for i in range(n)])


def load(name: str, records_per_subject: int = 3, n_samples: int = 2000,
         random_state: int = 0) -> Dataset:
    """A bundled scikit-learn data set by name, 'synthetic' (make_classification: every
    value distinct) or 'census' (:mod:`ledger.census`: ties, categories, skew); the two
    generated ones have `n_samples` rows."""
    if name not in NAMES:
        raise ValueError(f"unknown data set {name!r}: choose from {', '.join(NAMES)}, "
                         "or load your own table with --csv FILE")
    if name == "census":
        from ledger.census import FEATURES, census_like

        X, y = census_like(n_samples, seed=random_state)
        records, subjects = _ids(len(X), records_per_subject)
        return from_raw(name, X, y, records, subjects, list(FEATURES))
    from sklearn import datasets as skd

    if name == "synthetic":
        X, y = skd.make_classification(n_samples=n_samples, n_features=20, n_informative=10,
                                       n_classes=3, random_state=random_state)
        names = None
    else:
        bunch = getattr(skd, BUNDLED[name])()
        X, y = bunch.data, bunch.target
        given = getattr(bunch, "feature_names", None)
        names = ([str(f) for f in given] if given is not None and len(given) == X.shape[1]
                 else None)
    records, subjects = _ids(len(X), records_per_subject)
    return from_raw(name, X, y, records, subjects, names)


class CsvError(ValueError):
    """A CSV file that cannot be loaded; the message names the file, line and column."""


def load_csv(path: str | Path, label_column: str, subject_column: str | None = None,
             id_column: str | None = None, transform: InputTransform | None = None
             ) -> Dataset:
    """A user's own table: numeric feature columns, an integer label column, and
    optionally the columns naming each row's subject (the person it belongs to) and
    record id. Every other column is a feature. `transform` (default: fitted to the
    table) is what an existing ledger already stores."""
    path = Path(path)
    try:
        with open(path, newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            rows = list(reader)
    except FileNotFoundError:
        raise CsvError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CsvError(f"{path}: cannot be read as CSV ({exc})") from None
    if not header:
        raise CsvError(f"{path}: empty file; the first line must name the columns")
    header = [h.strip() for h in header]
    dup = sorted({h for h in header if header.count(h) > 1})
    if dup:
        raise CsvError(f"{path}: line 1 names column(s) {', '.join(map(repr, dup))} twice")
    for flag, col in (("--label-column", label_column), ("--subject-column", subject_column),
                      ("--id-column", id_column)):
        if col is not None and col not in header:
            raise CsvError(f"{path}: no column {col!r} (columns: {', '.join(header)}); "
                           f"name the right one with {flag}")
    if not rows:
        raise CsvError(f"{path}: no rows after the header line")
    special = {label_column, subject_column, id_column}
    features = [j for j, h in enumerate(header) if h not in special]
    if not features:
        raise CsvError(f"{path}: no feature columns (every column is the label, subject "
                       "or id column)")
    where = {h: j for j, h in enumerate(header)}
    X = np.empty((len(rows), len(features)), dtype=np.float64)
    y = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        line = i + 2
        if len(row) != len(header):
            raise CsvError(f"{path}: line {line} has {len(row)} fields, the header "
                           f"{len(header)}")
        for k, j in enumerate(features):
            X[i, k] = _number(path, line, header[j], row[j], subject_column, id_column)
        y[i] = _label(path, line, label_column, row[where[label_column]])
    n = len(rows)
    records, subjects = _ids(n, 1)
    if id_column is not None:
        records = _id_column(path, rows, where[id_column], id_column, unique=True)
    if subject_column is not None:
        subjects = _id_column(path, rows, where[subject_column], subject_column)
    return from_raw(path.stem, X, y, records, subjects, [header[j] for j in features],
                    transform)


def _number(path: Path, line: int, column: str, text: str, subject_column: str | None,
            id_column: str | None) -> float:
    value = text.strip()
    where = f"{path}: line {line}, column {column!r}"
    if not value:
        raise CsvError(f"{where}: empty; every feature needs a number (fill or drop "
                       "the row)")
    try:
        x = float(value)
    except ValueError:
        hint = ""
        if subject_column is None and id_column is None:
            hint = (f"; if {column!r} names the person the row belongs to, pass "
                    f"--subject-column {column} (or --id-column {column} for record ids)")
        raise CsvError(f"{where}: {_quote(value)} is not a number{hint}") from None
    if not math.isfinite(x):
        raise CsvError(f"{where}: {_quote(value)} is not a finite number")
    return x


def _label(path: Path, line: int, column: str, text: str) -> int:
    value = text.strip()
    try:
        return int(value)
    except ValueError:
        try:
            f = float(value)
        except ValueError:
            f = math.nan
        if math.isfinite(f) and f == int(f):
            return int(f)
    raise CsvError(f"{path}: line {line}, column {column!r}: {_quote(value)} is not an "
                   "integer class label (name the label column with --label-column)")


def _id_column(path: Path, rows: list[list[str]], j: int, column: str,
               unique: bool = False) -> list[str]:
    out = [r[j].strip() for r in rows]
    for i, v in enumerate(out):
        if not v or len(v) > 128 or not v.isprintable():
            raise CsvError(f"{path}: line {i + 2}, column {column!r}: an id must be 1-128 "
                           "printable characters")
    if unique:
        seen: dict[str, int] = {}
        for i, v in enumerate(out):
            if v in seen:
                raise CsvError(f"{path}: line {i + 2}, column {column!r}: record id "
                               f"{_quote(v)} is on line {seen[v] + 2} too")
            seen[v] = i
    return out


def _quote(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
