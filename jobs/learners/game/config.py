"""The configuration a game-unlearning network works under (``config_``): its constructor's
parameters, checked, in the order saved bundles hold them, and the groups its parts read
(the attacker's :class:`~jobs.learners.game.attacks.AttackConfig`, the game's
:class:`GameRules`).
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.learners.game.attacks import AttackConfig

_CHOICES = ("model", "attack_negatives", "optimizer", "method")
_COUNTS = ("epochs", "batch_size", "attack_steps", "attack_batch_size", "retain_batch_size",
           "third_batch_size", "rounds", "leader_steps", "follower_steps", "add_epochs",
           "finetune_epochs")
_NUMBERS = ("lr", "attack_lr", "leader_lr", "follower_lr", "distance_weight", "ce_weight",
            "add_replay", "third_fraction", "surrogate_fraction", "attack_fraction", "lam")


def resolve_config(params: dict[str, Any]) -> dict[str, Any]:
    """``config_`` of a learner with these (validated) constructor parameters:
    ``surrogate_epochs=None`` becomes ``epochs``; ints and floats as such."""
    cfg: dict[str, Any] = {name: params[name] for name in _CHOICES}
    cfg.update(hidden=[int(h) for h in params["hidden"]],
               attack_hidden=[int(h) for h in params["attack_hidden"]])
    cfg.update({name: int(params[name]) for name in _COUNTS})
    cfg["surrogate_epochs"] = int(params["surrogate_epochs"] or params["epochs"])
    for name in ("forget_batch_size", "cpu_threads"):
        cfg[name] = None if params[name] is None else int(params[name])
    cfg.update({name: float(params[name]) for name in _NUMBERS})
    return cfg


def attack_config(cfg: dict[str, Any]) -> AttackConfig:
    """How the frozen attacker ``M_A`` is built and trained."""
    return AttackConfig(tuple(cfg["attack_hidden"]), cfg["attack_steps"], cfg["attack_lr"],
                        cfg["attack_batch_size"])


@dataclass(frozen=True)
class GameRules:
    """How one deletion's game is played (the class docstring of
    :class:`~jobs.learners.game.stackelberg.GameUnlearningNet` says what each means)."""

    rounds: int
    leader_steps: int
    follower_steps: int
    lam: float
    optimizer: str
    leader_lr: float
    follower_lr: float
    distance_weight: float
    ce_weight: float
    retain_batch_size: int
    third_batch_size: int
    forget_batch_size: int | None

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> GameRules:
        return cls(**{name: cfg[name] for name in cls.__dataclass_fields__})
