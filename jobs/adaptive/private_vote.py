"""Private prediction for SISA ensembles: a noisy vote, differentially private in the seeds.

The exponential mechanism over the shards' vote counts, P(c) ~ exp(eps0 v_c / 2): one
shard's randomness moves one vote, so each answer is eps0-DP in the seeds (Gupta et al.),
and (eps0 * max_shards)-iDP in the records.
See docs/guard.md (Private prediction mode)."""

from __future__ import annotations

import numpy as np


def vote_probabilities(votes: np.ndarray, epsilon: float) -> np.ndarray:
    """(n, C) answer probabilities for (n, C) vote counts (exponential mechanism)."""
    if not np.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be a number >= 0, got {epsilon!r}")
    v = np.atleast_2d(np.asarray(votes, dtype=np.float64))
    if v.shape[1] < 2:
        raise ValueError("the noisy vote needs at least two classes")
    z = epsilon * v / 2.0
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def private_vote(votes: np.ndarray, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """One noisy-vote answer per row of (n, C) vote counts."""
    p = vote_probabilities(votes, epsilon)
    u = rng.random((len(p), 1))
    return np.minimum((np.cumsum(p, axis=1) < u).sum(axis=1), p.shape[1] - 1)
