"""What makes a SISA ensemble checkable: content hashes of its shard networks and
checkpoints, and verification (retrain from scratch, compare bit for bit).
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np

from jobs.learners.base import VerifyReport
from jobs.learners.networks.torch_nets import hash_state, state_to_cpu, states_equal
from jobs.learners.sisa.placement import Placement
from jobs.learners.sisa.shard_training import ShardTrainer
from jobs.learners.sisa.state import FORMAT, EnsembleSpec, EnsembleState, State


def _header(spec: EnsembleSpec) -> bytes:
    cfg = spec.config
    head = {
        "format": FORMAT,
        "classes": [str(c) for c in spec.classes.tolist()],
        "n_features": spec.n_features,
        "model": cfg["model"],
        "hidden": cfg.get("hidden"),  # absent: a user network under Adam
        "aggregation": cfg["aggregation"],
        "n_shards": spec.n_shards,
    }
    if cfg.get("sampling", "partition") != "partition":
        head.update(sampling=cfg["sampling"], shard_prob=cfg["shard_prob"])
    if "network" in cfg:  # the user's network: its import path, source hash and params
        head.update(network=cfg["network"])
    return json.dumps(head, sort_keys=True).encode()


def _hash_of(spec: EnsembleSpec, finals: list[State], active: np.ndarray) -> str:
    h = hashlib.sha256(_header(spec))
    for s, st in enumerate(finals):
        h.update(f"|shard {s} active={bool(active[s])}|".encode())
        h.update(hash_state(st).encode())
    return h.hexdigest()


def content_hash(state: EnsembleState) -> str:
    """SHA-256 over the served shard weights (bit for bit), active mask, classes, config."""
    return _hash_of(state.spec, [state_to_cpu(n) for n in state.nets], state.active)


def shard_hash(state: EnsembleState, s: int) -> str:
    """Hash of shard ``s``'s served weights."""
    return hash_state(state_to_cpu(state.nets[s]))


def checkpoint_hash(state: EnsembleState, s: int, r: int) -> str:
    """Hash of shard ``s``'s checkpoint after stage ``r``."""
    return hash_state(state.checkpoints[s][r])


def _verify_shards(state: EnsembleState,
                   shards: list[int]) -> tuple[list[State], dict[str, Any]]:
    trainer = ShardTrainer(state.spec)
    fresh_finals: list[State] = []
    mismatched: list[list[int]] = []
    served_mismatch: list[int] = []
    for s in shards:
        fresh = trainer.train(s, state.records, state.tombstones, 0, None)
        fresh_finals.append(fresh[-1])
        for r in range(state.spec.n_slices):
            if not states_equal(fresh[r], state.checkpoints[s][r]):
                mismatched.append([s, r])
        if not states_equal(state_to_cpu(state.nets[s]), state.checkpoints[s][-1]):
            served_mismatch.append(s)
    detail = {
        "definition": "every shard re-initialised from the seed and all slices retrained "
        "on the live records with their recorded origin-based slices (and the "
        "deleted records' schedule keys as masked tombstones, schedule 'loo')",
        "n_tombstones": len(state.tombstones),
        "shards_checked": list(shards),
        "checkpoints_checked": len(shards) * state.spec.n_slices,
        "mismatched_checkpoints": mismatched,
        "served_differs_from_checkpoint": served_mismatch,
        "assignment_errors": Placement.of(state.spec).errors(state.records),
        "n_records": len(state.records.ids),
        "platform": state.spec.platform(),
    }
    return fresh_finals, detail


def verify(state: EnsembleState) -> VerifyReport:
    """Retrain every shard from scratch on the live records and compare bit for bit."""
    t0 = time.perf_counter()
    finals, detail = _verify_shards(state, list(range(state.spec.n_shards)))
    retrained = _hash_of(state.spec, finals, state.active)
    return _verify_report(content_hash(state), retrained, detail, t0)


def verify_shard(state: EnsembleState, s: int) -> VerifyReport:
    """Retrain only shard ``s`` from scratch and compare its checkpoints and weights."""
    if not 0 <= int(s) < state.spec.n_shards:
        raise ValueError(f"shard index {s} out of range 0..{state.spec.n_shards - 1}")
    t0 = time.perf_counter()
    finals, detail = _verify_shards(state, [int(s)])
    return _verify_report(shard_hash(state, int(s)), hash_state(finals[0]), detail, t0)


def _verify_report(served: str, retrained: str, detail: dict[str, Any],
                   t0: float) -> VerifyReport:
    """Exact only if the hashes agree AND every checkpoint and slice assignment did."""
    exact = (served == retrained and not detail["mismatched_checkpoints"]
             and not detail["served_differs_from_checkpoint"]
             and detail["assignment_errors"] == 0)
    return VerifyReport(exact, served, retrained, time.perf_counter() - t0, detail)
