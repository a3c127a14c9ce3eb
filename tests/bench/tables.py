"""Generated tables the benchmarks share (nothing is downloaded)."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import make_classification


def classification(n: int, quantise: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """make_classification(n, 20 features, 10 informative, seed 0); with `quantise`,
    features 0-9 cut to 4 levels and 10-19 to 16 (equal-frequency bins): most thresholds
    tie, as on tables of ordinal categories and counts."""
    X, y = make_classification(n_samples=n, n_features=20, n_informative=10, random_state=0)
    if quantise:
        for j in range(20):
            levels = 4 if j < 10 else 16
            cuts = np.quantile(X[:, j], np.linspace(0, 1, levels + 1)[1:-1])
            X[:, j] = np.digitize(X[:, j], cuts).astype(np.float64)
    return X, y
