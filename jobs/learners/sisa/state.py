"""A fitted SISA ensemble as one object (:class:`EnsembleState`): what every shard trains
under, the live records with their keyed placement, the deleted records' tombstones, the
checkpoints and the served networks. Shard training, updates, checks and the bundle take it
and read its fields; an update makes a new one.
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from jobs.learners.networks.records import RecordTable
from jobs.learners.networks.training_spec import TrainingSpec

FORMAT = "obliviate.sisa/1"
State = dict[str, torch.Tensor]  # one network's weights: a state dict
NO_KEYS = np.zeros(0, dtype=np.uint64)
NO_SLICES = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class EnsembleSpec(TrainingSpec):
    """What every shard trains under (:class:`TrainingSpec`), with the ensemble's shape."""

    @property
    def n_shards(self) -> int:
        return self.config["n_shards"]

    @property
    def n_slices(self) -> int:
        return self.config["n_slices"]


@dataclass(frozen=True, eq=False)
class Records(RecordTable):
    """The live records, sorted by id, with their keyed placement: shard membership
    ``member`` (n, S), ``slice``, origin ``added`` (arrived by ``add``) and batch ``keys``."""

    member: np.ndarray
    slice: np.ndarray
    added: np.ndarray
    keys: np.ndarray

    def of_shard(self, s: int) -> np.ndarray:
        """Rows of shard ``s``'s live records."""
        return np.flatnonzero(self.member[:, int(s)])


@dataclass(frozen=True, eq=False)
class Tombstones:
    """Deleted records kept in the ``"loo"`` schedule: per shard that holds any, their
    sorted uint64 schedule keys under the shard's seed, and each one's slice (aligned)."""

    keys: dict[int, np.ndarray] = field(default_factory=dict)
    slices: dict[int, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys.values())

    def buried(self, new: Tombstones) -> Tombstones:
        """These tombstones and ``new`` ones, each shard's sorted by key."""
        keys, slices = dict(self.keys), dict(self.slices)
        for s, added in new.keys.items():
            k = np.concatenate([keys.get(s, NO_KEYS), added])
            sl = np.concatenate([slices.get(s, NO_SLICES), new.slices[s]])
            order = np.argsort(k)
            keys[s], slices[s] = k[order], sl[order]
        return Tombstones(keys, slices)

    def lifted(self, back: Tombstones) -> tuple[Tombstones, dict[int, int]]:
        """Without the keys in ``back`` (records added again), and per shard that lost
        one, the earliest slice it left (its shard retrains from there)."""
        keys, slices, earliest = {}, {}, {}
        for s, k in self.keys.items():
            gone = np.isin(k, back.keys.get(s, NO_KEYS))
            if not gone.all():
                keys[s], slices[s] = k[~gone], self.slices[s][~gone]
            if gone.any():
                earliest[s] = int(self.slices[s][gone].min())
        return Tombstones(keys, slices), earliest

    def in_stage(self, s: int, stage: int) -> list[int]:
        """Shard ``s``'s keys of records deleted from slices ``0..stage``."""
        keys = self.keys.get(s, NO_KEYS)
        return keys[self.slices.get(s, np.zeros(len(keys), dtype=np.int64)) <= stage].tolist()


@dataclass(frozen=True, eq=False)
class EnsembleState:
    """Everything a fitted ensemble is: ``checkpoints[s][r]`` is shard ``s`` after stage
    ``r``, ``nets[s]`` the served network of its last checkpoint; ``platform`` where it
    was trained (recorded at fit, kept by the bundle)."""

    spec: EnsembleSpec
    platform: dict[str, Any]
    records: Records
    tombstones: Tombstones
    checkpoints: list[list[State]]
    nets: list[nn.Module]

    @property
    def shard_sizes(self) -> np.ndarray:
        """Live records per shard, shape (S,)."""
        return self.records.member.sum(axis=0)

    @property
    def active(self) -> np.ndarray:
        """Shards with at least one live record (the ones that vote)."""
        return self.shard_sizes > 0
