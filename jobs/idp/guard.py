"""Label-only answers that are eps-iDP with respect to the current training set.

LUCID's rule (papers/NOTES.md §1): a query whose margin exceeds the verified
bound beta for its predicted class is answered with the label, because no
leave-one-out model could answer differently there; every other query is
answered by the exponential mechanism, and that answer is memoised so that
repeating the query does not average the noise away. Without a sound bound
(after a change, while a new one is computed) every query is noised.

Which queries are "certain" depends on the model: `lucid_certain` for one
network with per-class bounds, `sisa_certain` for a SISA ensemble with
per-shard bounds. The guard itself only sees labels and a certainty mask.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


def clip_unit(X: np.ndarray) -> np.ndarray:
    """Queries are clipped to [0, 1]^d, the box the bound was verified over.

    Adding +0.0 turns -0.0 into 0.0: the memo keys on bytes, and a query must not
    get fresh noise by flipping the sign of a zero coordinate.
    """
    return np.clip(np.asarray(X, dtype=np.float32), 0.0, 1.0) + np.float32(0.0)


def mechanism_probabilities(label: int, n_classes: int, epsilon: float) -> np.ndarray:
    """Exponential mechanism, utility 1 for `label` and 0 otherwise, sensitivity 1."""
    if n_classes < 2:
        raise ValueError("the mechanism needs at least two classes")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    top = np.exp(epsilon / 2.0)
    p = np.full(n_classes, 1.0 / (top + n_classes - 1))
    p[label] = top / (top + n_classes - 1)
    return p


def top_margin(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predicted class (lowest index on ties) and its margin over the runner-up."""
    scores = np.asarray(scores)
    labels = np.argmax(scores, axis=1)
    rows = np.arange(len(scores))
    top = scores[rows, labels]
    others = scores.copy()
    others[rows, labels] = -np.inf
    return labels, top - others.max(axis=1)


def lucid_certain(scores: np.ndarray, betas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One network: certain iff margin > beta of the predicted class (strictly)."""
    labels, margins = top_margin(scores)
    return labels, margins > np.asarray(betas)[labels]


def vote_winner(votes: np.ndarray) -> np.ndarray:
    """The class with most votes; ties go to the lowest class index (argmax does this)."""
    return np.argmax(votes, axis=-1)


def sisa_certain(shard_scores: np.ndarray, shard_betas: np.ndarray,
                 active: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A SISA ensemble's majority vote, and where no single deletion can change it.

    Deleting one record changes one shard's model only. A shard whose margin
    exceeds its bound keeps its vote under every such deletion; a shard at or
    below its bound may vote for any class. The answer is certain iff no one
    such shard, moving its vote to any other class, changes the winner (ties
    broken towards the lowest class, as the ensemble does). A shard that loses
    its last record stops voting; that case is covered, because removing a
    vote from a_s changes the winner only to a class c that moving the vote
    to c would also make the winner. O(shards x classes) per query.

    shard_scores: (S, n, C) per-shard logits; shard_betas: (S, C); active: (S,).
    """
    S, n, C = shard_scores.shape
    active = np.ones(S, dtype=bool) if active is None else np.asarray(active, dtype=bool)
    shard_labels = np.empty((S, n), dtype=np.int64)
    shard_margins = np.empty((S, n))
    for s in range(S):
        shard_labels[s], shard_margins[s] = top_margin(shard_scores[s])
    votes = np.zeros((n, C), dtype=np.int64)
    for s in np.flatnonzero(active):
        np.add.at(votes, (np.arange(n), shard_labels[s]), 1)
    winner = vote_winner(votes)
    certain = np.ones(n, dtype=bool)
    eye = np.eye(C, dtype=np.int64)
    for s in np.flatnonzero(active):
        a = shard_labels[s]
        fragile = shard_margins[s] <= shard_betas[s][a]
        if not fragile.any():
            continue
        idx = np.flatnonzero(fragile)
        moved = votes[idx] - eye[a[idx]]  # (k, C): the shard's vote withdrawn
        # every alternative vote b at once: (k, C, C) with row b = moved + e_b
        alternatives = moved[:, None, :] + eye[None, :, :]
        flips = vote_winner(alternatives) != winner[idx, None]
        certain[idx] &= ~flips.any(axis=1)
    return winner, certain


class LRUMemo:
    """Remembers noised answers; the oldest entry goes when full (evictions counted)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("the memo needs room for at least one answer")
        self.size = size
        self.evictions = 0
        self._items: OrderedDict[bytes, int] = OrderedDict()

    def get(self, key: bytes) -> int | None:
        label = self._items.get(key)
        if label is not None:
            self._items.move_to_end(key)
        return label

    def put(self, key: bytes, label: int) -> None:
        self._items[key] = label
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class GuardCounts:
    certain: int = 0
    noised: int = 0  # including answers replayed from the memo
    memo_hits: int = 0


class LabelGuard:
    """Turns (labels, certainty) into answers: the label, or a memoised noisy label.

    `bind(version, sound)` ties the memo to one model version; answers of an
    older model are never replayed for a new one. `sound=False` is noise-all
    mode: every query goes through the mechanism (used while no bound for the
    serving model is verified).
    """

    def __init__(self, n_classes: int, epsilon: float = 1.0, memo_size: int = 100_000,
                 random_state: int | None = None) -> None:
        self.n_classes = n_classes
        self.epsilon = epsilon
        self.memo = LRUMemo(memo_size)
        self.counts = GuardCounts()
        self.version: str | None = None
        self.sound = False
        self._rng = np.random.default_rng(random_state)

    def bind(self, version: str, sound: bool) -> None:
        if version != self.version:
            self.memo.clear()
        self.version, self.sound = version, sound

    def answer(self, X: np.ndarray, labels: np.ndarray, certain: np.ndarray) -> np.ndarray:
        """Labels to publish for clipped queries X (one row per query)."""
        out = np.asarray(labels, dtype=np.int64).copy()
        certain = np.asarray(certain, dtype=bool) & self.sound
        self.counts.certain += int(certain.sum())
        for i in np.flatnonzero(~certain):
            key = np.ascontiguousarray(X[i], dtype=np.float32).tobytes()
            hit = self.memo.get(key)
            self.counts.noised += 1
            if hit is not None:
                self.counts.memo_hits += 1
                out[i] = hit
                continue
            p = mechanism_probabilities(int(out[i]), self.n_classes, self.epsilon)
            out[i] = int(self._rng.choice(self.n_classes, p=p))
            self.memo.put(key, int(out[i]))
        return out
