"""A fitted :class:`jobs.learners.game.stackelberg.GameUnlearningNet` as one object
(:class:`GameState`): what its networks train under, the live records (training ones and
held-out ``D_third``), the served network, the surrogate and the frozen attacker. Training,
the game, the checks and the bundle take it and read its fields; an update makes a new one.
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from jobs.learners.game.attacks import Attacker
from jobs.learners.networks.records import RecordTable
from jobs.learners.networks.training_spec import TrainingSpec

FORMAT = "obliviate.game/1"


@dataclass(frozen=True, eq=False)
class GameRecords(RecordTable):
    """The live records sorted by id; ``third`` marks the held-out ``D_third`` ones (the
    network never trains on them)."""

    third: np.ndarray

    @property
    def train(self) -> np.ndarray:
        """Rows the network trains on."""
        return np.flatnonzero(~self.third)


@dataclass(frozen=True, eq=False)
class GameState:
    """Everything a fitted learner is. ``X_third_ext`` are the third-party inputs given
    to ``fit``; ``surrogate_state`` the weights of the surrogate ``M_r'``, trained on the
    records ``surrogate_ids``; ``n_updates`` counts updates (it keys their random
    choices); ``exact``: the network is ``M_o`` trained from scratch on the live training
    records (at ``fit`` or by :func:`jobs.learners.game.checks.exact_state`), with no
    approximate update since."""

    spec: TrainingSpec
    platform: dict[str, Any]
    records: GameRecords
    X_third_ext: np.ndarray
    net: nn.Module
    surrogate_ids: np.ndarray
    surrogate_state: dict[str, torch.Tensor]
    attacker: Attacker
    n_updates: int = 0
    exact: bool = True

    @property
    def X_third(self) -> np.ndarray:
        """``D_third``: held-out records, then the given ``X_third``."""
        return np.concatenate([self.records.X[self.records.third], self.X_third_ext])
