"""How a SISA shard trains: the Adam stages, the masked LOO schedule stage by stage, and what
a caller needs to reproduce a shard outside the ensemble (the guard's LOO sets).
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from jobs.learners.keyed import prf_u64
from jobs.learners.networks.loo_training import MLPParams, train_single
from jobs.learners.networks.torch_nets import (
    CROSS_ENTROPY,
    build_net,
    init_net,
    mlp_state,
    n_batches,
    stage_epochs,
    state_to_cpu,
    train_stage,
)
from jobs.learners.networks.user_network import ReluMLP
from jobs.learners.sisa.placement import Placement
from jobs.learners.sisa.state import EnsembleSpec, EnsembleState, Records, State, Tombstones

# Stage r of a sliced "loo" shard numbers its epochs from r * STAGE_EPOCH_STRIDE, so that
# every stage's batches are keyed apart (stage 0 of a one-slice shard: from 0, as before).
STAGE_EPOCH_STRIDE = 1 << 20


@dataclass(frozen=True)
class ShardTrainer:
    """Trains the shards of one ensemble (its spec): the one function fit, delete, add
    and verify share, so they run the same kernels on the same shapes."""

    spec: EnsembleSpec

    def new_net(self, seed: int | None = None) -> torch.nn.Module:
        """An untrained shard network of the ensemble's architecture, initialised from
        ``seed`` (None: left as built, for a state to be loaded into)."""
        spec = self.spec
        if spec.network is not None:  # the user's: its own initialisation, seeded
            return spec.network.build(spec.n_features, spec.n_classes, seed)
        net = build_net(spec.config["model"], spec.n_features, spec.n_classes,
                        spec.config["hidden"])
        return net if seed is None else init_net(net, seed)

    def serving_net(self, state: State) -> torch.nn.Module:
        """A frozen network holding ``state``, on the ensemble's device."""
        net = self.new_net()
        net.load_state_dict(state)
        net.to(self.spec.device)
        net.eval()
        for p in net.parameters():
            p.requires_grad_(False)
        return net

    def train(self, s: int, records: Records, tombstones: Tombstones, from_slice: int,
              start: State | None) -> list[State]:
        """Checkpoints of stages ``from_slice .. R-1`` of shard ``s`` on ``records``.

        ``start`` is the checkpoint after stage ``from_slice - 1`` (ignored when
        ``from_slice == 0``: the shard starts from its seed-only initialisation);
        ``tombstones`` are used by the ``"loo"`` schedule only.
        """
        if self.spec.config["schedule"] == "loo":
            return self._train_loo(s, records, tombstones, from_slice, start)
        return self._train_adam(s, records, from_slice, start)

    def _train_adam(self, s: int, records: Records, from_slice: int,
                    start: State | None) -> list[State]:
        spec, cfg, device = self.spec, self.spec.config, self.spec.device
        if from_slice == 0:
            net = self.new_net(Placement.of(spec).init_seed(s))
        else:
            assert start is not None
            net = self.new_net()
            net.load_state_dict(start)
        net.to(device)
        rows = records.of_shard(s)
        Xs = torch.from_numpy(records.X[rows]).to(device)
        ys = torch.from_numpy(records.y[rows]).to(device)
        keys = records.keys[rows]
        slices = records.slice[rows]
        out: list[State] = []
        with spec.threads():
            for r in range(from_slice, spec.n_slices):
                sel = np.flatnonzero(slices <= r)
                if len(sel):
                    idx = torch.from_numpy(sel).to(device)
                    with self._user_training(s, r):
                        train_stage(net, Xs.index_select(0, idx), ys.index_select(0, idx),
                                    keys[sel], seed=spec.seed, stage_key=(s, r),
                                    epochs=self.epochs(len(sel)),
                                    batch_size=cfg["batch_size"], lr=cfg["lr"],
                                    kernel=cfg["kernel"],
                                    optimizer=cfg.get("optimizer", "adam"),
                                    loss=cfg.get("loss", CROSS_ENTROPY))
                out.append(state_to_cpu(net))
        return out

    def _user_training(self, s: int, r: int) -> Any:
        """A user network's stage: deterministic kernels (an operation without one is
        refused by name) and torch's random draws (dropout) keyed by (seed, shard, stage)."""
        network = self.spec.network
        if network is None:
            return contextlib.nullcontext()
        return network.training(prf_u64(self.spec.seed, "user-rng", s, r))

    def _train_loo(self, s: int, records: Records, tombstones: Tombstones, from_slice: int,
                   start: State | None) -> list[State]:
        """Stages ``from_slice .. R-1`` of shard ``s``, each a
        :func:`jobs.learners.networks.loo_training.train_single` run on the live records of
        slices ``0..r`` and the tombstones of those slices, continuing from the stage
        before."""
        rows = records.of_shard(s)
        slices = records.slice[rows]
        params = self.initial_params(s)
        if from_slice > 0:
            assert start is not None
            params = self.params(start)
        out: list[State] = []
        for r in range(from_slice, self.spec.n_slices):
            sel = rows[slices <= r]
            params = train_single(
                records.X[sel], records.y[sel], records.ids[sel].tolist(),
                init=params, first_epoch=r * STAGE_EPOCH_STRIDE,
                **self.loo_args(s, len(sel), tombstones, r))
            out.append(self.state(params))
        return out

    @functools.cached_property
    def relu_mlp(self) -> ReluMLP | str | None:
        """The user's network as the masked schedule takes it, or why it cannot; None for
        a built-in network."""
        spec = self.spec
        return None if spec.network is None else spec.network.relu_mlp(spec.n_features,
                                                                       spec.n_classes)

    def initial_params(self, s: int) -> MLPParams | None:
        """Where shard ``s``'s masked schedule starts: a user network's own seeded
        initialisation (None: the schedule's, from the seed)."""
        if self.spec.network is None:
            return None
        return self.params(state_to_cpu(self.new_net(Placement.of(self.spec).init_seed(s))))

    def params(self, state: State) -> MLPParams:
        """A ``"loo"`` shard state in the encoder's form (bit for bit)."""
        if self.relu_mlp is None:
            return MLPParams.from_state(state)
        return self._relu().params(state)

    def state(self, params: MLPParams) -> State:
        """The shard network's state holding ``params`` (the inverse of :meth:`params`)."""
        if self.relu_mlp is None:
            return mlp_state(params.weights, params.biases)
        return self._relu().state(params)

    def _relu(self) -> ReluMLP:
        relu = self.relu_mlp
        if not isinstance(relu, ReluMLP):
            raise ValueError(f"network {self.spec.network.path!r} is not a ReLU MLP: {relu}")
        return relu

    def epochs(self, n_records: int) -> int:
        """Epochs of a stage of ``n_records`` live records (the ``min_steps`` floor)."""
        cfg = self.spec.config
        return stage_epochs(n_records, cfg["batch_size"], cfg["epochs_per_slice"],
                            cfg.get("min_steps", 0))

    def loo_args(self, s: int, n_records: int, tombstones: Tombstones,
                 stage: int) -> dict[str, Any]:
        """``train_single`` arguments of stage ``stage`` of shard ``s``."""
        spec, cfg = self.spec, self.spec.config
        return {
            "n_classes": spec.n_classes,
            "hidden": tuple(cfg["hidden"]),
            "epochs": self.epochs(n_records),
            "batch_size": cfg["batch_size"],
            "lr": cfg["lr"],
            "weight_decay": cfg["weight_decay"],
            "seed": Placement.of(spec).init_seed(s),
            "n_batches": n_batches(n_records, cfg["batch_size"]),
            "tombstones": tombstones.in_stage(s, stage),
            "device": spec.device,
            "kernel": cfg["kernel"],
        }


def train_ensemble(spec: EnsembleSpec, records: Records) -> EnsembleState:
    """Every shard trained from its seed on ``records`` (what ``fit`` does; no tombstones)."""
    trainer = ShardTrainer(spec)
    ckpts = [trainer.train(s, records, Tombstones(), 0, None) for s in range(spec.n_shards)]
    return EnsembleState(spec, spec.platform(), records, Tombstones(), ckpts,
                         [trainer.serving_net(c[-1]) for c in ckpts])


def shard_training_args(state: EnsembleState, s: int, n_records: int | None = None,
                        stage: int | None = None) -> dict[str, Any]:
    """Keyword arguments of :func:`jobs.learners.networks.loo_training.train_loo` /
    ``train_single`` / ``train_slots`` that reproduce stage ``stage`` (default: the last)
    of shard ``s`` (schedule ``"loo"`` only), for ``n_records`` live records in the stage
    (default: the shard's current count in slices ``0..stage``; ``n_records`` only sets
    ``n_batches`` and, through it, ``epochs`` under a ``min_steps`` floor). A user
    network's stage 0 adds ``init``, its module's seeded initial weights.

    One slice: ``train_loo(*shard_records, **shard_training_args(state, s))`` gives the
    served shard network as its ``N`` bit for bit (same device type, torch build, CPU
    capability and thread count); with ``n_records = n_s - 1`` its ``N_{-x}`` are the
    shard models after ``delete([x])``. Sliced: stage ``r`` runs on the records of slices
    ``0..r``, from the checkpoint of stage ``r - 1``, with ``first_epoch`` set here.
    """
    spec = state.spec
    if spec.config.get("schedule") != "loo":
        raise ValueError("only schedule='loo' shards are LOO-schedule networks "
                         f"(this ensemble trains with {spec.config.get('schedule')!r})")
    if not 0 <= int(s) < spec.n_shards:
        raise ValueError(f"shard index {s} out of range 0..{spec.n_shards - 1}")
    R = spec.n_slices
    r = R - 1 if stage is None else int(stage)
    if not 0 <= r < R:
        raise ValueError(f"stage {stage} out of range 0..{R - 1}")
    records = state.records
    n = (int((records.slice[records.of_shard(s)] <= r).sum()) if n_records is None
         else int(n_records))
    trainer = ShardTrainer(spec)
    args = trainer.loo_args(int(s), n, state.tombstones, r)
    if R > 1:
        args["first_epoch"] = r * STAGE_EPOCH_STRIDE
    if r == 0 and (init := trainer.initial_params(int(s))) is not None:
        args["init"] = init
    return args
