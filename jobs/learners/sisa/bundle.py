"""A SISA ensemble on disk: JSON metadata and one torch state file, no pickle; what is
kept of a deleted record is its schedule keys (module docstring of
:mod:`jobs.learners.sisa.ensemble`, "What the saved bundle stores per record")."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from jobs.learners.base import as_ids, read_bundle_meta, read_bundle_payload, write_bundle
from jobs.learners.networks.torch_nets import resolve_device

if TYPE_CHECKING:
    from jobs.learners.sisa.ensemble import SISAEnsemble

FORMAT = "obliviate.sisa/1"
_STATE = "state.pt"


class EnsembleBundle:
    """Saving and loading :class:`jobs.learners.sisa.ensemble.SISAEnsemble`."""

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (JSON) and ``path/state.pt`` (tensors only)."""
        self._check_fitted()
        p = Path(path)
        params = self.get_params(deep=False)
        if params["hidden"] is not None:
            params["hidden"] = list(params["hidden"])
        if params["classes"] is not None:
            params["classes"] = np.asarray(list(params["classes"])).tolist()
        meta = {
            "format": FORMAT,
            "params": params,
            "config": self.config_,
            "seed": str(self.seed_),
            "classes": self.classes_.tolist(),
            "classes_dtype": self.classes_.dtype.str,
            "n_features": self.n_features_in_,
            "record_ids": self.record_ids_.tolist(),
            "tombstone_keys": {str(s): keys.tolist()
                               for s, keys in sorted(self.tombstones_.items())},
            "tombstone_slices": {str(s): sl.tolist()
                                 for s, sl in sorted(self.tombstone_slices_.items())},
            "platform": self.platform_,
            "content_hash": self.content_hash(),
        }
        state = {
            "X": torch.from_numpy(self.X_),
            "y": torch.from_numpy(self.y_),
            "added": torch.from_numpy(self.added_),
            "checkpoints": self.checkpoints_,
        }
        write_bundle(p, meta, _STATE, lambda fh: torch.save(state, fh))

    @classmethod
    def load(cls, path: str | Path) -> SISAEnsemble:
        """Read a bundle written by :meth:`save`; checks the content hash."""
        p = Path(path)
        meta = read_bundle_meta(p, FORMAT, "SISA")
        state = torch.load(read_bundle_payload(p, _STATE), map_location="cpu", weights_only=True)
        params = dict(meta["params"])
        if params["hidden"] is not None:
            params["hidden"] = tuple(params["hidden"])
        config = dict(meta["config"])
        if "schedule" not in config:  # bundles written before schedules existed: Adam
            config.update(schedule="adam", weight_decay=0.0)
            params.update(schedule="adam", weight_decay=0.0)
        config.setdefault("min_steps", 0)  # bundles written before the step floor
        config.setdefault("kernel", "torch")  # ... and before the compiled training loops
        params.setdefault("min_steps", 0)
        if params["classes"] is not None:
            params["classes"] = tuple(params["classes"])
        self = cls(**params)
        self.config_ = config
        self.seed_ = int(meta["seed"])
        self.classes_ = np.asarray(meta["classes"], dtype=np.dtype(meta["classes_dtype"]))
        self.n_features_in_ = int(meta["n_features"])
        self.device_ = resolve_device(self.device)
        self.platform_ = meta["platform"]
        now = self._platform()
        if now != self.platform_:
            warnings.warn(
                f"SISA bundle trained on {self.platform_}, loaded on {now}: further updates "
                "would mix platforms and verify() may report a bit-level mismatch",
                RuntimeWarning,
                stacklevel=2,
            )
        ids = as_ids(meta["record_ids"])
        added = state["added"].numpy().astype(bool)
        data = self._make_data(ids, state["X"].numpy(), state["y"].numpy(), added)
        ckpts = [
            [{k: v.contiguous() for k, v in st.items()} for st in shard]
            for shard in state["checkpoints"]
        ]
        if len(ckpts) != self._S or any(len(c) != self._R for c in ckpts):
            raise ValueError(f"{p}: checkpoint layout does not match n_shards x n_slices")
        if "tombstones" in meta:  # older bundles kept deleted ids: keep only their keys
            tombstones, tomb_slices = self._tombstone_keys(as_ids(meta["tombstones"]))
        else:
            tombstones = {int(s): np.asarray(keys, dtype=np.uint64)
                          for s, keys in meta.get("tombstone_keys", {}).items()}
            # bundles from before sliced "loo" shards: one slice, every tombstone in slice 0
            saved = meta.get("tombstone_slices", {})
            tomb_slices = {s: np.asarray(saved.get(str(s), np.zeros(len(keys))),
                                         dtype=np.int64)
                           for s, keys in tombstones.items()}
        self._commit(data, tombstones, tomb_slices, ckpts)
        if self.content_hash() != meta["content_hash"]:
            raise ValueError(f"{p}: content hash mismatch; the bundle is corrupt or was altered")
        return self
