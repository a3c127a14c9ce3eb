"""Label-only answers that are eps-iDP with respect to the current training set.

LUCID's rule: a query whose margin exceeds its class's verified bound gets its label;
every other query gets the exponential mechanism, drawn once per cell of a fixed grid from
a keyed function of (deployment secret, version, cell) so noise cannot be averaged away.
Which queries are certain is the caller's (:func:`lucid_certain`, :func:`sisa_certain`).
See docs/guard.md (Noised answers)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jobs.adaptive.private_vote import vote_probabilities

GRID_BITS = 8  # 256 cells per coordinate of [0, 1]


def grid_cells(X: np.ndarray) -> np.ndarray:
    """(n, d) integer cell coordinates of the queries (their noise cells)."""
    return np.floor(np.asarray(X, dtype=np.float64) * (1 << GRID_BITS)).astype(np.int64)


def cell_centres(cells: np.ndarray) -> np.ndarray:
    """The centre of each cell, clipped to [0, 1] (where the noised label is computed)."""
    return np.clip((cells + 0.5) / (1 << GRID_BITS), 0.0, 1.0).astype(np.float32)


class CellNoise:
    """The uniform number behind a cell's noisy answer: HMAC-SHA256(secret, version, cell).

    The secret is the deployment's (derived from its HMAC key), so every serving process
    draws the same; without it the draws are unpredictable."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def uniform(self, version: str, cell: bytes) -> float:
        msg = version.encode() + b"\x00" + cell
        digest = hmac.new(self._secret, msg, hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "little") / 2.0**64

    def choice(self, version: str, cell: bytes, p: np.ndarray) -> int:
        """A class drawn from probabilities `p` by the cell's uniform (inverse CDF)."""
        u = self.uniform(version, cell)
        return int(min(np.searchsorted(np.cumsum(p), u, side="right"), len(p) - 1))


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
    """Turns (labels, certainty) into answers: the label, or the noisy label of the
    query's cell (docs/guard.md, "Noised answers").

    `bind(version, sound)` ties the answers to one model version; answers of an older
    model are never replayed for a new one. `sound=False` is noise-all mode: every
    query goes through the mechanism (used while no bound for the serving model is
    verified). `secret` keys the draws (`random_state`: a secret derived from it, for
    reproducible tests; neither: a random one, private to this guard).
    """

    def __init__(self, n_classes: int, epsilon: float = 1.0, memo_size: int = 100_000,
                 random_state: int | None = None, secret: bytes | None = None) -> None:
        self.n_classes = n_classes
        self.epsilon = epsilon
        self.memo = LRUMemo(memo_size)
        self.counts = GuardCounts()
        self.version: str | None = None
        self.sound = False
        if secret is None:
            secret = (secrets.token_bytes(32) if random_state is None else
                      hashlib.sha256(f"obliviate-guard-noise:{random_state}".encode()).digest())
        self.noise = CellNoise(secret)

    def bind(self, version: str, sound: bool) -> None:
        if version != self.version:
            self.memo.clear()
        self.version, self.sound = version, sound

    def answer(self, X: np.ndarray, labels: np.ndarray, certain: np.ndarray,
               label_at: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Labels to publish for clipped queries X (one row per query); `label_at(C)`
        gives the model's class index at points C (the cells' centres)."""
        out = np.asarray(labels, dtype=np.int64).copy()
        certain = np.asarray(certain, dtype=bool) & self.sound
        self.counts.certain += int(certain.sum())
        noisy = np.flatnonzero(~certain)
        if noisy.size == 0:
            return out
        self.counts.noised += len(noisy)
        keys, cells = self._cells(X[noisy])
        answers, pending = self._recall(keys)
        if pending:
            centre_labels = label_at(cell_centres(cells[list(pending.values())]))
            for key, lab in zip(pending, centre_labels.tolist(), strict=True):
                p = mechanism_probabilities(int(lab), self.n_classes, self.epsilon)
                answers[key] = self._draw(key, p)
        self.counts.memo_hits += len(keys) - len(pending)  # every answer but a fresh draw
        out[noisy] = [answers[k] for k in keys]
        return out

    def answer_votes(self, X: np.ndarray, votes_at: Callable[[np.ndarray], np.ndarray],
                     epsilon: float, spend: Callable[[int], None]) -> np.ndarray:
        """Private prediction mode: every answer is the noisy vote of the query's cell
        (:func:`jobs.adaptive.private_vote.vote_probabilities` at `epsilon` over the vote
        counts `votes_at` gives at the cell's centre).

        `spend(k)` is called with the number of fresh cells before any is drawn; it
        raises to refuse them (budget spent), and then nothing is answered or stored.
        """
        keys, cells = self._cells(X)
        answers, pending = self._recall(keys)
        spend(len(pending))
        if pending:
            votes = votes_at(cell_centres(cells[list(pending.values())]))
            for key, v in zip(pending, votes, strict=True):
                answers[key] = self._draw(key, vote_probabilities(v, epsilon)[0])
        self.counts.noised += len(keys)
        self.counts.memo_hits += len(keys) - len(pending)
        return np.array([answers[k] for k in keys], dtype=np.int64)

    def _recall(self, keys: list[bytes]) -> tuple[dict[bytes, int], dict[bytes, int]]:
        """Answers of cells this process answered before, and the cells still to draw
        (each with the index of its first query)."""
        answers: dict[bytes, int] = {}
        pending: dict[bytes, int] = {}
        for j, key in enumerate(keys):
            if key in answers or key in pending:
                continue
            hit = self.memo.get(key)
            if hit is None:
                pending[key] = j
            else:
                answers[key] = hit
        return answers, pending

    def _draw(self, key: bytes, p: np.ndarray) -> int:
        label = self.noise.choice(self.version or "", key, p)
        self.memo.put(key, label)
        return label

    @staticmethod
    def _cells(X: np.ndarray) -> tuple[list[bytes], np.ndarray]:
        cells = grid_cells(X)
        return [row.tobytes() for row in cells], cells
