"""What the DaRE forest's modules share: keyed mixing, index ranges, the x log x table, node
kinds. See docs/learners.md (How a DaRE update equals a retrain)."""

from __future__ import annotations

import itertools
import math

import numpy as np

# ----------------------------------------------------------------------------- keyed mixing

_U64 = np.uint64
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_GOLD = _U64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S32, _S11 = _U64(30), _U64(27), _U64(31), _U64(32), _U64(11)
_TAG_GATTR = _U64(0x243F6A8885A308D3)
_TAG_THR = _U64(0x13198A2E03707344)
_TAG_RATTR = _U64(0xA4093822299F31D0)
_TAG_DRAW = _U64(0x082EFA98EC4E6C89)
_INV53 = 2.0**-53

LEAF, RANDOM, GREEDY = 0, 1, 2
# why a node is a leaf (0: it is not)
_W_DEPTH, _W_SMALL, _W_PURE, _W_CONST, _W_MSL = 1, 2, 3, 4, 5


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (a bijection of uint64), elementwise on a uint64 array (array
    integer arithmetic wraps silently; only numpy scalars would warn, so x is made 1-D)."""
    x = np.atleast_1d(x)
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def _h2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Keyed hash of two uint64 arrays (broadcasting)."""
    return _mix(np.atleast_1d(a) ^ _mix(np.atleast_1d(b) + _GOLD))


def node_keys(tree_keys: np.ndarray, tree: np.ndarray, path: np.ndarray) -> np.ndarray:
    """The keyed hash naming each node (tree, heap path): every keyed choice at a node
    derives from it."""
    return _h2(tree_keys[tree], np.asarray(path).astype(_U64))


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l), as int64."""
    lens = np.asarray(lens, dtype=np.int64)
    tot = int(lens.sum())
    if tot == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lens)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lens), lens) + np.arange(
        tot, dtype=np.int64
    )


def _midpoint(v1: np.ndarray, v2: np.ndarray) -> np.ndarray:
    """Threshold between adjacent values: the midpoint, or v1 where it rounds onto v2."""
    t = 0.5 * v1 + 0.5 * v2  # finite inputs: no overflow, no NaN
    bad = ~((t >= v1) & (t < v2))
    if bad.any():
        t = np.where(bad, v1, t)
    return t


# Process-wide: `generation_` names the forest's current state, so a guard can tell
# cheaply that the forest it certified has not changed since (no re-hashing per query).
_GENERATIONS = itertools.count(1)

_XLOGX: list[np.ndarray] = [np.zeros(1)]


def _xlogx(n: int) -> np.ndarray:
    """Table of x * log(x) for x = 0..n-1 (0 at 0), computed one value at a time with math.log
    so an entry never depends on the table's length or on SIMD code paths."""
    tab = _XLOGX[0]
    if len(tab) < n:
        m = max(n, 2 * len(tab), 1024)
        ext = np.fromiter(
            (x * math.log(x) for x in range(len(tab), m)), dtype=np.float64, count=m - len(tab)
        )
        tab = np.concatenate([tab, ext])
        _XLOGX[0] = tab
    return tab


def score_table(gini: bool, n: int) -> np.ndarray:
    """The x log x table (at least n entries) that entropy scores read; a dummy for Gini."""
    return _xlogx(n) if not gini else _XLOGX[0][:1]
