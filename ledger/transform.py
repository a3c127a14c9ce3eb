"""The input transform: from a feature's own units to the model's input space, [0, 1].

Fitted once, at `ledger init`, on the initial table (per feature: its name, min and
max) and stored in the ledger's schema (`dataset_schema.transform`). Everything that
enters the model's input space goes through it: the initial records, the features of
an `add` request at intake, and every query at `/v1/predict` (which then clips to
[0, 1], as the guard requires). It is never refitted: a deletion does not move the
input space, or every version would have to be retrained.

Scaling one value is ``(x - min) / (max - min)`` in float64 (``x - min`` for a
constant feature, so the value at init maps to 0), the same arithmetic in numpy and
in plain Python, so a record scaled at intake holds exactly the bits the same row
scaled at init would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KIND = "min-max"


@dataclass(frozen=True)
class InputTransform:
    names: tuple[str, ...]
    mins: tuple[float, ...]
    maxs: tuple[float, ...]
    # False for the identity given to ledgers from before the transform was stored
    fitted: bool = True

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
                   tuple(float(f["max"]) for f in feats), fitted=bool(doc.get("fitted", True)))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": KIND, "features": [
            {"name": n, "min": lo, "max": hi}
            for n, lo, hi in zip(self.names, self.mins, self.maxs, strict=True)]}
        if not self.fitted:
            out["fitted"] = False
        return out

    @property
    def spans(self) -> tuple[float, ...]:
        return tuple(hi - lo if hi > lo else 1.0 for lo, hi in zip(self.mins, self.maxs,
                                                                   strict=True))

    def scale(self, X: np.ndarray) -> np.ndarray:
        """Raw rows -> the model's input space (not clipped)."""
        X = np.asarray(X, dtype=np.float64)
        return (X - np.asarray(self.mins)) / np.asarray(self.spans)

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
        return (self.names, self.mins, self.maxs) == (other.names, other.mins, other.maxs)


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
    """What `ledger schema` prints and `GET /v1/schema` answers."""
    t = InputTransform.from_json(schema.transform, schema.n_features)
    return {"name": schema.name, "n_features": schema.n_features,
            "classes": list(schema.classes),
            "input": "raw features, in each feature's own units: scaled as (x - min) / "
                     "(max - min) and clipped to [0, 1]; send \"scaled\": true with "
                     "features already in [0, 1]",
            "transform": "min-max" if t.fitted else
                         "identity (a ledger from before stored transforms: its features "
                         "were scaled to [0, 1] elsewhere)",
            "features": t.describe()}
