"""A SISA ensemble on disk: JSON metadata and one torch state file, no pickle; what is kept of
a deleted record is its schedule keys. A user network's source is saved beside them and is
what a load runs (checked against the hash the model recorded).
See docs/security.md (What each learner stores per record)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobs.learners.base import as_ids, read_bundle_meta, read_bundle_payload, write_bundle
from jobs.learners.networks.torch_nets import resolve_device
from jobs.learners.networks.user_network import bundled, save_source
from jobs.learners.sisa.checks import content_hash
from jobs.learners.sisa.placement import Placement
from jobs.learners.sisa.shard_training import ShardTrainer
from jobs.learners.sisa.state import FORMAT, EnsembleSpec, EnsembleState, Tombstones

_STATE = "state.pt"


def save(path: str | Path, params: dict[str, Any], state: EnsembleState) -> None:
    """Write ``path/meta.json`` (JSON; ``params`` are the constructor's) and
    ``path/state.pt`` (tensors only)."""
    params = dict(params)
    if params["hidden"] is not None:
        params["hidden"] = list(params["hidden"])
    if params["classes"] is not None:
        params["classes"] = np.asarray(list(params["classes"])).tolist()
    spec, records, tombstones = state.spec, state.records, state.tombstones
    meta = {
        "format": FORMAT,
        "params": params,
        "config": spec.config,
        "seed": str(spec.seed),
        "classes": spec.classes.tolist(),
        "classes_dtype": spec.classes.dtype.str,
        "n_features": spec.n_features,
        "record_ids": records.ids.tolist(),
        "tombstone_keys": {str(s): keys.tolist() for s, keys in sorted(tombstones.keys.items())},
        "tombstone_slices": {str(s): sl.tolist()
                             for s, sl in sorted(tombstones.slices.items())},
        "platform": state.platform,
        "content_hash": content_hash(state),
    }
    save_source(Path(path), spec.network)
    payload = {
        "X": torch.from_numpy(records.X),
        "y": torch.from_numpy(records.y),
        "added": torch.from_numpy(records.added),
        "checkpoints": state.checkpoints,
    }
    write_bundle(Path(path), meta, _STATE, lambda fh: torch.save(payload, fh))


def load(path: str | Path) -> tuple[dict[str, Any], EnsembleState]:
    """The constructor parameters and the state of a bundle written by :func:`save`
    (bundles of earlier formats included); checks the content hash."""
    p = Path(path)
    meta = read_bundle_meta(p, FORMAT, "SISA")
    payload = torch.load(read_bundle_payload(p, _STATE), map_location="cpu", weights_only=True)
    params, config = _upgraded(dict(meta["params"]), dict(meta["config"]))
    spec = EnsembleSpec(config, int(meta["seed"]),
                        np.asarray(meta["classes"], dtype=np.dtype(meta["classes_dtype"])),
                        int(meta["n_features"]), resolve_device(params["device"]),
                        bundled(p, config))
    now = spec.platform()
    if now != meta["platform"]:
        warnings.warn(
            f"SISA bundle trained on {meta['platform']}, loaded on {now}: further updates "
            "would mix platforms and verify() may report a bit-level mismatch",
            RuntimeWarning,
            stacklevel=3,
        )
    placement = Placement.of(spec)
    records = placement.records(as_ids(meta["record_ids"]), payload["X"].numpy(),
                                payload["y"].numpy(), payload["added"].numpy().astype(bool))
    ckpts = [[{k: v.contiguous() for k, v in st.items()} for st in shard]
             for shard in payload["checkpoints"]]
    if len(ckpts) != spec.n_shards or any(len(c) != spec.n_slices for c in ckpts):
        raise ValueError(f"{p}: checkpoint layout does not match n_shards x n_slices")
    trainer = ShardTrainer(spec)
    state = EnsembleState(spec, meta["platform"], records, _tombstones(meta, placement), ckpts,
                          [trainer.serving_net(c[-1]) for c in ckpts])
    if content_hash(state) != meta["content_hash"]:
        raise ValueError(f"{p}: content hash mismatch; the bundle is corrupt or was altered")
    return params, state


def _upgraded(params: dict[str, Any],
              config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parameters and configuration of an older bundle as this version reads them."""
    if params["hidden"] is not None:
        params["hidden"] = tuple(params["hidden"])
    if "schedule" not in config:  # bundles written before schedules existed: Adam
        config.update(schedule="adam", weight_decay=0.0)
        params.update(schedule="adam", weight_decay=0.0)
    config.setdefault("min_steps", 0)  # bundles written before the step floor
    config.setdefault("kernel", "torch")  # ... and before the compiled training loops
    params.setdefault("min_steps", 0)
    if params["classes"] is not None:
        params["classes"] = tuple(params["classes"])
    return params, config


def _tombstones(meta: dict[str, Any], placement: Placement) -> Tombstones:
    if "tombstones" in meta:  # older bundles kept deleted ids: keep only their keys
        return placement.tombstones(as_ids(meta["tombstones"]))
    keys = {int(s): np.asarray(k, dtype=np.uint64)
            for s, k in meta.get("tombstone_keys", {}).items()}
    # bundles from before sliced "loo" shards: one slice, every tombstone in slice 0
    saved = meta.get("tombstone_slices", {})
    return Tombstones(keys, {s: np.asarray(saved.get(str(s), np.zeros(len(k))), dtype=np.int64)
                             for s, k in keys.items()})
