"""Training tables the record store can be seeded from: bundled, synthetic or CSV.

Features are scaled to [0, 1] per column (the guard clips queries to that box),
and every row gets a record id and a subject (the person it belongs to).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sklearn import datasets as skd

BUNDLED = {
    "breast_cancer": skd.load_breast_cancer,
    "digits": skd.load_digits,
    "wine": skd.load_wine,
    "iris": skd.load_iris,
}


@dataclass(frozen=True)
class Dataset:
    name: str
    record_ids: list[str]
    subject_ids: list[str]
    X: np.ndarray
    y: np.ndarray


def scale_unit(X: np.ndarray) -> np.ndarray:
    """Min-max scale each column to [0, 1]; constant columns become 0."""
    X = np.asarray(X, dtype=np.float64)
    lo, hi = X.min(axis=0), X.max(axis=0)
    span = np.where(hi > lo, hi - lo, 1.0)
    return (X - lo) / span


def _with_ids(name: str, X: np.ndarray, y: np.ndarray, records_per_subject: int) -> Dataset:
    n = len(X)
    width = len(str(max(n - 1, 1)))
    return Dataset(name, [f"r{i:0{width}d}" for i in range(n)],
                   [f"s{i // records_per_subject:0{width}d}" for i in range(n)],
                   scale_unit(X), np.asarray(y, dtype=np.int64))


def load(name: str, records_per_subject: int = 3, n_samples: int = 2000,
         random_state: int = 0) -> Dataset:
    """A bundled scikit-learn data set by name, or 'synthetic'."""
    if name == "synthetic":
        X, y = skd.make_classification(n_samples=n_samples, n_features=20, n_informative=10,
                                       n_classes=3, random_state=random_state)
        return _with_ids(name, X, y, records_per_subject)
    if name not in BUNDLED:
        raise ValueError(f"unknown data set {name!r}: choose from "
                         f"{', '.join([*BUNDLED, 'synthetic'])} or load a CSV file")
    bunch = BUNDLED[name]()
    return _with_ids(name, bunch.data, bunch.target, records_per_subject)


def load_csv(path: str | Path, label_column: str, subject_column: str | None = None,
             id_column: str | None = None) -> Dataset:
    """A user's own table: numeric feature columns, an integer label column."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        raise ValueError(f"{path}: no rows")
    missing = [c for c in (label_column, subject_column, id_column) if c and c not in rows[0]]
    if missing:
        raise ValueError(f"{path}: no column(s) {', '.join(missing)}")
    feature_cols = [c for c in rows[0] if c not in (label_column, subject_column, id_column)]
    try:
        X = np.array([[float(r[c]) for c in feature_cols] for r in rows])
        y = np.array([int(r[label_column]) for r in rows])
    except ValueError as exc:
        raise ValueError(f"{path}: features must be numbers and labels integers ({exc})") from None
    ds = _with_ids(Path(path).stem, X, y, 1)
    return Dataset(ds.name,
                   [r[id_column] for r in rows] if id_column else ds.record_ids,
                   [r[subject_column] for r in rows] if subject_column else ds.subject_ids,
                   ds.X, ds.y)
