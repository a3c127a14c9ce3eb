"""Rows as clients send them, to `/v1/predict` and in additions: raw values, encoded.

A row is an array in column order or an object keyed by column name; numbers in their
own units, categories as their text, booleans, missing values as null (or the table's
marker). The stored codings (:mod:`ledger.columns`) encode it; min-max scaling is the
caller's next step. Errors name the row and the column. See docs/tables.md.
"""

from __future__ import annotations

from typing import Any

from ledger.columns import CellError, show_cell
from ledger.transform import InputTransform


class RowError(ValueError):
    """A row that cannot be encoded; the message names where it is and the column."""


def encode_row(transform: InputTransform, row: Any, where: str) -> list[float]:
    """One raw row -> its encoded (not yet scaled) features, or RowError saying why not."""
    columns = transform.raw_columns
    if isinstance(row, dict):
        names = transform.raw_column_names
        unknown = [k for k in row if k not in names]
        if unknown:
            raise RowError(f"{where}: unknown column {show_cell(unknown[0])} (GET /v1/schema "
                           f"lists the columns: {_list(list(names))})")
        absent = [n for n in names if n not in row]
        if absent:
            raise RowError(f"{where}: missing column {show_cell(absent[0])} (send null for a "
                           "missing value)")
        values = [row[n] for n in names]
    elif isinstance(row, list):
        if len(row) != len(columns):
            raise RowError(f"{where} has {len(row)} values; the table has {len(columns)} "
                           "columns (GET /v1/schema lists them)")
        values = row
    else:
        raise RowError(f"{where} must be a list of values or an object keyed by column name")
    out: list[float] = []
    for column, value in zip(columns, values, strict=True):
        try:
            out += column.encode(value, transform.na)
        except CellError as exc:
            raise RowError(f"{where}, column {show_cell(column.name)}: {exc}") from None
    return out


def label_code(transform: InputTransform, classes: list[int], label: Any) -> int | None:
    """The class code of an addition's label (a class code, or a text label's name);
    None when it is neither."""
    if isinstance(label, str) and label in transform.labels:
        return transform.labels.index(label)
    if isinstance(label, bool) or not isinstance(label, int) or label not in classes:
        return None
    return label


def _list(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
