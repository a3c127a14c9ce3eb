"""The game learner on disk: ``meta.json`` (JSON) and ``state.pt`` (tensors only, no
pickle): the live records, the served network, the surrogate and the frozen attacker.
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jobs.learners import base
from jobs.learners.game.attacks import Attacker
from jobs.learners.game.checks import network_hash
from jobs.learners.game.state import FORMAT, GameRecords, GameState
from jobs.learners.game.training import GameTrainer
from jobs.learners.networks import torch_nets as nets
from jobs.learners.networks.training_spec import TrainingSpec
from jobs.learners.networks.user_network import bundled, save_source

_STATE = "state.pt"


def _object_ids(ids: list[str]) -> np.ndarray:
    out = np.empty(len(ids), dtype=object)
    out[:] = ids
    return out


def save(path: str | Path, params: dict[str, Any], state: GameState) -> None:
    """Write the bundle of ``state`` (``params``: the constructor's)."""
    params = dict(params)
    params["hidden"] = list(params["hidden"])
    params["attack_hidden"] = list(params["attack_hidden"])
    if params["classes"] is not None:
        params["classes"] = np.asarray(list(params["classes"])).tolist()
    spec, records = state.spec, state.records
    meta = {
        "format": FORMAT, "params": params, "config": spec.config, "seed": str(spec.seed),
        "classes": spec.classes.tolist(), "classes_dtype": spec.classes.dtype.str,
        "n_features": spec.n_features, "record_ids": records.ids.tolist(),
        "surrogate_ids": state.surrogate_ids.tolist(), "n_updates": state.n_updates,
        "exact": state.exact,
        "platform": state.platform, "content_hash": network_hash(spec, state.net),
    }
    att = state.attacker.state()
    payload = {"X": torch.from_numpy(records.X), "y": torch.from_numpy(records.y),
               "third": torch.from_numpy(records.third),
               "X_third_ext": torch.from_numpy(state.X_third_ext),
               "net": nets.state_to_cpu(state.net), "surrogate": state.surrogate_state,
               "attacker": att.pop("weights"), "attacker_meta": json.dumps(att)}
    save_source(Path(path), spec.network)
    base.write_bundle(Path(path), meta, _STATE, lambda fh: torch.save(payload, fh))


def load(path: str | Path) -> tuple[dict[str, Any], GameState]:
    """The constructor parameters and the state of a bundle written by :func:`save`;
    checks the content hash."""
    p = Path(path)
    meta = base.read_bundle_meta(p, FORMAT, "game-theoretic NN")
    payload = torch.load(base.read_bundle_payload(p, _STATE), map_location="cpu",
                         weights_only=True)
    params = dict(meta["params"])
    params["hidden"] = tuple(params["hidden"])
    params["attack_hidden"] = tuple(params["attack_hidden"])
    if params["classes"] is not None:
        params["classes"] = tuple(params["classes"])
    config = dict(meta["config"])
    spec = TrainingSpec(config, int(meta["seed"]),
                        np.asarray(meta["classes"], dtype=np.dtype(meta["classes_dtype"])),
                        int(meta["n_features"]), nets.resolve_device(params["device"]),
                        bundled(p, config))
    att = payload["attacker_meta"]
    att = json.loads(att) if isinstance(att, str) else att
    state = GameState(
        spec=spec, platform=meta["platform"],
        records=GameRecords.by_id(_object_ids(meta["record_ids"]), payload["X"].numpy(),
                                  payload["y"].numpy(), third=payload["third"].numpy()),
        X_third_ext=payload["X_third_ext"].numpy().copy(),
        net=GameTrainer(spec).frozen(payload["net"]),
        surrogate_ids=_object_ids(meta["surrogate_ids"]),
        surrogate_state=payload["surrogate"],
        attacker=Attacker.from_state({**att, "weights": payload["attacker"]}).to(spec.device),
        n_updates=int(meta["n_updates"]),
        # bundles from before the flag: exact only if never updated
        exact=bool(meta.get("exact", int(meta["n_updates"]) == 0)))
    if network_hash(spec, state.net) != meta["content_hash"]:
        raise ValueError(f"{p}: content hash mismatch; the bundle is corrupt or was altered")
    return params, state
