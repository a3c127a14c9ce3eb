"""The Stackelberg game of one deletion (Liu et al.): the leader pulls the network towards the
surrogate on ``D_third`` while keeping the retain set, the follower pushes the frozen
attacker's verdict on the forget set towards ``lam``.
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from jobs.learners.game.attacks import Attacker, pair_features
from jobs.learners.game.config import GameRules

_M63 = (1 << 63) - 1


@dataclass(frozen=True)
class Players:
    """What the game is played with: the frozen attacker ``M_A``, the surrogate ``M_r'``
    and the seed of the game's random batches."""

    attacker: Attacker
    surrogate: nn.Module
    seed: int


def _optimizer(rules: GameRules, params: list[nn.Parameter],
               lr: float) -> torch.optim.Optimizer:
    if rules.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    return torch.optim.SGD(params, lr=lr, foreach=False)


def play(net: nn.Module, retain: tuple[torch.Tensor, torch.Tensor], X_forget: torch.Tensor,
         X_third: torch.Tensor, players: Players, rules: GameRules) -> dict[str, float]:
    """Play ``rules.rounds`` rounds on ``net`` (in place), leader then follower steps;
    returns the last losses. ``retain``: the retain set's (features, class indices)."""
    Xr, yr = retain
    dev = Xr.device
    with torch.no_grad():
        p_o = F.softmax(net(X_forget), dim=1)
        p_s = F.softmax(players.surrogate(X_third), dim=1) if len(X_third) else None
    params = list(net.parameters())
    for p in params:
        p.requires_grad_(True)
    opt_l = _optimizer(rules, params, rules.leader_lr)
    opt_f = _optimizer(rules, params, rules.follower_lr)
    rng = np.random.default_rng(players.seed & _M63)

    def pick(n: int, k: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(rng.choice(n, size=k, replace=False))).to(
            dev)

    nr, nt, nf = len(Xr), len(X_third), len(X_forget)
    bf = nf if rules.forget_batch_size is None else min(nf, rules.forget_batch_size)
    loss_l = loss_f = float("nan")
    net.train()
    for _ in range(rules.rounds):
        for _ in range(rules.leader_steps):
            ir = pick(nr, min(nr, rules.retain_batch_size))
            loss = rules.ce_weight * F.cross_entropy(net(Xr[ir]), yr[ir])
            if p_s is not None:
                it = pick(nt, min(nt, rules.third_batch_size))
                gap = F.softmax(net(X_third[it]), dim=1) - p_s[it]
                loss = loss + rules.distance_weight * gap.norm(dim=1).mean()
            opt_l.zero_grad(set_to_none=True)
            loss.backward()
            opt_l.step()
            loss_l = float(loss.detach())
        for _ in range(rules.follower_steps):
            idx = pick(nf, bf) if bf < nf else torch.arange(nf, device=dev)
            a = players.attacker.prob(pair_features(p_o[idx], F.softmax(net(X_forget[idx]),
                                                                         dim=1)))
            loss = (a - rules.lam).abs().mean()
            opt_f.zero_grad(set_to_none=True)
            loss.backward()
            opt_f.step()
            loss_f = float(loss.detach())
    net.eval()
    for p in params:
        p.requires_grad_(False)
    return {"leader_loss": loss_l, "follower_loss": loss_f}
