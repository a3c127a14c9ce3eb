"""A fitted :class:`jobs.learners.mlp.leave_one_out.LeaveOneOutMLP` as one object: the frozen
training definition, the live records, the deleted records' schedule keys, the served
network and the LOO set kept for swaps. The retrain from scratch is defined here, once.
See docs/learners.md (mlp: one network, deletions by swap)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from jobs.learners.networks.loo_training import LOOConfig, LOOSet, MLPParams, train_single
from jobs.learners.networks.records import RecordTable

FORMAT = "obliviate.loo-mlp/1"
NO_KEYS = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True, eq=False)
class NetworkState:
    """Everything the learner is once fitted. ``config`` is ``T``'s definition with its
    frozen batch count; ``tombstones`` the sorted schedule keys of deleted records;
    ``loo`` the LOO set of exactly these records (or None)."""

    config: LOOConfig
    classes: np.ndarray
    device: torch.device
    platform: dict[str, Any]
    records: RecordTable
    tombstones: np.ndarray
    network: MLPParams
    loo: LOOSet | None = None

    @cached_property
    def network_hash(self) -> str:
        return self.network.content_hash()

    def kernel(self) -> str:
        """The compiled loop on the CPU; torch's batched ops on CUDA."""
        return "compiled" if self.device.type == "cpu" else "torch"

    def train_args(self) -> dict[str, Any]:
        """``train_single`` / ``train_loo`` arguments of THE retraining definition."""
        cfg = self.config
        return {"n_classes": cfg.n_classes, "hidden": cfg.hidden, "epochs": cfg.epochs,
                "batch_size": cfg.batch_size, "lr": cfg.lr, "weight_decay": cfg.weight_decay,
                "seed": cfg.seed, "n_batches": cfg.n_batches,
                "tombstones": self.tombstones.tolist(), "device": self.device,
                "kernel": self.kernel()}

    def retrained(self) -> MLPParams:
        """The network ``T`` gives on the live records: the retrain from scratch."""
        r = self.records
        return train_single(r.X, r.y, r.ids.tolist(), **self.train_args())

    def with_records(self, records: RecordTable, tombstones: np.ndarray,
                     network: MLPParams | None = None) -> NetworkState:
        """This state on other records and tombstones, with ``network`` (default: the
        retrain); the LOO set is dropped (it is of other records)."""
        new = dataclasses.replace(self, records=records, tombstones=tombstones, loo=None)
        return dataclasses.replace(new, network=new.retrained() if network is None else network)

    def content_hash(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        h.update(json.dumps(self.classes.tolist()).encode())
        h.update(json.dumps(self.records.ids.tolist()).encode())
        h.update(self.tombstones.tobytes())
        h.update(self.network_hash.encode())
        return h.hexdigest()
