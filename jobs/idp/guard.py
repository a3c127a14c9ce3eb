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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jobs.adaptive.private_vote import vote_probabilities


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
                 active: np.ndarray | None = None, max_shards: int = 1
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A SISA ensemble's majority vote, and where no single deletion can change it.

    Deleting one record changes the models of the shards holding it only: one
    shard for a partition, at most ``max_shards`` with independent sampling. A
    shard whose margin exceeds its bound keeps its vote under every such
    deletion; a shard at or below its bound (fragile) may vote for any class.

    The winner w (ties to the lowest class, as the ensemble does) changes iff
    some class c can end up with v'_c > v'_w (or equal with c < w). Moving a
    fragile shard's vote from w to c gains c two votes on w, from a third class
    one, from c none; a shard that loses its last record only withdraws its
    vote, which gains less. So the largest gain of c on w from changing at most
    m = max_shards fragile shards is 2 min(m, f_w) + min(m - min(m, f_w), f_o)
    (f_w fragile shards voting w, f_o fragile shards voting neither w nor c),
    and the answer is certain iff no c reaches w with it. For m = 1 this is
    "no single fragile shard moving its vote to any class changes the winner".
    O(shards x n + n x classes).

    shard_scores: (S, n, C) per-shard logits; shard_betas: (S, C); active: (S,).
    """
    S, n, C = shard_scores.shape
    if isinstance(max_shards, bool) or int(max_shards) != max_shards or max_shards < 1:
        raise ValueError(f"max_shards must be a positive integer, got {max_shards!r}")
    active = np.ones(S, dtype=bool) if active is None else np.asarray(active, dtype=bool)
    rows = np.arange(n)
    votes = np.zeros((n, C), dtype=np.int64)
    fragile = np.zeros((n, C), dtype=np.int64)  # fragile active shards voting each class
    for s in np.flatnonzero(active):
        a, margin = top_margin(shard_scores[s])
        np.add.at(votes, (rows, a), 1)
        weak = margin <= np.asarray(shard_betas[s])[a]
        np.add.at(fragile, (rows[weak], a[weak]), 1)
    winner = vote_winner(votes)
    m = int(max_shards)
    f_w = fragile[rows, winner]
    moved_w = np.minimum(m, f_w)  # (n,)
    f_other = fragile.sum(axis=1)[:, None] - f_w[:, None] - fragile  # (n, C)
    gain = 2 * moved_w[:, None] + np.minimum(m - moved_w[:, None], f_other)
    gap = votes[rows, winner][:, None] - votes - gain
    classes = np.arange(C)[None, :]
    reaches = (gap < 0) | ((gap == 0) & (classes < winner[:, None]))
    reaches[rows, winner] = False
    return winner, ~reaches.any(axis=1)


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

    def answer_votes(self, X: np.ndarray, votes: np.ndarray, epsilon: float,
                     spend: Callable[[int], None]) -> np.ndarray:
        """Private prediction mode: every answer is the noisy vote over (n, C) vote counts
        (:func:`jobs.adaptive.private_vote.vote_probabilities` at `epsilon`), memoised.

        `spend(k)` is called with the number of fresh answers before any is drawn; it
        raises to refuse them (budget spent), and then nothing is answered or stored.
        """
        keys = [np.ascontiguousarray(row, dtype=np.float32).tobytes() for row in X]
        known = {k: self.memo.get(k) for k in dict.fromkeys(keys)}
        spend(sum(v is None for v in known.values()))
        out = np.empty(len(keys), dtype=np.int64)
        fresh: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            self.counts.noised += 1
            label = known[key] if known[key] is not None else fresh.get(key)
            if label is None:
                p = vote_probabilities(votes[i], epsilon)[0]
                label = fresh[key] = int(self._rng.choice(self.n_classes, p=p))
                self.memo.put(key, label)
            else:
                self.counts.memo_hits += 1
            out[i] = label
        return out
