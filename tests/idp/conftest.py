"""Small LOO sets shared by the iDP tests (trained once per session, ~1 s each)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import make_blobs, make_moons

from jobs.learners.networks.loo_training import LOOSet, train_loo

TINY = dict(hidden=(8, 8), epochs=30, batch_size=8, seed=0)


def scaled(X: np.ndarray) -> np.ndarray:
    return (X - X.min(0)) / (X.max(0) - X.min(0))


def tiny_data(n_classes: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """40 points in [0, 1]^2 with 2 (moons) or 3 (blobs) classes."""
    if n_classes == 2:
        X, y = make_moons(40, noise=0.25, random_state=0)
    else:
        X, y = make_blobs(40, centers=3, cluster_std=1.5, random_state=0)
    return scaled(X), y, [f"r{i:03d}" for i in range(40)]


_CACHE: dict[int, tuple[LOOSet, np.ndarray, np.ndarray, list[str]]] = {}


def tiny_loo(n_classes: int) -> tuple[LOOSet, np.ndarray, np.ndarray, list[str]]:
    if n_classes not in _CACHE:
        X, y, ids = tiny_data(n_classes)
        _CACHE[n_classes] = (train_loo(X, y, ids, **TINY), X, y, ids)
    return _CACHE[n_classes]


@pytest.fixture(params=[2, 3], ids=["2cls", "3cls"])
def tiny(request: pytest.FixtureRequest) -> tuple[LOOSet, np.ndarray, np.ndarray, list[str]]:
    return tiny_loo(request.param)
