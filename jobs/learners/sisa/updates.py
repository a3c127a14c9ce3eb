"""Deletions and additions of a SISA ensemble: each affected shard retrains from its earliest
affected slice, every other checkpoint is kept. Each update returns a new state; the old
one is left as it was, so a refused request changes nothing.
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jobs.learners.base import UpdateReport
from jobs.learners.sisa.placement import Placement
from jobs.learners.sisa.shard_training import ShardTrainer
from jobs.learners.sisa.state import EnsembleState, Records, Tombstones


def _retrained(state: EnsembleState, records: Records, tombstones: Tombstones,
               from_slice: dict[int, int]) -> tuple[EnsembleState, float]:
    """``state`` with shards ``from_slice`` retrained from those slices; the other shards'
    networks stay the same objects (the guard reads identity as "unchanged")."""
    t0 = time.perf_counter()
    trainer = ShardTrainer(state.spec)
    ckpts, nets = list(state.checkpoints), list(state.nets)
    for s, r in sorted(from_slice.items()):
        start = state.checkpoints[s][r - 1] if r > 0 else None
        ckpts[s] = list(state.checkpoints[s][:r]) + trainer.train(s, records, tombstones, r,
                                                                    start)
        nets[s] = trainer.serving_net(ckpts[s][-1])
    new = dataclasses.replace(state, records=records, tombstones=tombstones, checkpoints=ckpts,
                              nets=nets)
    return new, time.perf_counter() - t0


def delete(state: EnsembleState, rids: np.ndarray) -> tuple[EnsembleState, UpdateReport]:
    """Forget the live records ``rids`` (checked unique and live by the caller)."""
    t0 = time.perf_counter()
    records = state.records
    rows = np.array([records.row[i] for i in rids.tolist()], dtype=np.int64)
    from_slice = _earliest_slices(records.member[rows], records.slice[rows])
    keep = np.ones(len(records.ids), dtype=bool)
    keep[rows] = False
    tombstones = state.tombstones
    if state.spec.config["schedule"] == "loo":
        placement = Placement.of(state.spec)
        tombstones = tombstones.buried(placement.tombstones(rids, records.slice[rows]))
    new, train_s = _retrained(state, records.take(keep), tombstones, from_slice)
    return new, _report("delete", rids, t0, from_slice, new, train_s)


def add(state: EnsembleState, rids: np.ndarray, X: np.ndarray,
        y: np.ndarray) -> tuple[EnsembleState, UpdateReport]:
    """Learn new records (checked by the caller): each joins its keyed shards' last slice
    (``add_slice="last"``) or its keyed slice; a re-added id's tombstones are lifted."""
    t0 = time.perf_counter()
    if len(rids) == 0:
        return state, _report("add", rids, t0, {}, state, 0.0)
    old = state.records
    placement = Placement.of(state.spec)
    records = placement.records(
        np.concatenate([old.ids, rids]), np.concatenate([old.X, X]),
        np.concatenate([old.y, y]), np.concatenate([old.added, np.ones(len(rids), dtype=bool)]))
    new_rows = np.isin(records.ids, rids)
    from_slice = _earliest_slices(records.member[new_rows], records.slice[new_rows])
    # a re-added id's shard retrains from the earliest slice it leaves or joins
    tombstones, left = state.tombstones.lifted(placement.tombstones(rids))
    for s, r0 in left.items():
        from_slice[s] = min(from_slice.get(s, r0), r0)
    new, train_s = _retrained(state, records, tombstones, from_slice)
    return new, _report("add", rids, t0, from_slice, new, train_s)


def _earliest_slices(member: np.ndarray, slices: np.ndarray) -> dict[int, int]:
    """Per shard holding any of these records, the earliest of their slices there."""
    out: dict[int, int] = {}
    for row, r in zip(member, slices.tolist(), strict=True):
        for s in np.flatnonzero(row).tolist():
            out[s] = min(r, out.get(s, r))
    return out


def _report(op: str, ids: np.ndarray, t0: float, from_slice: dict[int, int],
            state: EnsembleState, train_s: float) -> UpdateReport:
    shards = sorted(from_slice)
    member = state.records.member
    retrained_records = int(member[:, shards].any(axis=1).sum()) if shards else 0
    return UpdateReport(
        op=op,  # type: ignore[arg-type]
        record_ids=[str(i) for i in ids],
        guarantee="exact",
        seconds=time.perf_counter() - t0,
        retrained={
            "shards": shards,
            "from_slice": {int(s): int(r) for s, r in sorted(from_slice.items())},
            "n_slices": state.spec.n_slices,
        },
        metrics={
            "train_seconds": train_s,
            "records_in_retrained_shards": float(retrained_records),
            "n_records": float(len(state.records.ids)),
        },
    )

