"""A loaded table's column, dictionary-coded: its distinct cells and each row's index.

A CSV of 10^6 rows holds a few dozen distinct values in most columns; held as Python
strings it is 10^6 objects per column, and fitting its coding touches each. Coded, the
column is one int32 array and its distinct cells, in the order they first appear, so the
first distinct cell that fails a check is the one on the first failing row, and parsing,
counting and encoding work on the distinct cells only.
See docs/tables.md (Loading a table)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Cells:
    """A column's distinct cells (`values`, in order of first appearance) and per row the
    index of its cell (`codes`)."""

    values: list[Any]
    codes: np.ndarray

    def __len__(self) -> int:
        return len(self.codes)

    def row(self, k: int) -> int:
        """The first row holding distinct cell `k` (where an error about it points)."""
        return int(np.argmax(self.codes == k))

    def counts(self) -> list[int]:
        """How many rows hold each distinct cell."""
        return np.bincount(self.codes, minlength=len(self.values)).tolist()

    def rows(self) -> list[Any]:
        """Every row's cell (id columns, which are kept per row)."""
        values = np.empty(len(self.values), dtype=object)
        values[:] = self.values
        return values[self.codes].tolist()

    def take(self, per_value: np.ndarray) -> np.ndarray:
        """Rows of `per_value` (one row per distinct cell) laid out by the column's rows."""
        return per_value[self.codes]

    @classmethod
    def of(cls, cells: Sequence[Any] | np.ndarray) -> Cells:
        """A whole column at once (a Parquet column, a test's list)."""
        builder = CellsBuilder()
        builder.add(cells)
        return builder.cells()


class CellsBuilder:
    """Codes a column chunk by chunk, so a table is never held as one object per cell.

    Each cell is looked up in one dict at C speed (`map(dict.setdefault, ...)`): a value's
    entry is the row it first appears on, so the dict's order and its values are already
    first-appearance order; :meth:`cells` numbers them 0..k-1."""

    def __init__(self) -> None:
        self._first: dict[Any, int] = {}
        self._rows: list[np.ndarray] = []
        self._n = 0

    def add(self, chunk: Sequence[Any] | np.ndarray) -> None:
        """The next rows' cells (hashable values: text, numbers, booleans, None)."""
        if isinstance(chunk, np.ndarray):
            chunk = chunk.tolist()
        n = len(chunk)
        rows = map(self._first.setdefault, chunk, range(self._n, self._n + n))
        self._rows.append(np.fromiter(rows, np.int64, n))
        self._n += n

    def cells(self, strip: bool = False) -> Cells:
        """The column; `strip`: text cells with their surrounding spaces removed."""
        firsts = np.fromiter(self._first.values(), np.int64, len(self._first))
        rows = np.concatenate(self._rows) if self._rows else np.zeros(0, np.int64)
        codes = np.searchsorted(firsts, rows).astype(np.int32)
        values = list(self._first)
        if strip and any(isinstance(v, str) and v != v.strip() for v in values):
            merged: dict[Any, int] = {}
            remap = np.fromiter((merged.setdefault(v.strip() if isinstance(v, str) else v,
                                                   len(merged)) for v in values),
                                np.int32, len(values))
            codes, values = remap[codes], list(merged)
        return Cells(values, codes)
