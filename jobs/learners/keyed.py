"""Keyed randomness: every random choice is a pure function of (seed, what it is for).

A shared random stream makes "update" and "retrain from scratch" draw different
numbers; a pseudo-random function keyed by the seed and by a name for the choice
(tree, node path, attribute, record id, epoch, ...) draws the same number in
both, which is what lets exactness be checked bit for bit.
See docs/DESIGN.md (Guarantees)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

_U64 = float(2**64)


def prf_u64(seed: int, *parts: object) -> int:
    """A 64-bit pseudo-random integer keyed by ``seed`` and ``parts``."""
    h = hashlib.blake2b(digest_size=8, key=int(seed).to_bytes(16, "little", signed=True))
    for p in parts:
        b = str(p).encode()
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little")


def prf_uniform(seed: int, *parts: object) -> float:
    """A uniform draw in [0, 1) keyed by ``seed`` and ``parts``."""
    return prf_u64(seed, *parts) / _U64


def prf_u64_many(seed: int, tag: object, ids: Iterable[object]) -> np.ndarray:
    """``prf_u64(seed, tag, id)`` for each id, as a uint64 array."""
    return np.fromiter((prf_u64(seed, tag, i) for i in ids), dtype=np.uint64)


def prf_uniform_many(seed: int, tag: object, ids: Iterable[object]) -> np.ndarray:
    """``prf_uniform(seed, tag, id)`` for each id, as a float64 array."""
    return prf_u64_many(seed, tag, ids).astype(np.float64) / _U64
