"""The live records a network learner keeps, as one table sorted by id: training and
retraining read rows in that order, so a row's position is a function of the set.
See docs/DESIGN.md (Training as a function of the SET of records)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Self

import numpy as np

from jobs.learners.base import UnknownRecordError, as_ids


@dataclass(frozen=True, eq=False)
class RecordTable:
    """Ids (str), features (float32) and class indices (int64), row ``k`` of each one
    record, sorted by id. Learners that keep more per record extend it with columns."""

    ids: np.ndarray
    X: np.ndarray
    y: np.ndarray

    @classmethod
    def by_id(cls, ids: np.ndarray, X: np.ndarray, y: np.ndarray,
              **columns: np.ndarray) -> Self:
        """The table of these rows (and extra ``columns``), sorted by id."""
        order = np.argsort(ids, kind="stable")
        return cls(ids=ids[order], X=np.ascontiguousarray(X[order], dtype=np.float32),
                   y=np.ascontiguousarray(y[order], dtype=np.int64),
                   **{k: v[order] for k, v in columns.items()})

    @cached_property
    def row(self) -> dict[str, int]:
        """The row of each live id."""
        return {rid: k for k, rid in enumerate(self.ids.tolist())}

    def rows_of(self, ids: Any) -> np.ndarray:
        """Rows of live ids; :class:`UnknownRecordError` for any other."""
        rids = as_ids(ids)
        unknown = [i for i in rids.tolist() if i not in self.row]
        if unknown:
            raise UnknownRecordError(unknown, "unknown or already deleted record id")
        return np.array([self.row[i] for i in rids.tolist()], dtype=np.int64)

    def take(self, keep: np.ndarray) -> Self:
        """The table of rows ``keep`` (a mask or indices), every column."""
        return type(self)(**{f.name: getattr(self, f.name)[keep]
                             for f in dataclasses.fields(self)})
