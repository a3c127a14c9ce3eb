"""What makes a SISA ensemble checkable: content hashes of its shard networks and
checkpoints, and :meth:`verify` (retrain from scratch, compare bit for bit)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import numpy as np

from jobs.learners.base import VerifyReport
from jobs.learners.networks.torch_nets import hash_state, state_to_cpu, states_equal
from jobs.learners.sisa.bundle import FORMAT
from jobs.learners.sisa.shard_training import State


class EnsembleChecks:
    """Hashes and exactness checks of :class:`jobs.learners.sisa.ensemble.SISAEnsemble`."""

    def _header(self) -> bytes:
        head = {
            "format": FORMAT,
            "classes": [str(c) for c in self.classes_.tolist()],
            "n_features": self.n_features_in_,
            "model": self.config_["model"],
            "hidden": self.config_["hidden"],
            "aggregation": self.config_["aggregation"],
            "n_shards": self._S,
        }
        if self.config_.get("sampling", "partition") != "partition":
            head.update(sampling=self.config_["sampling"], shard_prob=self.config_["shard_prob"])
        return json.dumps(head, sort_keys=True).encode()

    def _hash_of(self, finals: list[State], active: np.ndarray) -> str:
        h = hashlib.sha256(self._header())
        for s, st in enumerate(finals):
            h.update(f"|shard {s} active={bool(active[s])}|".encode())
            h.update(hash_state(st).encode())
        return h.hexdigest()

    def content_hash(self) -> str:
        """SHA-256 over the served shard weights (bit for bit), active mask, classes, config."""
        self._check_fitted()
        return self._hash_of([state_to_cpu(n) for n in self._nets], self.active_shards_)

    def shard_hash(self, s: int) -> str:
        """Hash of shard ``s``'s served weights."""
        self._check_fitted()
        return hash_state(state_to_cpu(self._nets[s]))

    def checkpoint_hash(self, s: int, r: int) -> str:
        """Hash of shard ``s``'s checkpoint after stage ``r``."""
        self._check_fitted()
        return hash_state(self.checkpoints_[s][r])

    def _assignment_errors(self) -> int:
        """Live records whose stored shard/slice differ from the keyed rule (should be 0)."""
        member = self._keyed_members(self.record_ids_)
        sl = self._slices_for(self.record_ids_, self.added_)
        return int((member != self.member_).any(axis=1).sum() + (sl != self.slice_of_).sum())

    def _verify_shards(self, shards: list[int]) -> tuple[list[State], dict[str, Any]]:
        data = self._data()
        fresh_finals: list[State] = []
        mismatched: list[list[int]] = []
        served_mismatch: list[int] = []
        for s in shards:
            fresh = self._train_shard(s, data, self.tombstones_, self.tombstone_slices_, 0,
                                      None)
            fresh_finals.append(fresh[-1])
            for r in range(self._R):
                if not states_equal(fresh[r], self.checkpoints_[s][r]):
                    mismatched.append([s, r])
            if not states_equal(state_to_cpu(self._nets[s]), self.checkpoints_[s][-1]):
                served_mismatch.append(s)
        detail = {
            "definition": "every shard re-initialised from the seed and all slices retrained "
            "on the live records with their recorded origin-based slices (and the "
            "deleted records' schedule keys as masked tombstones, schedule 'loo')",
            "n_tombstones": sum(len(keys) for keys in self.tombstones_.values()),
            "shards_checked": list(shards),
            "checkpoints_checked": len(shards) * self._R,
            "mismatched_checkpoints": mismatched,
            "served_differs_from_checkpoint": served_mismatch,
            "assignment_errors": self._assignment_errors(),
            "n_records": len(self.record_ids_),
            "platform": self._platform(),
        }
        return fresh_finals, detail

    def verify(self) -> VerifyReport:
        """Retrain every shard from scratch on the live records and compare bit for bit."""
        self._check_fitted()
        t0 = time.perf_counter()
        finals, detail = self._verify_shards(list(range(self._S)))
        return _verify_report(self.content_hash(), self._hash_of(finals, self.active_shards_),
                              detail, t0)

    def verify_shard(self, s: int) -> VerifyReport:
        """Retrain only shard ``s`` from scratch and compare its checkpoints and weights."""
        self._check_fitted()
        if not 0 <= int(s) < self._S:
            raise ValueError(f"shard index {s} out of range 0..{self._S - 1}")
        t0 = time.perf_counter()
        finals, detail = self._verify_shards([int(s)])
        return _verify_report(self.shard_hash(int(s)), hash_state(finals[0]), detail, t0)


def _verify_report(served: str, retrained: str, detail: dict[str, Any],
                   t0: float) -> VerifyReport:
    """Exact only if the hashes agree AND every checkpoint and slice assignment did."""
    exact = (served == retrained and not detail["mismatched_checkpoints"]
             and not detail["served_differs_from_checkpoint"]
             and detail["assignment_errors"] == 0)
    return VerifyReport(exact, served, retrained, time.perf_counter() - t0, detail)
