"""Training tables the record store can be seeded from: bundled, synthetic, CSV or Parquet.

Every table gets an input transform fitted to it (:mod:`ledger.transform`; a user's
table, with text, booleans and missing values, column by column: :mod:`ledger.columns`);
`X` is the table in the model's input space, [0, 1] per encoded feature, which the
ledger stores and the models train on. Every row gets a record id and a subject (the
person it belongs to). scikit-learn is imported only for the bundled and synthetic
tables. See docs/tables.md.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from ledger.cells import Cells, CellsBuilder
from ledger.columns import MIN_FREQUENCY, CellError, ColumnCoding, fit_column, fit_labels
from ledger.transform import InputTransform

_CSV_CHUNK = 50_000  # rows read and coded at a time: a chunk's cells are Python objects
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
    """A table (CSV or Parquet) that cannot be loaded; the message names the file, line
    (or row) and column."""


@dataclass(frozen=True)
class TableOptions:
    """How `ledger init` reads a table's columns (see docs/tables.md)."""

    categorical: tuple[str, ...] = ()  # declared kinds; the others are inferred
    numeric: tuple[str, ...] = ()
    na: str | None = None  # the missing-value marker (null and empty cells are missing too)
    impute: str | None = None  # None: a missing number is refused; 'median' or 'mean'
    min_frequency: int = MIN_FREQUENCY  # rarer categories are coded as 'other'


def load_csv(path: str | Path, label_column: str, subject_column: str | None = None,
             id_column: str | None = None, transform: InputTransform | None = None,
             options: TableOptions | None = None) -> Dataset:
    """A user's own table as exported: feature columns (numeric, categorical or boolean),
    a label column (integers or text), and optionally the columns naming each row's
    subject (the person it belongs to) and record id. Every other column is a feature.
    `transform` (default: fitted to the table) is what an existing ledger already stores."""
    path = Path(path)
    try:
        with open(path, newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header:
                columns, n_rows = _csv_columns(path, reader, len(header))
    except FileNotFoundError:
        raise CsvError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CsvError(f"{path}: cannot be read as CSV ({exc})") from None
    if not header:
        raise CsvError(f"{path}: empty file; the first line must name the columns")
    header = [h.strip() for h in header]
    return _load(_Table(path, header, columns, n_rows, "line", 2), label_column,
                 subject_column, id_column, transform, options or TableOptions())


def _csv_columns(path: Path, reader: Iterator[list[str]], width: int
                 ) -> tuple[list[Cells], int]:
    """The rows after the header, coded column by column a chunk at a time (stripped),
    each row checked to have the header's width."""
    builders = [CellsBuilder() for _ in range(width)]
    n = 0
    while rows := list(islice(reader, _CSV_CHUNK)):
        if set(map(len, rows)) != {width}:
            i = next(i for i, row in enumerate(rows) if len(row) != width)
            raise CsvError(f"{path}: line {n + i + 2} has {len(rows[i])} fields, the header "
                           f"{width}")
        for builder, column in zip(builders, zip(*rows, strict=True), strict=True):
            builder.add(column)
        n += len(rows)
    return [b.cells(strip=True) for b in builders], n


def load_parquet(path: str | Path, label_column: str, subject_column: str | None = None,
                 id_column: str | None = None, transform: InputTransform | None = None,
                 options: TableOptions | None = None) -> Dataset:
    """:func:`load_csv` for a Parquet file (read with pyarrow: the `parquet` extra)."""
    path = Path(path)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CsvError(f"{path}: reading Parquet needs pyarrow: pip install "
                       "'obliviate[parquet]'") from None
    if not path.is_file():
        raise CsvError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CsvError(f"{path}: cannot be read as Parquet ({why})") from None
    columns: list[Cells] = []
    for col in table.columns:
        numeric = pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
        columns.append(Cells.of(col.to_numpy() if numeric and col.null_count == 0
                                else col.to_pylist()))
    return _load(_Table(path, [str(n).strip() for n in table.column_names], columns,
                        table.num_rows, "row", 1),
                 label_column, subject_column, id_column, transform, options or TableOptions())


@dataclass(frozen=True)
class _Table:
    """A table as read: its columns (stripped text, or Parquet values), coded."""

    path: Path
    header: list[str]
    columns: list[Cells]
    n_rows: int
    unit: str  # how a row is named in errors: "line" (CSV, from 2) or "row" (from 1)
    first: int

    def where(self, row: int | None, column: str) -> str:
        at = f"{self.unit} {row + self.first}, " if row is not None else ""
        return f"{self.path}: {at}column {column!r}"


def _load(t: _Table, label_column: str, subject_column: str | None, id_column: str | None,
          transform: InputTransform | None, options: TableOptions) -> Dataset:
    path, header = t.path, t.header
    dup = sorted({h for h in header if header.count(h) > 1})
    if dup:
        raise CsvError(f"{path}: the header names column(s) {', '.join(map(repr, dup))} twice")
    for flag, col in (("--label-column", label_column), ("--subject-column", subject_column),
                      ("--id-column", id_column),
                      *(("--categorical", c) for c in options.categorical),
                      *(("--numeric", c) for c in options.numeric)):
        if col is not None and col not in header:
            raise CsvError(f"{path}: no column {col!r} (columns: {', '.join(header)}); "
                           f"name the right one with {flag}")
    if not t.n_rows:
        raise CsvError(f"{path}: no rows after the header line")
    special = {label_column, subject_column, id_column}
    features = [h for h in header if h not in special]
    if not features:
        raise CsvError(f"{path}: no feature columns (every column is the label, subject "
                       "or id column)")
    cells = dict(zip(header, t.columns, strict=True))
    if transform is None:
        codings = [_fit(t, h, cells[h], subject_column, id_column, options) for h in features]
        na = options.na
    else:
        codings, na = list(transform.raw_columns), transform.na
        missing = next((c.name for c in codings if c.name not in cells), None)
        if missing is not None:
            raise CsvError(f"{t.path}: no column {missing!r}, which the ledger's schema has")
    if [c.name for c in codings] != features:
        raise CsvError(f"{path}: the feature columns are {', '.join(features)}; the ledger's "
                       f"schema has {', '.join(c.name for c in codings)}")
    try:
        y, labels = fit_labels(cells[label_column],
                               transform.labels if transform is not None else None)
    except CellError as exc:
        raise CsvError(f"{t.where(exc.row, label_column)}: {exc}") from None
    E = _encoded(t, codings, cells, na)
    records, subjects = _ids(t.n_rows, 1)
    if id_column is not None:
        records = _id_column(t, cells[id_column], id_column, unique=True)
    if subject_column is not None:
        subjects = _id_column(t, cells[subject_column], subject_column)
    if transform is None:
        transform = InputTransform.fit_encoded(E, codings, labels, options.na)
    return from_raw(path.stem, E, y, records, subjects, transform=transform)


def _encoded(t: _Table, codings: list[ColumnCoding], cells: dict[str, Cells],
             na: str | None) -> np.ndarray:
    """The feature columns encoded by their codings, into one (rows, features) array."""
    E = np.empty((t.n_rows, sum(c.width for c in codings)))
    at = 0
    for c in codings:
        try:
            E[:, at:at + c.width] = c.encode_cells(cells[c.name], _markers(na))
        except CellError as exc:
            raise CsvError(f"{t.where(exc.row, c.name)}: {exc}") from None
        at += c.width
    return E


def _fit(t: _Table, name: str, cells: Cells, subject_column: str | None,
         id_column: str | None, options: TableOptions) -> ColumnCoding:
    """One feature column's coding, its kind declared or inferred (docs/tables.md)."""
    declared = ("categorical" if name in options.categorical
                else "numeric" if name in options.numeric else None)

    def id_hint() -> str:
        if subject_column is None and id_column is None:
            fix = (f"if {name!r} names the person the row belongs to, pass --subject-column "
                   f"{name} (or --id-column {name} for record ids)")
        elif id_column is None:
            fix = f"if {name!r} holds record ids, pass --id-column {name}"
        else:
            fix = f"if {name!r} names the person the row belongs to, pass --subject-column {name}"
        return (f"; {fix}, or --categorical {name} to keep it as a feature (a value seen "
                f"fewer than {options.min_frequency} times is coded 'other')")

    try:
        return fit_column(name, cells, _markers(options.na), options.na or "", declared,
                          options.impute, options.min_frequency, id_hint)
    except CellError as exc:
        raise CsvError(f"{t.where(exc.row, name)}: {exc}") from None


def _markers(na: str | None) -> frozenset[str]:
    return frozenset({"", na} if na is not None else {""})


def _id_column(t: _Table, cells: Cells, column: str, unique: bool = False) -> list[str]:
    """The column's ids, one per row (each distinct one checked once)."""
    texts = ["" if v is None else v if isinstance(v, str) else str(v) for v in cells.values]
    for k, v in enumerate(texts):
        if not v or len(v) > 128 or not v.isprintable():
            raise CsvError(f"{t.where(cells.row(k), column)}: an id must be 1-128 printable "
                           "characters")
    if unique and len(set(texts)) != len(cells):
        first = np.full(len(texts), len(cells))
        np.minimum.at(first, cells.codes, np.arange(len(cells)))
        i = int(np.flatnonzero(first[cells.codes] != np.arange(len(cells)))[0])
        raise CsvError(f"{t.where(i, column)}: record id {_quote(texts[cells.codes[i]])} is "
                       f"on {t.unit} {first[cells.codes[i]] + t.first} too")
    return Cells(texts, cells.codes).rows()


def _quote(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
