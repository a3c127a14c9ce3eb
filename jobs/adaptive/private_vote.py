"""Private prediction for SISA ensembles: a noisy vote, differentially private in the seeds.

Gupta et al. (docs/PAPERS.md §3) make SISA safe against deletions chosen
after looking at its answers by publishing only answers that are
differentially private in the training randomness (the shard seeds). Here an
answer is the exponential mechanism over the vote counts v_c of the shards:

    P(answer = c) = exp(eps0 v_c / 2) / sum_b exp(eps0 v_b / 2).

Changing one shard's randomness changes that shard's model only, so one vote
moves: every v_c changes by at most 1 (sensitivity 1) and each answer is
eps0-DP in the seeds. Composing many answers is
:mod:`jobs.adaptive.composition`'s job.

The same answer is also iDP in the records: deleting one record changes the
shards holding it (one for a partition, at most ``max_shards`` with independent
sampling), so it is (eps0 * max_shards)-iDP with respect to the training set.
"""

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
