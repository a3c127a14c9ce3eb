"""The adaptive deletion attack on SISA (Gupta et al., Sec. 6), as an evaluation.

Guess each record's shard from what was published (the shard models, or in ``"private"``
mode only noisy ensemble labels), delete those guessed in the first half of the shards,
retrain, and record whether the targeted shards' test accuracy fell below the others'.
Under a retrain from scratch that has expectation 0.5; clearly above shows the seeds leaked.
See docs/guard.md (Private prediction mode)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jobs.adaptive.private_vote import private_vote
from jobs.learners.sisa.ensemble import SISAEnsemble


@dataclass(frozen=True)
class TrialResult:
    statistic: int  # 1[targeted shards' mean test accuracy < the others']
    accuracy: float  # test accuracy of what is published after the deletions
    vote_accuracy: float  # test accuracy of the plain vote of the same ensemble
    deleted: int
    guess_hit_rate: float  # share of training records whose shard guess was right


def shard_guesses(shard_logits: np.ndarray, y_idx: np.ndarray) -> np.ndarray:
    """Per record, the shard whose model gives its true label the highest probability."""
    z = shard_logits.astype(np.float64)
    z -= z.max(axis=2, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=2, keepdims=True)
    return np.argmax(p[:, np.arange(len(y_idx)), y_idx], axis=0)


def shard_accuracies(ens: SISAEnsemble, X: np.ndarray, y_idx: np.ndarray) -> np.ndarray:
    """Test accuracy of every shard model, shape (S,) (a shard left with no records is
    its initialisation: about chance)."""
    return (ens.shard_logits(X).argmax(axis=2) == y_idx[None, :]).mean(axis=1)


def run_trial(params: dict[str, Any], ids: np.ndarray, X: np.ndarray, y: np.ndarray,
              X_test: np.ndarray, y_test: np.ndarray, *, mode: str, seed: int,
              epsilon: float = 1.0) -> TrialResult:
    """Train a SISA ensemble with ``seed``, attack it, delete, and measure."""
    if mode not in ("plain", "private"):
        raise ValueError(f"mode must be 'plain' or 'private', got {mode!r}")
    ens = SISAEnsemble(**{**params, "random_state": seed}).fit(X, y, record_ids=ids)
    S = ens.n_shards
    targeted = np.arange(S) < S // 2
    y_idx = np.searchsorted(ens.classes_, y)
    truth = ens.memberships(ids).argmax(axis=1)
    rng = np.random.default_rng([seed, 0x5eed])
    if mode == "plain":
        guess = shard_guesses(ens.shard_logits(X), y_idx)
        pick = targeted[guess]
    else:
        answers = private_vote(ens.scores(X), epsilon, rng)
        guess = rng.integers(S, size=len(ids))
        pick = (answers == y_idx) & targeted[guess]
    if pick.any():
        ens.delete(ids[pick])
    yt = np.searchsorted(ens.classes_, y_test)
    acc_s = shard_accuracies(ens, X_test, yt)
    stat = int(acc_s[targeted].mean() < acc_s[~targeted].mean())
    votes = ens.scores(X_test)
    vote_accuracy = float((np.argmax(votes, axis=1) == yt).mean())
    accuracy = (vote_accuracy if mode == "plain" else
                float((private_vote(votes, epsilon, rng) == yt).mean()))
    return TrialResult(stat, accuracy, vote_accuracy, int(pick.sum()),
                       float((guess == truth).mean()))


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)
