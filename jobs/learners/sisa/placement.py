"""Where a record goes in a SISA ensemble: its shards, its slice, its batch key, and what is
kept of it as a tombstone. Every rule is keyed by (seed, id) alone, so placements are
stable under any additions and deletions.
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jobs.learners.keyed import prf_u64, prf_u64_many, prf_uniform_many
from jobs.learners.networks.loo_training import schedule_keys
from jobs.learners.sisa.state import EnsembleSpec, Records, Tombstones


@dataclass(frozen=True)
class Placement:
    """The keyed placement rules of one ensemble (its seed and configuration)."""

    seed: int
    n_shards: int
    n_slices: int
    sampling: str
    shard_prob: float
    add_slice: str

    @classmethod
    def of(cls, spec: EnsembleSpec) -> Placement:
        """The rules of an ensemble of this spec (bundles before independent sampling:
        a partition)."""
        c = spec.config
        return cls(spec.seed, c["n_shards"], c["n_slices"], c.get("sampling", "partition"),
                   c.get("shard_prob", 1.0), c["add_slice"])

    def init_seed(self, s: int) -> int:
        """The seed of shard ``s``'s initial weights and of its ``"loo"`` schedule."""
        return prf_u64(self.seed, "init", s)

    def members(self, ids: np.ndarray) -> np.ndarray:
        """(n, S) booleans: which shards each record belongs to."""
        S = self.n_shards
        if len(ids) == 0:
            return np.zeros((0, S), dtype=bool)
        if self.sampling == "partition":
            shard = (prf_u64_many(self.seed, "shard", ids) % np.uint64(S)).astype(np.int64)
            return np.eye(S, dtype=bool)[shard]
        cols = [prf_uniform_many(self.seed, ("member", s), ids) < self.shard_prob
                for s in range(S)]
        return np.stack(cols, axis=1)

    def slices(self, ids: np.ndarray, added: np.ndarray) -> np.ndarray:
        """Each record's slice: keyed, or the last one for records that arrived by ``add``
        (``add_slice="last"``)."""
        keyed = (prf_u64_many(self.seed, "slice", ids) % np.uint64(self.n_slices)).astype(
            np.int64)
        if self.add_slice == "last":
            return np.where(added, self.n_slices - 1, keyed).astype(np.int64)
        return keyed

    def records(self, ids: np.ndarray, X: np.ndarray, y: np.ndarray,
                added: np.ndarray) -> Records:
        """A record set sorted by id, with its keyed shards, slices and batch keys."""
        added = added.astype(bool)
        return Records.by_id(ids, X, y, member=self.members(ids),
                             slice=self.slices(ids, added), added=added,
                             keys=prf_u64_many(self.seed, "batch", ids))

    def tombstones(self, ids: np.ndarray, slices: np.ndarray | None = None) -> Tombstones:
        """The tombstones of records ``ids`` deleted from ``slices`` (aligned; default 0):
        per shard holding any, their sorted schedule keys under its seed."""
        member = self.members(ids)
        sl = np.zeros(len(ids), dtype=np.int64) if slices is None else slices
        keys, at = {}, {}
        for s in np.flatnonzero(member.any(axis=0)).tolist():
            k = schedule_keys(self.init_seed(s), ids[member[:, s]].tolist())
            order = np.argsort(k)
            keys[s], at[s] = k[order], sl[member[:, s]][order]
        return Tombstones(keys, at)

    def errors(self, records: Records) -> int:
        """Live records whose stored shards or slice differ from the keyed rule (0)."""
        member = self.members(records.ids)
        sl = self.slices(records.ids, records.added)
        return int((member != records.member).any(axis=1).sum() + (sl != records.slice).sum())
