"""SISA: a sharded, sliced ensemble of small torch networks that forgets exactly.

The estimator (parameters, fit, prediction). The model is a deterministic function of the
set of live records, each placed by keyed functions of its id; a deletion retrains its
shards from the earliest affected slice, and ``verify`` retrains everything and compares bit
for bit. The fitted :class:`~jobs.learners.sisa.state.EnsembleState` is worked on by
placement, shard_training, updates, checks and bundle.
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from sklearn.base import _fit_context
from sklearn.utils._param_validation import StrOptions

from jobs.learners.base import (
    UpdateReport,
    VerifyReport,
    encode_labels,
    ids_to_delete,
    records_to_add,
)
from jobs.learners.networks.estimator import SpecClassifier
from jobs.learners.networks.hyperparameters import (
    SEED,
    LabelSmoothing,
    Widths,
    count,
    number,
)
from jobs.learners.networks.loo_training import MLPParams
from jobs.learners.networks.torch_nets import (
    CROSS_ENTROPY,
    LOSSES,
    build_net,
    deterministic,
    resolve_device,
    state_to_cpu,
)
from jobs.learners.networks.user_network import UserNetwork
from jobs.learners.sisa import bundle, checks, updates
from jobs.learners.sisa.config import loo_obstacle, resolve_config
from jobs.learners.sisa.placement import Placement
from jobs.learners.sisa.shard_training import (
    ShardTrainer,
    shard_training_args,
    train_ensemble,
)
from jobs.learners.sisa.state import EnsembleSpec, EnsembleState, State


class SISAEnsemble(SpecClassifier):
    """Sharded, isolated, sliced, aggregated ensemble of small networks (Bourtoule et al.).

    Parameters
    ----------
    n_shards : int
        Number of shards ``S``; a record's shard is ``prf(seed, "shard", id) mod S``
        (``sampling="partition"``).
    sampling : {"partition", "independent"}
        ``"partition"``: every record in exactly one shard. ``"independent"``: every
        record joins each shard independently with probability ``shard_prob``
        (keyed by the record id and the shard; Gupta et al.'s variant, whose
        shards are exchangeable, which their private prediction mode relies on).
    shard_prob : float in (0, 1]
        The probability ``p`` of joining a shard (``sampling="independent"`` only).
    n_slices : int
        Number of slices ``R`` per shard (incremental training with checkpoints).
    model : {"mlp", "cnn"}
        ``"mlp"`` for tables in [0, 1]^d; ``"cnn"`` for square one-channel
        images given as flat rows (e.g. scikit-learn's 8x8 digits, d = 64).
    hidden : tuple of int or None
        Hidden widths of the MLP, or of the CNN's fully connected head. ``None``:
        ``(64, 64)`` under ``schedule="loo"``, ``(64,)`` under ``"adam"``.
    epochs_per_slice : int or None
        Epochs of each stage (stage r trains on slices 0..r); at least
        ``ceil(min_steps / B)`` (:func:`jobs.learners.networks.torch_nets.stage_epochs`). ``None``:
        40 (``"loo"``), 20 (``"adam"``).
    min_steps : int or None
        Floor on the optimiser steps of a stage: a stage of ``n`` records trains
        ``max(epochs_per_slice, ceil(min_steps / B))`` epochs, ``B = ceil(n /
        batch_size)``. Why: accuracy follows steps, and ``S`` shards get ``S`` times
        fewer steps per epoch than one. A function of the stage's live count, like
        ``B``, so updates stay exact. 0: off. ``None``: 8,000 (``"loo"``), 0
        (``"adam"``). Costs time on small shards: a shard's retrain then takes at
        least ``min_steps`` steps (docs/learners.md, "SISA").
    batch_size : int
        Target mini-batch size; batches per epoch ``B = ceil(n / batch_size)``.
    lr : float or None
        Learning rate: of plain SGD (``schedule="loo"``; ``None`` -> 0.2) or of
        Adam (``schedule="adam"``, a fresh optimiser per stage; ``None`` -> 0.01).
        The two live on different scales: an Adam-sized rate (0.01) given to the
        SGD schedule barely moves inputs in [0, 1]^d, and small shards then vote
        the majority class (docs/learners.md, "SISA").
    weight_decay : float
        SGD weight decay of the ``"loo"`` schedule (``p <- p - lr (g + wd p)``);
        the ``"adam"`` schedule has none and ignores it.
    schedule : {"auto", "loo", "adam"}
        How shards train (docs/learners.md). ``"auto"``: ``"loo"`` for
        ``model="mlp"`` with ``n_slices=1``, ``"adam"`` otherwise. ``"loo"`` (per-shard
        bounds possible, sliced or not) needs ``model="mlp"``.
    aggregation : {"vote", "mean"}
        Majority vote of shard labels (ties -> lowest class index) or mean of
        shard softmax outputs.
    add_slice : {"last", "keyed"}
        Where :meth:`add` puts a record: the shard's last slice (cheap: one
        stage to retrain) or its keyed slice (training depends on the set of
        (id, x, y) alone; docs/learners.md).
    classes : sequence or None
        All labels the model may ever see; ``None``: the labels present at fit.
        Adding a record with a label outside ``classes_`` raises ``ValueError``.
    cpu_threads : int or None
        Intra-op CPU threads used while training and predicting on CPU
        (``None``: leave torch's setting). Part of what makes bits reproducible.
    device : str
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``, ...
    random_state : int or None
        The seed of every keyed choice; ``None`` draws one at fit (kept in ``seed_``).
    network : str or None
        A network of your own: the import path ``"package.module:build"`` of a function
        ``build(n_features, n_classes, **network_params)`` returning a ``torch.nn.Module``
        that maps (n, n_features) float32 rows to (n, n_classes) logits. Replaces
        ``model`` and ``hidden``. A flat ``nn.Sequential`` of biased ``Linear`` layers with
        a ``ReLU`` between each two trains, under ``schedule="auto"`` and one slice, with
        the masked LOO schedule from its own initial weights (plain SGD, ``lr``,
        ``weight_decay``; per-shard bounds possible); any other network with
        ``schedule="adam"`` (``lr``, ``epochs_per_slice``, ``batch_size``, ``optimizer``,
        ``loss``; the vote rule serves it). Its module's source is hashed into the model
        and saved with it (docs/learners.md, "Your own network"). ``None``: the built-in
        networks.
    network_params : dict or None
        Keyword arguments of ``build`` (JSON values).
    optimizer : {"adam", "sgd"} or None
        The optimiser of a user network's ``"adam"``-schedule stages (``None``: Adam;
        ``"adam"`` also keeps a ReLU MLP off the LOO schedule). Built-in networks: Adam,
        or the LOO schedule's SGD.
    loss : "cross_entropy", "nll" or float in [0, 1)
        What a user network's stages minimise: cross-entropy on its logits, a
        label-smoothing value (cross-entropy towards smoothed targets), or ``"nll"`` (the
        network outputs log-probabilities). Built-in networks and the LOO schedule:
        cross-entropy only.
    """

    guarantee = "exact"

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "n_shards": [count(1)],
        "n_slices": [count(1)],
        "model": [StrOptions({"mlp", "cnn"})],
        "hidden": [Widths(), None],
        "epochs_per_slice": [count(1), None],
        "min_steps": [count(0), None],
        "batch_size": [count(1)],
        "lr": [number(0, None, "neither"), None],
        "weight_decay": [number(0, None, "left")],
        "schedule": [StrOptions({"auto", "loo", "adam"})],
        "aggregation": [StrOptions({"vote", "mean"})],
        "add_slice": [StrOptions({"last", "keyed"})],
        "sampling": [StrOptions({"partition", "independent"})],
        "shard_prob": [number(0, 1, "right")],
        "classes": ["array-like", None],
        "cpu_threads": [count(1), None],
        "device": [str, torch.device],
        "random_state": [SEED, None],
        "network": [str, None],
        "network_params": [dict, None],
        "optimizer": [StrOptions({"adam", "sgd"}), None],
        "loss": [StrOptions(set(LOSSES)), LabelSmoothing()],
    }

    def __init__(
        self,
        *,
        n_shards: int = 5,
        n_slices: int = 1,
        model: str = "mlp",
        hidden: Sequence[int] | None = None,
        epochs_per_slice: int | None = None,
        min_steps: int | None = None,
        batch_size: int = 32,
        lr: float | None = None,
        weight_decay: float = 1e-5,
        schedule: str = "auto",
        aggregation: str = "vote",
        add_slice: str = "last",
        sampling: str = "partition",
        shard_prob: float = 0.5,
        classes: Sequence[Any] | None = None,
        cpu_threads: int | None = 1,
        device: str = "auto",
        random_state: int | None = 0,
        network: str | None = None,
        network_params: dict[str, Any] | None = None,
        optimizer: str | None = None,
        loss: str | float = CROSS_ENTROPY,
    ) -> None:
        self.n_shards = n_shards
        self.n_slices = n_slices
        self.model = model
        self.hidden = hidden
        self.epochs_per_slice = epochs_per_slice
        self.min_steps = min_steps
        self.batch_size = batch_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.schedule = schedule
        self.aggregation = aggregation
        self.add_slice = add_slice
        self.sampling = sampling
        self.shard_prob = shard_prob
        self.classes = classes
        self.cpu_threads = cpu_threads
        self.device = device
        self.random_state = random_state
        self.network = network
        self.network_params = network_params
        self.optimizer = optimizer
        self.loss = loss

    # ------------------------------------------------------------------ fit / update

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X: Any, y: Any, *, record_ids: Any = None) -> SISAEnsemble:
        """Train every shard from its seed on the records (all ``origin="fit"``);
        ``record_ids`` default to the row numbers."""
        rids, Xa, y = self._training_data(X, y, record_ids)
        classes = self._label_set(y, min_classes=1)
        network, relu_mlp = None, None
        if self.network is not None:  # resolved and checked before any shard trains
            network = UserNetwork.resolve(self.network, self.network_params)
            network.check(int(Xa.shape[1]), len(classes))
            relu_mlp = network.relu_mlp(int(Xa.shape[1]), len(classes))
        config = resolve_config(self.get_params(deep=False), relu_mlp)
        if network is not None:
            config["network"] = network.record()
        elif config["model"] == "cnn":
            build_net("cnn", Xa.shape[1], 2, config["hidden"])  # raises if not a square image
        rs = self.random_state
        spec = EnsembleSpec(config, secrets.randbits(63) if rs is None else int(rs), classes,
                            int(Xa.shape[1]), resolve_device(self.device), network)
        records = Placement.of(spec).records(rids, Xa, encode_labels(y, classes, len(rids)),
                                             np.zeros(len(rids), dtype=bool))
        self.classes_ = classes
        self.state_ = train_ensemble(spec, records)
        return self

    def delete(self, ids: Any) -> UpdateReport:
        """Forget records by id; retrains each affected shard from its earliest affected slice.

        Raises :class:`UnknownRecordError` (model unchanged) when an id is not
        live (never seen, or already deleted), :class:`DuplicateRecordError`
        when an id is named twice.
        """
        state = self._fitted()
        self.state_, report = updates.delete(state, ids_to_delete(ids, state.records.row))
        return report

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records; each goes to its keyed shard's last slice (``add_slice="last"``).

        Raises :class:`DuplicateRecordError` for an id already live (or named
        twice) and ``ValueError`` for a wrong shape, NaN/inf or an unknown label;
        the model is unchanged on any error.
        """
        state = self._fitted()
        rids, Xa, yi = records_to_add(ids, X, y, state.records.row, self.n_features_in_,
                                      self.classes_)
        self.state_, report = updates.add(state, rids, Xa, yi)
        return report

    # ------------------------------------------------------------------ fitted state

    state_: EnsembleState

    @property
    def network_(self) -> dict[str, Any] | None:
        """The user network it trains (import path, SHA-256 of its source, params); None
        for a built-in network."""
        return self._fitted().spec.config.get("network")

    @property
    def bound_obstacle_(self) -> str | None:
        """Why the shards have no per-shard bounds (their schedule is not the masked LOO
        one, and for a user network why it is not); None when they can have them."""
        state = self._fitted()
        config = state.spec.config
        if config["schedule"] == "loo":
            return None
        relu = ShardTrainer(state.spec).relu_mlp
        if relu is None:
            return "the shards train with schedule='adam'"
        params = self.get_params(deep=False)
        why = loo_obstacle(params, relu) or (
            "it was asked for" if params["schedule"] == "adam" else
            f"{config['n_slices']} slices (schedule='auto' takes the LOO schedule for one)")
        return f"network {config['network']['path']!r} trains with schedule='adam': {why}"

    @property
    def slice_of_(self) -> np.ndarray:
        return self._fitted().records.slice

    @property
    def tombstones_(self) -> dict[int, np.ndarray]:
        """Per shard, the sorted schedule keys of its deleted records (``"loo"`` only)."""
        return self._fitted().tombstones.keys

    @property
    def tombstone_slices_(self) -> dict[int, np.ndarray]:
        return self._fitted().tombstones.slices

    @property
    def checkpoints_(self) -> list[list[State]]:
        return self._fitted().checkpoints

    @property
    def shard_sizes_(self) -> np.ndarray:
        """Live records per shard, shape (S,)."""
        return self._fitted().shard_sizes

    @property
    def shard_networks_(self) -> tuple[torch.nn.Module, ...]:
        """The served shard networks. A shard an update retrains gets a new network object,
        so identity tells a caller which shards may have changed since it last looked."""
        return tuple(self._fitted().nets)

    @property
    def max_shards_per_record_(self) -> int:
        """The most shards one live record belongs to: how many shard models one deletion
        can change (1 for a partition; the SISA vote rule needs it)."""
        return int(self._fitted().records.member.sum(axis=1).max(initial=0))

    @property
    def active_shards_(self) -> np.ndarray:
        """Boolean mask (S,): shards with at least one live record (the ones that vote)."""
        return self._fitted().active

    # ------------------------------------------------------------------ prediction

    def shard_logits(self, X: Any) -> np.ndarray:
        """Logits of every shard model (empty shards included), shape (S, n, C), float32.

        ``X`` is used as given (no clipping; the service clips to [0, 1]^d).
        """
        state = self._fitted()
        Xa = self._queries(X)
        xt = torch.from_numpy(Xa).to(state.spec.device)
        with state.spec.threads(), deterministic(), torch.inference_mode():
            out = [net(xt).float().cpu().numpy() for net in state.nets]
        return np.stack(out) if out else np.zeros((0, len(Xa), self.n_classes_), np.float32)

    def shard_predictions(self, X: Any) -> np.ndarray:
        """Class index voted by each shard, shape (S, n); -1 for empty (non-voting) shards."""
        pred = self.shard_logits(X).argmax(axis=2)
        pred[~self.active_shards_] = -1
        return pred

    def scores(self, X: Any) -> np.ndarray:
        """Vote counts per class (``"vote"``) or mean softmax of the active shards (``"mean"``)."""
        logits = self.shard_logits(X)
        active = self.active_shards_
        n, C = logits.shape[1], self.n_classes_
        if self.config_["aggregation"] == "vote":
            votes = np.zeros((n, C), dtype=np.float64)
            for s in np.flatnonzero(active):
                votes[np.arange(n), logits[s].argmax(axis=1)] += 1.0
            return votes
        if not active.any():
            return np.full((n, C), 1.0 / C)
        z = logits[active].astype(np.float64)
        z -= z.max(axis=2, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=2, keepdims=True)
        return p.mean(axis=0)

    def locate(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """(shard, slice) of live records of a partition; :class:`UnknownRecordError` for
        ids not live. With independent sampling use :meth:`memberships`."""
        if self.config_.get("sampling", "partition") != "partition":
            raise ValueError("with sampling='independent' a record may sit in several "
                             "shards: use memberships()")
        records = self._fitted().records
        rows = records.rows_of(ids)
        return records.member[rows].argmax(axis=1), records.slice[rows].copy()

    def memberships(self, ids: Any) -> np.ndarray:
        """(n, S) booleans: the shards each live record belongs to."""
        records = self._fitted().records
        return records.member[records.rows_of(ids)].copy()

    # ------------------------------------------------------------------ shards for the guard

    def shard_training_args(self, s: int, n_records: int | None = None,
                            stage: int | None = None) -> dict[str, Any]:
        """Keyword arguments that reproduce stage ``stage`` of shard ``s`` with
        :func:`jobs.learners.networks.loo_training.train_single` (and ``train_loo`` /
        ``train_slots``): :func:`jobs.learners.sisa.shard_training.shard_training_args`."""
        return shard_training_args(self._fitted(), s, n_records, stage)

    def shard_slices(self, s: int) -> np.ndarray:
        """The slice of each of shard ``s``'s live records, in :meth:`shard_records` order."""
        records = self._fitted().records
        return records.slice[records.of_shard(s)].copy()

    def shard_records(self, s: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Shard ``s``'s live records: ids (sorted), features (float32), class indices."""
        records = self._fitted().records
        rows = records.of_shard(s)
        return records.ids[rows].tolist(), records.X[rows].copy(), records.y[rows].copy()

    def shard_state(self, s: int) -> State:
        """A CPU copy of shard ``s``'s served weights (state dict)."""
        return state_to_cpu(self._fitted().nets[int(s)])

    def shard_params(self, s: int) -> MLPParams:
        """Shard ``s``'s served weights in the LUCID encoder's form (``schedule="loo"``:
        the built-in MLP, or a user's ReLU MLP), bit for bit."""
        state = self._fitted()
        return ShardTrainer(state.spec).params(self.shard_state(s))

    # ------------------------------------------------------------------ checks, bundle

    def content_hash(self) -> str:
        """SHA-256 over the served shard weights (bit for bit), active mask, classes, config."""
        return checks.content_hash(self._fitted())

    def shard_hash(self, s: int) -> str:
        """Hash of shard ``s``'s served weights."""
        return checks.shard_hash(self._fitted(), s)

    def checkpoint_hash(self, s: int, r: int) -> str:
        """Hash of shard ``s``'s checkpoint after stage ``r``."""
        return checks.checkpoint_hash(self._fitted(), s, r)

    def verify(self) -> VerifyReport:
        """Retrain every shard from scratch on the live records and compare bit for bit."""
        return checks.verify(self._fitted())

    def verify_shard(self, s: int) -> VerifyReport:
        """Retrain only shard ``s`` from scratch and compare its checkpoints and weights."""
        return checks.verify_shard(self._fitted(), s)

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (JSON) and ``path/state.pt`` (tensors only)."""
        bundle.save(path, self.get_params(deep=False), self._fitted())

    @classmethod
    def load(cls, path: str | Path) -> SISAEnsemble:
        """Read a bundle written by :meth:`save`; checks the content hash."""
        params, state = bundle.load(path)
        return cls._restored(params, state, state.spec.n_features, state.spec.classes)
