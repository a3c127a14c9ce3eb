"""The input transform: from a table's raw columns to the model's input space, [0, 1].

Fitted once, at `ledger init`, on the initial table and stored in the ledger's schema
(`dataset_schema.transform`, covered by the ledger's proof): each raw column's coding
(:mod:`ledger.columns`: numbers, one-hot categories, booleans; the label names) and per
encoded feature its name, min and max. The initial records, additions and queries all
go through it; it is never refitted. Scaling is ``(x - min) / (max - min)`` in float64,
the same arithmetic in numpy and plain Python (bit for bit). See docs/tables.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ledger.columns import OTHER, ColumnCoding

KIND = "min-max"


@dataclass(frozen=True)
class InputTransform:
    names: tuple[str, ...]
    mins: tuple[float, ...]
    maxs: tuple[float, ...]
    # False for the identity given to ledgers from before the transform was stored
    fitted: bool = True
    # the raw columns' codings; () for a table of plain numeric columns (one feature each,
    # named by `names`): such a table's stored document is what it always was
    columns: tuple[ColumnCoding, ...] = ()
    labels: tuple[str, ...] = ()  # the class names of a text label (class i is labels[i])
    na: str | None = None  # the missing-value marker a cell may hold (besides null and "")

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.mins) == len(self.maxs):
            raise ValueError("an input transform needs one name, min and max per feature")

    @property
    def n_features(self) -> int:
        return len(self.names)

    @classmethod
    def fit(cls, X: np.ndarray, names: Sequence[str] | None = None) -> InputTransform:
        """Per column of the (finite) raw table, its min and max widened outward to
        round numbers (:func:`widen`): the stored transform, public at `/v1/schema`,
        holds no record's exact value, and outlives every deletion."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or not len(X):
            raise ValueError("fit the input transform on a non-empty 2-D table")
        names = list(names) if names is not None else [f"x{j}" for j in range(X.shape[1])]
        bounds = [widen(lo, hi) for lo, hi in zip(X.min(axis=0).tolist(),
                                                  X.max(axis=0).tolist(), strict=True)]
        return cls(tuple(str(n) for n in names), tuple(b[0] for b in bounds),
                   tuple(b[1] for b in bounds))

    @classmethod
    def fit_encoded(cls, E: np.ndarray, columns: Sequence[ColumnCoding],
                    labels: tuple[str, ...] = (), na: str | None = None) -> InputTransform:
        """The transform of a table whose columns were encoded by `columns` into `E`
        (one row per record): a numeric feature's range widened as :meth:`fit` does, a
        category's or boolean's 0/1 kept as [0, 1]. Plain numeric columns and integer
        labels give exactly :meth:`fit`'s transform."""
        names = [n for c in columns for n in c.feature_names()]
        if all(c.plain for c in columns) and not labels:
            return cls.fit(E, names)
        E = np.asarray(E, dtype=np.float64)
        numeric = [c.kind == "numeric" for c in columns for _ in range(c.width)]
        bounds = [widen(lo, hi) if num else (0.0, 1.0) for lo, hi, num in zip(
            E.min(axis=0).tolist(), E.max(axis=0).tolist(), numeric, strict=True)]
        return cls(tuple(names), tuple(b[0] for b in bounds), tuple(b[1] for b in bounds),
                   columns=tuple(columns), labels=tuple(labels), na=na)

    @cached_property
    def raw_columns(self) -> tuple[ColumnCoding, ...]:
        """The raw columns a row holds: the stored codings, or one number per feature
        (built once: every row of a request is encoded by them)."""
        return self.columns or tuple(ColumnCoding(n) for n in self.names)

    @cached_property
    def raw_column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.raw_columns)

    def label_name(self, code: int) -> str:
        return self.labels[code] if self.labels else str(code)

    @classmethod
    def identity(cls, n_features: int) -> InputTransform:
        """Features already in [0, 1]: min 0 and max 1 each (scaling changes nothing)."""
        return cls(tuple(f"x{j}" for j in range(n_features)), (0.0,) * n_features,
                   (1.0,) * n_features, fitted=False)

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None, n_features: int) -> InputTransform:
        """The stored form (None: a schema row without one, treated as the identity)."""
        if not doc:
            return cls.identity(n_features)
        if doc.get("kind", KIND) != KIND:
            raise ValueError(f"unknown input transform {doc.get('kind')!r}")
        feats = doc["features"]
        return cls(tuple(str(f["name"]) for f in feats), tuple(float(f["min"]) for f in feats),
                   tuple(float(f["max"]) for f in feats), fitted=bool(doc.get("fitted", True)),
                   columns=tuple(ColumnCoding.from_json(c) for c in doc.get("columns", ())),
                   labels=tuple(str(n) for n in doc.get("labels", ())), na=doc.get("na"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": KIND, "features": [
            {"name": n, "min": lo, "max": hi}
            for n, lo, hi in zip(self.names, self.mins, self.maxs, strict=True)]}
        if not self.fitted:
            out["fitted"] = False
        if self.columns:
            out["columns"] = [c.to_json() for c in self.columns]
        if self.labels:
            out["labels"] = list(self.labels)
        if self.na is not None:
            out["na"] = self.na
        return out

    @property
    def spans(self) -> tuple[float, ...]:
        return tuple(hi - lo if hi > lo else 1.0 for lo, hi in zip(self.mins, self.maxs,
                                                                   strict=True))

    def scale(self, X: np.ndarray) -> np.ndarray:
        """Raw rows -> the model's input space (not clipped); divided in place, so a table
        of 10^6 rows takes one more copy of itself, not two."""
        out = np.asarray(X, dtype=np.float64) - np.asarray(self.mins)
        out /= np.asarray(self.spans)
        return out

    def scale_row(self, x: Sequence[float]) -> list[float]:
        """One raw row, in plain Python (bit for bit what :meth:`scale` gives)."""
        return [(float(v) - lo) / span for v, lo, span in zip(x, self.mins, self.spans,
                                                              strict=True)]

    def unscale(self, X: np.ndarray) -> np.ndarray:
        """The model's input space -> raw units (for examples and demos)."""
        return np.asarray(X, dtype=np.float64) * np.asarray(self.spans) + np.asarray(self.mins)

    def describe(self) -> list[dict[str, Any]]:
        """Per feature its name and range, as `GET /v1/schema` shows them."""
        return [{"name": n, "min": lo, "max": hi}
                for n, lo, hi in zip(self.names, self.mins, self.maxs, strict=True)]

    def same_as(self, other: InputTransform) -> bool:
        def key(t: InputTransform) -> tuple[Any, ...]:
            return t.names, t.mins, t.maxs, t.columns, t.labels, t.na
        return key(self) == key(other)


def widen(lo: float, hi: float, digits: int = 3) -> tuple[float, float]:
    """(lo', hi') with lo' < lo and hi' > hi, multiples of a power of ten that has
    `digits` significant digits of the range (at most one such step, about 1% of the
    range, on each side): round numbers no record holds exactly."""
    scale = hi - lo if hi > lo else max(abs(lo), 1.0)
    exponent = math.floor(math.log10(scale)) - (digits - 1)
    step = 10.0 ** exponent
    places = max(0, -exponent)
    low = round((math.ceil(lo / step) - 1) * step, places)
    while low >= lo:
        low = round(low - step, places)
    high = round((math.floor(hi / step) + 1) * step, places)
    while high <= hi:
        high = round(high + step, places)
    return float(low), float(high)


def schema_document(schema: Any) -> dict[str, Any]:
    """What `ledger schema` prints and `GET /v1/schema` answers: the raw columns (kind,
    categories, imputed value), the label names, and the encoded features' ranges."""
    t = InputTransform.from_json(schema.transform, schema.n_features)
    return {"name": schema.name, "n_features": schema.n_features,
            "classes": list(schema.classes),
            "label_names": [t.label_name(int(c)) for c in schema.classes],
            "input": "rows of raw values, as arrays in column order or objects keyed by "
                     "column name: numbers in their own units, categories as text (an "
                     f"unknown one counts as '{OTHER}'), missing values as null or the "
                     "marker; encoded (one 0/1 feature per category), scaled as (x - min) / "
                     "(max - min) and clipped to [0, 1]; send \"scaled\": true with "
                     "encoded features already in [0, 1]",
            "transform": "min-max" if t.fitted else
                         "identity (a ledger from before stored transforms: its features "
                         "were scaled to [0, 1] elsewhere)",
            "na": t.na,
            "columns": [c.to_json() for c in t.raw_columns],
            "features": t.describe()}
