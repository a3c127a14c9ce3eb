"""The mlp learner on disk: ``meta.json`` and ``state.npz`` (network, records), no pickle.
The LOO set is the guard's to keep (``adopt_loo`` after a load).
See docs/learners.md (mlp: one network, deletions by swap)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from jobs.learners.base import read_bundle_meta, read_bundle_payload, write_bundle
from jobs.learners.mlp.network_state import FORMAT, NetworkState
from jobs.learners.networks.loo_training import LOOConfig, MLPParams
from jobs.learners.networks.records import RecordTable
from jobs.learners.networks.torch_nets import resolve_device

_STATE = "state.npz"


def save(path: str | Path, params: dict[str, Any], state: NetworkState) -> None:
    """Write the bundle of ``state`` (``params``: the constructor's)."""
    params = dict(params)
    params["hidden"] = list(params["hidden"])
    if params["classes"] is not None:
        params["classes"] = np.asarray(list(params["classes"])).tolist()
    meta = {"format": FORMAT, "params": params, "config": state.config.to_dict(),
            "classes": state.classes.tolist(), "classes_dtype": state.classes.dtype.str,
            "record_ids": state.records.ids.tolist(),
            "tombstone_keys": [str(k) for k in state.tombstones.tolist()],
            "platform": state.platform, "content_hash": state.content_hash()}
    arrays = {"X": state.records.X, "y": state.records.y}
    arrays.update({f"W{i}": W for i, W in enumerate(state.network.weights)})
    arrays.update({f"b{i}": b for i, b in enumerate(state.network.biases)})
    write_bundle(path, meta, _STATE, lambda fh: np.savez(fh, **arrays))


def load(path: str | Path) -> tuple[dict[str, Any], NetworkState]:
    """The constructor parameters and the state of a bundle written by :func:`save`;
    checks the content hash."""
    meta = read_bundle_meta(path, FORMAT, "leave-one-out MLP")
    params = dict(meta["params"])
    params["hidden"] = tuple(params["hidden"])
    if params["classes"] is not None:
        params["classes"] = tuple(params["classes"])
    with np.load(io.BytesIO(read_bundle_payload(path, _STATE).read()),
                 allow_pickle=False) as z:
        L = len([k for k in z.files if k.startswith("W")])
        net = MLPParams([z[f"W{i}"] for i in range(L)], [z[f"b{i}"] for i in range(L)])
        X, y = z["X"], z["y"]
    platform = meta["platform"]
    device = resolve_device(params["device"])
    if device.type != platform["device_type"]:
        warnings.warn(f"trained on {platform['device_type']}, loaded on {device.type}: "
                      "updates would mix devices and verify() may report a bit-level "
                      "mismatch", RuntimeWarning, stacklevel=3)
    state = NetworkState(
        config=LOOConfig.from_dict(meta["config"]),
        classes=np.asarray(meta["classes"], dtype=np.dtype(meta["classes_dtype"])),
        device=device, platform=platform,
        records=RecordTable.by_id(np.asarray(meta["record_ids"], dtype=object), X, y),
        tombstones=np.array([int(k) for k in meta["tombstone_keys"]], dtype=np.uint64),
        network=net)
    if state.content_hash() != meta["content_hash"]:
        raise ValueError(f"{path}: content hash mismatch; the bundle is corrupt or altered")
    return params, state
