"""Membership-inference attackers: the pair attack on (original, unlearned) posteriors
(Chen et al. 2021, the game's frozen ``M_A``) and a Shokri-style attack on one model.
Both are the same small, differentiable torch network (:class:`Attacker`) on different
features (:func:`pair_features`, :func:`member_features`).
See docs/learners.md (Privacy evaluation)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from jobs.learners.keyed import prf_u64, prf_u64_many
from jobs.learners.networks.torch_nets import (
    MLP,
    deterministic,
    init_net,
    n_batches,
    state_to_cpu,
    train_stage,
)


@dataclass(frozen=True)
class AttackConfig:
    """How an attacker network is built and trained (all choices the papers leave open).

    ``steps``: Adam steps, whatever the number of examples (whole epochs of keyed
    mini-batches of ``batch_size``: ``ceil(steps / batches per epoch)`` epochs), so
    a small attack set is not under-trained and a large one costs a bounded time.
    """

    hidden: tuple[int, ...] = (32,)
    steps: int = 500
    lr: float = 0.01
    batch_size: int = 64


DEFAULT_ATTACK = AttackConfig()


_LOG_FLOOR = math.log(1e6)


def pair_features(p_o: torch.Tensor, p_u: torch.Tensor) -> torch.Tensor:
    """Pair features of (original, unlearned) posteriors, shape (n, 5 C).

    Classes ordered by ``p_o`` descending; the row is ``[p_o, p_u, l_o, l_u, l_o - l_u]``
    in that order, with ``l = max(log p, log 1e-6) / log 1e6 in [-1, 0]`` (the
    log-probabilities show the changes of small probabilities that a confident
    model's posteriors hide). Differentiable in ``p_u`` (and in ``p_o`` through
    the gathered values; the order is a constant). Chen et al.'s concatenation and
    difference variants; ordering by ``p_o`` makes the attack class-agnostic (an attacker
    trained on some deletions applies to others).
    """
    order = torch.argsort(p_o.detach(), dim=1, descending=True, stable=True)
    po = p_o.gather(1, order)
    pu = p_u.gather(1, order)
    lo = torch.log(po.clamp_min(1e-6)) / _LOG_FLOOR
    lu = torch.log(pu.clamp_min(1e-6)) / _LOG_FLOOR
    return torch.cat([po, pu, lo, lu, lo - lu], dim=1)


def pair_features_np(p_o: np.ndarray, p_u: np.ndarray) -> np.ndarray:
    """:func:`pair_features` on numpy probability arrays (float32 result)."""
    with torch.no_grad():
        f = pair_features(torch.as_tensor(np.asarray(p_o, dtype=np.float32)),
                          torch.as_tensor(np.asarray(p_u, dtype=np.float32)))
    return f.numpy()


def member_features(p: np.ndarray, y_idx: np.ndarray) -> np.ndarray:
    """Shokri-style features of one model's posteriors: sorted p, p_y, scaled log-loss.

    The log-loss is ``-log max(p_y, 1e-6) / log 1e6``, in [0, 1]: Shokri et al.'s
    posterior vector made label-aware in one model instead of one attack model per class.
    A label index < 0 (a label the model does not know) counts as ``p_y = 0``.
    """
    p = np.asarray(p, dtype=np.float64)
    yi = np.asarray(y_idx, dtype=np.int64)
    py = np.where(yi >= 0, p[np.arange(len(p)), np.maximum(yi, 0)], 0.0)
    loss = -np.log(np.maximum(py, 1e-6)) / _LOG_FLOOR
    return np.column_stack([-np.sort(-p, axis=1), py, loss]).astype(np.float32)


class Attacker:
    """An MLP with a two-way softmax: :meth:`prob` is P(positive | features).

    Trained with the keyed, deterministic ``train_stage`` (Adam, cross-entropy) on a
    class-balanced set (the smaller class repeated cyclically up to the larger one's
    size); differentiable in its input, which the game's follower needs.
    """

    def __init__(self, n_features: int, config: AttackConfig = DEFAULT_ATTACK,
                 seed: int = 0) -> None:
        self.n_features = int(n_features)
        self.config = config
        self.seed = int(seed)
        self.net = init_net(MLP(self.n_features, 2, config.hidden), prf_u64(seed, "attacker"))
        self.net.eval()

    def fit(self, feats: np.ndarray, labels: np.ndarray) -> Attacker:
        """Train on feature rows with labels in {0, 1}, class-balanced by repetition."""
        feats = np.asarray(feats, dtype=np.float32)
        labels = np.asarray(labels, dtype=np.int64)
        pos, neg = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
        if len(pos) == 0 or len(neg) == 0:
            raise ValueError("an attacker needs examples of both classes")
        m = max(len(pos), len(neg))
        rows = np.concatenate([np.resize(pos, m), np.resize(neg, m)])
        keys = prf_u64_many(self.seed, "attack-row", range(len(rows)))
        device = next(self.net.parameters()).device
        for p in self.net.parameters():
            p.requires_grad_(True)
        cfg = self.config
        train_stage(self.net, torch.from_numpy(feats[rows]).to(device),
                    torch.from_numpy(labels[rows]).to(device), keys, seed=self.seed,
                    stage_key=("attacker",), batch_size=cfg.batch_size, lr=cfg.lr,
                    epochs=max(1, -(-cfg.steps // n_batches(len(rows), cfg.batch_size))))
        self.freeze()
        return self

    def freeze(self) -> Attacker:
        """No gradients into the attacker's weights (they still flow into its input)."""
        self.net.eval()
        for p in self.net.parameters():
            p.requires_grad_(False)
        return self

    def to(self, device: torch.device) -> Attacker:
        self.net.to(device)
        return self

    def prob(self, feats: torch.Tensor) -> torch.Tensor:
        """P(positive) per row, differentiable in ``feats``."""
        return F.softmax(self.net(feats), dim=1)[:, 1]

    def predict_proba(self, feats: np.ndarray) -> np.ndarray:
        """P(positive) per row of a numpy feature array (float64)."""
        device = next(self.net.parameters()).device
        with deterministic(), torch.inference_mode():
            x = torch.from_numpy(np.asarray(feats, dtype=np.float32)).to(device)
            return self.prob(x).double().cpu().numpy()

    def state(self) -> dict[str, Any]:
        """Everything :meth:`from_state` needs (a CPU state dict and the config)."""
        return {"n_features": self.n_features, "hidden": list(self.config.hidden),
                "steps": self.config.steps, "lr": self.config.lr,
                "batch_size": self.config.batch_size, "seed": self.seed,
                "weights": state_to_cpu(self.net)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Attacker:
        cfg = AttackConfig(tuple(state["hidden"]), int(state["steps"]), float(state["lr"]),
                           int(state["batch_size"]))
        a = cls(int(state["n_features"]), cfg, int(state["seed"]))
        a.net.load_state_dict(state["weights"])
        return a.freeze()


def _folds(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Fold index per row: a random permutation dealt round-robin into k folds."""
    out = np.empty(n, dtype=np.int64)
    out[rng.permutation(n)] = np.arange(n) % k
    return out


def cross_val_attack(pos: np.ndarray, neg: np.ndarray, *, folds: int = 3, seed: int = 0,
                     config: AttackConfig = DEFAULT_ATTACK) -> tuple[np.ndarray, np.ndarray]:
    """Out-of-fold attack probabilities of positive and negative feature rows.

    Each fold's rows are scored by an attacker trained on the other folds, so every
    probability comes from an attacker that never saw that row. ``folds`` is capped
    at the number of positives (and of negatives); fewer than 2 of either: all nan.
    """
    k = min(int(folds), len(pos), len(neg))
    if k < 2:
        return np.full(len(pos), np.nan), np.full(len(neg), np.nan)
    rng = np.random.default_rng(prf_u64(seed, "cv-folds") & ((1 << 63) - 1))
    fp, fn = _folds(len(pos), k, rng), _folds(len(neg), k, rng)
    out_p, out_n = np.empty(len(pos)), np.empty(len(neg))
    for j in range(k):
        feats = np.concatenate([pos[fp != j], neg[fn != j]])
        labels = np.r_[np.ones((fp != j).sum()), np.zeros((fn != j).sum())]
        att = Attacker(pos.shape[1], config, prf_u64(seed, "cv", j) & 0xFFFFFFFF)
        att.fit(feats, labels)
        out_p[fp == j] = att.predict_proba(pos[fp == j])
        out_n[fn == j] = att.predict_proba(neg[fn == j])
    return out_p, out_n


def train_attacker(pos: np.ndarray, neg: np.ndarray, *, seed: int = 0,
                   config: AttackConfig = DEFAULT_ATTACK) -> Attacker:
    """An :class:`Attacker` trained on positive and negative feature rows."""
    feats = np.concatenate([pos, neg])
    labels = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    return Attacker(feats.shape[1], config, seed).fit(feats, labels)
