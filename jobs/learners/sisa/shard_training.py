"""How a SISA shard trains (the module docstring of :mod:`jobs.learners.sisa.ensemble` states the
schedules): the Adam stages, the masked LOO schedule stage by stage, and what a caller
needs to reproduce a shard outside the ensemble (the guard's LOO sets)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from jobs.learners.networks.loo_training import MLPParams, train_single
from jobs.learners.networks.torch_nets import (
    build_net,
    init_net,
    mlp_state,
    n_batches,
    stage_epochs,
    state_to_cpu,
    train_stage,
)

State = dict[str, torch.Tensor]
Tombstones = dict[int, np.ndarray]  # shard -> sorted uint64 schedule keys (non-empty only)
_NO_KEYS = np.zeros(0, dtype=np.uint64)
_NO_SLICES = np.zeros(0, dtype=np.int64)
# Stage r of a sliced "loo" shard numbers its epochs from r * STAGE_EPOCH_STRIDE, so that
# every stage's batches are keyed apart (stage 0 of a one-slice shard: from 0, as before).
STAGE_EPOCH_STRIDE = 1 << 20


class ShardTraining:
    """Training of one shard: the part of :class:`jobs.learners.sisa.ensemble.SISAEnsemble` that
    fit, updates and verify share."""

    def _new_net(self) -> torch.nn.Module:
        return build_net(
            self.config_["model"],
            self.n_features_in_,
            len(self.classes_),
            self.config_["hidden"],
        )

    def _train_shard(
        self,
        s: int,
        data: dict[str, np.ndarray],
        tombstones: Tombstones,
        tomb_slices: Tombstones,
        from_slice: int,
        start: State | None,
    ) -> list[State]:
        """Checkpoints of stages ``from_slice .. R-1`` of shard ``s`` on ``data``.

        ``start`` is the checkpoint after stage ``from_slice - 1`` (ignored when
        ``from_slice == 0``: the shard starts from its seed-only initialisation).
        ``data`` holds the live records' arrays sorted by id; ``tombstones`` the
        deleted records' keys per shard and ``tomb_slices`` their slices, aligned
        (``schedule="loo"`` only). This one function serves fit, delete, add and verify:
        the same kernels and shapes.
        """
        cfg = self.config_
        if cfg["schedule"] == "loo":
            return self._train_shard_loo(s, data, tombstones, tomb_slices, from_slice, start)
        net = self._new_net()
        if from_slice == 0:
            init_net(net, self._init_seed(s))
        else:
            assert start is not None
            net.load_state_dict(start)
        net.to(self.device_)
        rows = np.flatnonzero(data["member"][:, s])
        Xs = torch.from_numpy(data["X"][rows]).to(self.device_)
        ys = torch.from_numpy(data["y"][rows]).to(self.device_)
        keys = data["keys"][rows]
        slices = data["slice"][rows]
        out: list[State] = []
        with self._threads():
            for r in range(from_slice, self._R):
                sel = np.flatnonzero(slices <= r)
                if len(sel):
                    idx = torch.from_numpy(sel).to(self.device_)
                    train_stage(
                        net,
                        Xs.index_select(0, idx),
                        ys.index_select(0, idx),
                        keys[sel],
                        seed=self.seed_,
                        stage_key=(s, r),
                        epochs=self._epochs(len(sel)),
                        batch_size=cfg["batch_size"],
                        lr=cfg["lr"],
                        kernel=cfg["kernel"],
                    )
                out.append(state_to_cpu(net))
        return out

    def _epochs(self, n_records: int) -> int:
        """Epochs of a stage of ``n_records`` live records (the ``min_steps`` floor)."""
        cfg = self.config_
        return stage_epochs(n_records, cfg["batch_size"], cfg["epochs_per_slice"],
                            cfg.get("min_steps", 0))

    def _loo_args(self, s: int, n_records: int, tombstones: Tombstones,
                  tomb_slices: Tombstones, stage: int) -> dict[str, Any]:
        cfg = self.config_
        keys = tombstones.get(s, _NO_KEYS)
        in_stage = tomb_slices.get(s, np.zeros(len(keys), dtype=np.int64)) <= stage
        return {
            "n_classes": len(self.classes_),
            "hidden": tuple(cfg["hidden"]),
            "epochs": self._epochs(n_records),
            "batch_size": cfg["batch_size"],
            "lr": cfg["lr"],
            "weight_decay": cfg["weight_decay"],
            "seed": self._init_seed(s),
            "n_batches": n_batches(n_records, cfg["batch_size"]),
            "tombstones": keys[in_stage].tolist(),
            "device": self.device_,
            "kernel": cfg["kernel"],
        }

    def _train_shard_loo(self, s: int, data: dict[str, np.ndarray], tombstones: Tombstones,
                         tomb_slices: Tombstones, from_slice: int,
                         start: State | None) -> list[State]:
        """Stages ``from_slice .. R-1`` of shard ``s``, each a
        :func:`jobs.learners.networks.loo_training.train_single` run (schedule ``"loo"``) on the
        live records of
        slices ``0..r`` and the tombstones of those slices, continuing from the stage before."""
        rows = np.flatnonzero(data["member"][:, s])
        slices = data["slice"][rows]
        params = None
        if from_slice > 0:
            assert start is not None
            params = MLPParams.from_state(start)
        out: list[State] = []
        for r in range(from_slice, self._R):
            sel = rows[slices <= r]
            params = train_single(
                data["X"][sel], data["y"][sel], data["ids"][sel].tolist(),
                init=params, first_epoch=r * STAGE_EPOCH_STRIDE,
                **self._loo_args(s, len(sel), tombstones, tomb_slices, r))
            out.append(mlp_state(params.weights, params.biases))
        return out

    def shard_training_args(self, s: int, n_records: int | None = None,
                            stage: int | None = None) -> dict[str, Any]:
        """Keyword arguments of :func:`jobs.learners.networks.loo_training.train_loo` /
        ``train_single`` /
        ``train_slots`` that reproduce stage ``stage`` (default: the last) of shard ``s``
        (schedule ``"loo"`` only), for ``n_records`` live records in the stage (default:
        the shard's current count in slices ``0..stage``; ``n_records`` only sets
        ``n_batches`` and, through it, ``epochs`` under a ``min_steps`` floor).

        One slice: ``train_loo(*self.shard_records(s), **self.shard_training_args(s))``
        gives the served shard network as its ``N`` bit for bit (same device type, torch
        build, CPU capability and thread count); with ``n_records = n_s - 1`` its
        ``N_{-x}`` are the shard models after ``delete([x])``. Sliced: stage ``r`` runs on
        the records of slices ``0..r`` (:meth:`shard_slices`), from the checkpoint of
        stage ``r - 1``, with ``first_epoch`` set here.
        """
        self._check_fitted()
        if self.config_.get("schedule") != "loo":
            raise ValueError("only schedule='loo' shards are LOO-schedule networks "
                             f"(this ensemble trains with {self.config_.get('schedule')!r})")
        if not 0 <= int(s) < self._S:
            raise ValueError(f"shard index {s} out of range 0..{self._S - 1}")
        r = self._R - 1 if stage is None else int(stage)
        if not 0 <= r < self._R:
            raise ValueError(f"stage {stage} out of range 0..{self._R - 1}")
        n = (int((self.shard_slices(int(s)) <= r).sum()) if n_records is None
             else int(n_records))
        args = self._loo_args(int(s), n, self.tombstones_, self.tombstone_slices_, r)
        if self._R > 1:
            args["first_epoch"] = r * STAGE_EPOCH_STRIDE
        return args

    def shard_slices(self, s: int) -> np.ndarray:
        """The slice of each of shard ``s``'s live records, in :meth:`shard_records` order."""
        self._check_fitted()
        return self.slice_of_[self.member_[:, int(s)]].copy()

    def shard_records(self, s: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Shard ``s``'s live records: ids (sorted), features (float32), class indices."""
        self._check_fitted()
        rows = np.flatnonzero(self.member_[:, int(s)])
        return self.record_ids_[rows].tolist(), self.X_[rows].copy(), self.y_[rows].copy()

    def shard_state(self, s: int) -> State:
        """A CPU copy of shard ``s``'s served weights (state dict)."""
        self._check_fitted()
        return state_to_cpu(self._nets[int(s)])

    def _serving_net(self, state: State) -> torch.nn.Module:
        net = self._new_net()
        net.load_state_dict(state)
        net.to(self.device_)
        net.eval()
        for p in net.parameters():
            p.requires_grad_(False)
        return net
