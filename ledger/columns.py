"""One column of a table as users export it: numeric, categorical (text) or boolean.

A column's coding is fitted once, at `ledger init`, and stored in the schema with the
input transform; it turns a raw cell into encoded values, which min-max scaling then
takes into [0, 1]: a number (a missing one refused, or imputed with the value stored
at init), one 0/1 feature per category plus one for "other" (categories rarer than
`min_frequency` at init and every unseen one: never stored by name), a boolean as 0/1.
See docs/tables.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ledger.cells import Cells

KINDS = ("numeric", "categorical", "boolean")
TRUE = frozenset({"true", "yes", "1"})
FALSE = frozenset({"false", "no", "0"})
OTHER = "(other)"  # the last one-hot feature of a categorical column: `name=(other)`
MIN_FREQUENCY = 5
IMPUTE = ("median", "mean")


class CellError(ValueError):
    """A cell that cannot be encoded; `row` is its index in the table (None: a request's
    cell, whose caller says where it is)."""

    def __init__(self, message: str, row: int | None = None) -> None:
        super().__init__(message)
        self.row = row


@dataclass(frozen=True)
class ColumnCoding:
    """How one raw column is encoded (stored in the schema; never refitted)."""

    name: str
    kind: str = "numeric"
    categories: tuple[str, ...] = ()  # categorical: the names stored, in code order
    missing: str | None = None  # categorical: the category missing cells take (the marker)
    impute: float | None = None  # numeric: the value a missing cell takes (None: refused)

    @property
    def width(self) -> int:
        return len(self.categories) + 1 if self.kind == "categorical" else 1

    @property
    def plain(self) -> bool:
        """A numeric column with no missing-value policy: what every table was before."""
        return self.kind == "numeric" and self.impute is None

    def feature_names(self) -> list[str]:
        if self.kind != "categorical":
            return [self.name]
        return [f"{self.name}={c}" for c in (*self.categories, OTHER)]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "categorical":
            out["categories"] = list(self.categories)
            if self.missing is not None:
                out["missing"] = self.missing
        if self.impute is not None:
            out["impute"] = self.impute
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ColumnCoding:
        kind = str(doc.get("kind", "numeric"))
        if kind not in KINDS:
            raise ValueError(f"unknown column kind {kind!r}")
        impute = doc.get("impute")
        return cls(str(doc["name"]), kind, tuple(str(c) for c in doc.get("categories", ())),
                   doc.get("missing"), None if impute is None else float(impute))

    # ------------------------------------------------------------------ one request cell
    def encode(self, value: Any, na: str | None) -> list[float]:
        """A cell as a client sends it (JSON) -> its encoded values; CellError says why not."""
        missing = value is None or (isinstance(value, str) and value.strip() in ("", na))
        if self.kind == "numeric":
            if missing:
                if self.impute is None:
                    raise CellError("missing, and the column has no imputed value: send a "
                                    "number")
                return [self.impute]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CellError(f"{show_cell(value)} is not a number")
            if isinstance(value, int) and value.bit_length() > 1000:
                raise CellError(f"{show_cell(value)} is not finite")
            if not math.isfinite(value):
                raise CellError(f"{value} is not finite")
            return [float(value)]
        if self.kind == "boolean":
            flag = _boolean(value)
            if flag is None:
                raise CellError(f"{show_cell(value)} is not a boolean (true/false, yes/no, 1/0)")
            return [flag]
        if missing:
            text = self.missing
        elif isinstance(value, str):
            text = value.strip()
        elif isinstance(value, int) and not isinstance(value, bool):
            text = str(value)
        else:
            raise CellError(f"{show_cell(value)} is not a category: send its name as text")
        out = [0.0] * self.width
        out[self._codes.get(text, len(self.categories))] = 1.0
        return out

    @cached_property
    def _codes(self) -> dict[str | None, int]:
        """Category name -> code, built once (every categorical cell looks it up)."""
        return {c: i for i, c in enumerate(self.categories)}

    # ------------------------------------------------------------------ a table's column
    def encode_cells(self, cells: Cells, markers: frozenset[str],
                     miss: list[bool] | None = None) -> np.ndarray:
        """A loaded column (stripped text, or Parquet values; None missing) -> its
        encoded values, (n, width), each distinct cell encoded once; CellError names the
        row of the first bad cell. `miss`: which distinct cells are missing."""
        values = cells.values
        miss = _missing(values, markers) if miss is None else miss
        with _rows_of(cells):
            if self.kind == "numeric":
                return cells.take(_numbers(values, miss, self.impute)).reshape(-1, 1)
            if self.kind == "boolean":
                out = np.empty((len(values), 1))
                for i, c in enumerate(values):
                    flag = None if miss[i] else _boolean(c)
                    if flag is None:
                        raise CellError(f"{show_cell(c)} is not a boolean (true/false, yes/no, "
                                        "1/0)", i)
                    out[i, 0] = flag
                return cells.take(out)
        codes = self._codes
        other = len(self.categories)
        at = [codes.get(self.missing if m else _text(c), other)
              for c, m in zip(values, miss, strict=True)]
        per = np.zeros((len(values), self.width))
        per[np.arange(len(values)), at] = 1.0
        return cells.take(per)


@contextmanager
def _rows_of(cells: Cells) -> Iterator[None]:
    """A CellError raised about distinct cell k is re-pointed at the first row holding it."""
    try:
        yield
    except CellError as exc:
        if exc.row is not None:
            exc.row = cells.row(exc.row)
        raise


def fit_column(name: str, cells: Cells, markers: frozenset[str], na_name: str,
               declared: str | None = None, impute: str | None = None,
               min_frequency: int = MIN_FREQUENCY,
               id_hint: Callable[[], str] | None = None) -> ColumnCoding:
    """The coding of one column of the initial table: its kind (`declared`, else
    inferred), the categories seen at least `min_frequency` times (and `na_name` for
    missing cells), or the imputed statistic. `id_hint` (for an inferred column): the fix
    to name when the column looks like ids, not a feature."""
    miss = _missing(cells.values, markers)
    with _rows_of(cells):
        coding = _fit(name, cells, miss, na_name, declared, impute, min_frequency, id_hint)
        # what the column cannot be encoded for is refused now, at its first row, as
        # before any later column is looked at (encoding the distinct cells only)
        distinct = Cells(cells.values, np.arange(len(cells.values)))
        coding.encode_cells(distinct, markers, miss)
    return coding


def _imputed(values: np.ndarray, impute: str | None) -> float | None:
    if impute is None:
        return None
    if not values.size:
        raise CellError("every cell is missing: nothing to impute from", 0)
    stat = float(np.median(values) if impute == "median" else np.mean(values))
    return impute_value(stat, values)


def _fit(name: str, cells: Cells, miss: list[bool], na_name: str,
         declared: str | None, impute: str | None, min_frequency: int,
         id_hint: Callable[[], str] | None) -> ColumnCoding:
    values = cells.values
    kind = declared or _infer(values, miss)
    if kind == "numeric":
        if impute is None:
            return ColumnCoding(name)
        present = ~np.asarray(miss, dtype=bool)
        numbers = cells.take(_numbers(values, miss, 0.0))[cells.take(present)]
        return ColumnCoding(name, impute=_imputed(numbers, impute))
    if kind == "boolean":
        return ColumnCoding(name, "boolean")
    counts: Counter[str] = Counter()
    for c, m, k in zip(values, miss, cells.counts(), strict=True):
        if not m:
            counts[_text(c)] += k
    if declared is None and id_hint is not None and _looks_like_ids(counts, len(cells),
                                                                     min_frequency):
        first = next(i for i, m in enumerate(miss) if not m)
        raise CellError(f"{show_cell(_text(values[first]))} looks like an id, not a feature "
                        f"({len(counts)} distinct values in {len(cells)} rows){id_hint()}",
                        first)
    kept = sorted(c for c, n in counts.items() if n >= min_frequency and c != na_name)
    if any(miss):
        return ColumnCoding(name, "categorical", (*kept, na_name), missing=na_name)
    return ColumnCoding(name, "categorical", tuple(kept))


def impute_value(stat: float, values: np.ndarray) -> float:
    """`stat` rounded to three significant digits of the column's range, moved half a
    step when a record holds it exactly: the stored value, public at `/v1/schema` and
    kept after every deletion, is no record's value."""
    lo, hi = float(values.min()), float(values.max())
    scale = hi - lo if hi > lo else max(abs(lo), 1.0)
    exponent = math.floor(math.log10(scale)) - 2
    step = 10.0 ** exponent
    places = max(0, -exponent) + 1
    value = round(round(stat / step) * step, places)
    held = set(values.tolist())
    while value in held:
        value = round(value + step / 2, places)
    return float(value)


def fit_labels(cells: Cells, stored: tuple[str, ...] | None = None
               ) -> tuple[np.ndarray, tuple[str, ...]]:
    """(class codes, label names): integer labels are their own codes (no names); text
    labels are coded 0..k-1 in the sorted order of their names (`stored`: the names an
    existing ledger holds). CellError names the row of a missing or unknown label."""
    texts = [None if c is None else _text(c) for c in cells.values]
    with _rows_of(cells):
        for i, t in enumerate(texts):
            if not t:
                raise CellError("missing; every row needs a class label", i)
        if not stored:
            ints = [_integer(t) for t in texts]
            if all(v is not None for v in ints):
                return cells.take(np.asarray(ints, dtype=np.int64)), ()
        names = stored or tuple(sorted(set(texts)))  # type: ignore[arg-type]
        codes = {n: i for i, n in enumerate(names)}
        for i, t in enumerate(texts):
            if t not in codes:
                raise CellError(f"{show_cell(t)} is not one of the ledger's labels "
                                f"{', '.join(map(repr, names))}", i)
    return cells.take(np.asarray([codes[t] for t in texts], dtype=np.int64)), names


def _infer(cells: Sequence[Any], miss: list[bool]) -> str:
    """numeric when every present cell is a number (finite or not: 'nan' is refused as
    a number, not taken for a category), boolean when every one is true/false/yes/no
    (a 0/1 column is numeric), else categorical."""
    present = [c for c, m in zip(cells, miss, strict=True) if not m] if any(miss) else cells
    if present and isinstance(present[0], bool) and all(isinstance(c, bool) for c in present):
        return "boolean"
    if _parses(present) is not None:
        return "numeric"
    if present and all(_boolean(c) is not None for c in present):
        return "boolean"
    return "categorical"


def _parses(cells: Sequence[Any]) -> np.ndarray | None:
    """Every cell as a float64 array, or None when one is no number."""
    if len(cells) and isinstance(cells[0], bool):
        return None
    try:
        return np.asarray(cells, dtype=np.float64)
    except (TypeError, ValueError):
        return None


def _numbers(cells: Sequence[Any], miss: list[bool], fill: float | None) -> np.ndarray:
    """Cells as float64 (missing cells `fill`; None: refused), vectorised when they can
    be; CellError names the first cell that is no finite number."""
    if any(miss):
        if fill is None:
            i = miss.index(True)
            raise CellError(_missing_number(cells[i]), i)
        cells = [fill if m else c for c, m in zip(cells, miss, strict=True)]
    try:
        values = np.asarray(cells, dtype=np.float64)
    except (TypeError, ValueError):
        for i, c in enumerate(cells):
            try:
                if isinstance(c, bool):
                    raise ValueError
                float(c)
            except (TypeError, ValueError):
                raise CellError(f"{show_cell(c)} is not a number", i) from None
        raise
    return _finite(values, cells)


def _finite(values: np.ndarray, cells: Sequence[Any]) -> np.ndarray:
    """`values`, or CellError naming the first that is not finite ('nan', 'inf')."""
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        i = int(bad[0])
        raise CellError(f"{show_cell(cells[i])} is not a finite number", i)
    return values


def _missing_number(cell: Any) -> str:
    what = ("empty" if cell == "" else "missing (null)" if cell is None
            else f"{show_cell(cell)} (missing)")
    return (f"{what}; every feature needs a number (fill or drop the row, or pass --impute "
            "median or --impute mean)")


def _missing(cells: Sequence[Any], markers: frozenset[str]) -> list[bool]:
    return [c is None or (isinstance(c, float) and math.isnan(c))
            or (isinstance(c, str) and c in markers) for c in cells]


def _looks_like_ids(counts: Counter[str], n: int, min_frequency: int) -> bool:
    """Every value distinct, or every value rare with at least one value per two rows:
    a column of ids (or subjects), which as a feature would only be 'other'."""
    if n < 2 or len(counts) < 2:
        return False
    return len(counts) == n or (max(counts.values()) < min_frequency and 2 * len(counts) >= n)


def _boolean(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int) and value in (0, 1):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE:
            return 1.0
        if text in FALSE:
            return 0.0
    return None


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            return None
    return int(f) if math.isfinite(f) and f == int(f) else None


def _text(cell: Any) -> str:
    return cell if isinstance(cell, str) else str(cell)


def show_cell(value: Any, limit: int = 40) -> str:
    """A value for an error message: never a 1 MB string or a 4,000-digit integer."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value) if isinstance(value, str | int | float | bool | type(None)) \
        else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."
