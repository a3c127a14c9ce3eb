"""The adaptive deletion attack on SISA (Gupta et al., Sec. 6), as an evaluation.

Networks are overconfident on the records they trained on. So, looking at
the published shard models, guess that each training record lives in the
shard whose model is most confident in its true label; delete the records
guessed to lie in the first k/2 shards ("targeted"), let SISA retrain, and
record the statistic 1[mean test accuracy of the targeted shards < that of
the others]. Under retraining from scratch the partition is independent of
what was published, the shards are exchangeable, and the statistic has
expectation 0.5; a mean clearly above 0.5 shows that the deletions were
chosen using the seeds, which SISA's exactness does not cover.

Two ways of publishing (``mode``):

* ``"plain"``: the shard models themselves (white box, the paper's setting);
* ``"private"``: only answers of the private prediction mode
  (:func:`jobs.adaptive.private_vote.private_vote`, eps0 per answer) to one
  query per training record. Those answers are ensemble labels: they name no
  shard, so the attacker cannot rank shards by confidence. It deletes the
  records whose published answer is their true label (those the model seems
  to remember) that its own coin puts in the first half of the shards, the
  best it can do without shard information; the statistic then measures
  whether what was published still leaked the seeds.
"""

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
