"""What the network learners' constructors accept, declared the way scikit-learn validates
it (``_parameter_constraints``), plus the two kinds of value its own constraints do not
cover: numbers that refuse ``True``/``False`` (Python counts them as ints, and a seed or an
epoch count of ``True`` is a mistake) and layer widths.
See docs/DESIGN.md (Training as a function of the SET of records)."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np
from sklearn.utils._param_validation import Interval, Options


class Strict(Interval):
    """An :class:`~sklearn.utils._param_validation.Interval` that refuses bools."""

    def is_satisfied_by(self, val: Any) -> bool:
        return not isinstance(val, bool | np.bool_) and super().is_satisfied_by(val)


def count(low: int, high: int | None = None) -> Strict:
    """Integers ``>= low`` (and ``<= high``), no bools."""
    return Strict(Integral, low, high, closed="left" if high is None else "both")


def number(low: float | None, high: float | None, closed: str) -> Strict:
    """Finite real numbers between ``low`` and ``high`` (``closed`` as for ``Interval``)."""
    return Strict(Real, low, high, closed=closed)


SEED = Strict(Integral, None, None, closed="neither")


class LabelSmoothing(Strict):
    """A loss given as its label-smoothing value, a float in [0, 1): named so in errors."""

    def __init__(self) -> None:
        super().__init__(Real, 0, 1, closed="left")

    def __str__(self) -> str:
        return "a label-smoothing value (a float in [0, 1))"


class Widths(Options):
    """Hidden layer widths: a sequence (possibly empty) of positive ints, not a string."""

    def __init__(self) -> None:
        super().__init__(Sequence, set())

    def is_satisfied_by(self, val: Any) -> bool:
        if isinstance(val, str | bytes) or not isinstance(val, Sequence | np.ndarray):
            return False
        return all(isinstance(h, Integral) and not isinstance(h, bool | np.bool_) and h >= 1
                   for h in val)

    def __str__(self) -> str:
        return "a sequence of positive ints"

