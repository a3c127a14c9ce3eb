"""Tables as users export them, written to files for tests (see ledger/census.py's
census_export and docs/tables.md). Not a test module."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def write_csv(path: Path, columns: Mapping[str, Sequence[Any]]) -> Path:
    """The columns as a CSV file with a header line, as a spreadsheet exports them."""
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(columns)
        out.writerows(zip(*columns.values(), strict=True))
    return path


def write_parquet(path: Path, columns: Mapping[str, Sequence[Any]]) -> Path:
    """The columns as a Parquet file: a column of numbers with a '?' in it becomes a
    nullable integer column (null where the CSV has '?'), text stays text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = {}
    for name, values in columns.items():
        if any(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            values = [None if isinstance(v, str) else v for v in values]
        data[name] = values
    pq.write_table(pa.table(data), path)
    return path


def write_arrays_csv(path: Path, columns: Mapping[str, Any]) -> Path:
    """Numpy columns (e.g. :func:`ledger.census.census_columns`) as the rows
    :func:`write_csv` writes (with ``\\n`` line ends), through pyarrow's writer: 10^6
    rows in seconds, with no Python object per cell."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    table = pa.table({name: pa.array(values) for name, values in columns.items()})
    with path.open("wb") as fh:
        fh.write((",".join(columns) + "\n").encode())
        pcsv.write_csv(table, fh, pcsv.WriteOptions(include_header=False,
                                                    quoting_style="none"))
    return path
