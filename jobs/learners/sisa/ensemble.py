"""SISA: a sharded, sliced ensemble of small torch networks that forgets exactly.

The estimator is here (configuration, keyed assignment, fit and updates, prediction);
how a shard trains is in :mod:`jobs.learners.sisa.shard_training`, its hashes and ``verify``
in :mod:`jobs.learners.sisa.checks`, saving and loading in :mod:`jobs.learners.sisa.bundle`.

Guarantee: EXACT, and checkable bit for bit (docs/DESIGN.md, "Guarantees").

The training set
----------------
The model is a deterministic function ``T(seed, hyperparameters, D)`` of the
set ``D`` of live records, each a tuple ``(id, x, y, origin)`` with
``origin`` = ``"fit"`` (present at :meth:`SISAEnsemble.fit`) or ``"add"``
(arrived later through :meth:`SISAEnsemble.add`). Neither row positions nor
arrival order enter ``T``:

* shard of a record: ``prf(seed, "shard", id) mod S`` -- stable under any
  additions and deletions (``sampling="partition"``, the default). With
  ``sampling="independent"`` (Gupta et al., Alg. 2-3) a record joins each shard
  ``s`` on its own, iff ``prf_uniform(seed, ("member", s), id) < shard_prob``: it
  may sit in several shards or in none, a deletion retrains every shard holding
  it, and an addition joins the shards its keyed draws pick;
* slice of a record within its shard (``add_slice="last"``, the default):
  ``prf(seed, "slice", id) mod R`` for ``origin="fit"``, and ``R - 1`` (the
  shard's last slice) for ``origin="add"``. With ``add_slice="keyed"`` every
  record uses the keyed slice, origin is irrelevant and ``T`` depends on the
  set ``{(id, x, y)}`` alone (an addition then retrains from its keyed slice,
  which costs more);
* shard ``s`` starts from weights drawn from ``prf(seed, "init", s)`` alone;
  how it trains is the ``schedule`` (below); the served model of shard ``s``
  is its last checkpoint;
* float32, deterministic kernels, a fixed CPU thread count (``cpu_threads``).

Two training schedules
----------------------
``schedule="loo"`` (the default for ``model="mlp", n_slices=1``; the
configuration the sidecar serves, where it is asked for whatever the slices):
shard ``s`` is trained by the masked leave-one-out kernel of
:mod:`jobs.learners.networks.loo_training` --
:func:`jobs.learners.networks.loo_training.train_single` on the shard's
live records with ``seed_s = prf(seed, "init", s)`` (the same
initialisation), rows in the order of their schedule keys ``k = prf(seed_s,
"loo-batch", id)``, per-epoch batch ``mix64(k ^ prf(seed_s, "loo-epoch", e))
mod B``, ``B = max(1, ceil(n_s / batch_size))`` (``n_s`` the shard's live
record count), plain SGD with ``lr`` and ``weight_decay``, ``E(B) =
max(epochs_per_slice, ceil(min_steps / B))`` epochs (a function of ``B``, so of
the live count, like ``B`` itself), the padded batched kernels. Records
deleted since ``fit`` stay in the schedule of every shard that held them as
TOMBSTONES (``tombstones_``: shard -> sorted uint64 schedule keys under that
shard's seed; no id, features or label): always-masked rows at the key's
place, in the batch the key hashes to. A tombstone contributes an exact zero
to every sum, so it changes nothing arithmetically, but it keeps every other
row where it was:
the gemm kernels of some CPUs (seen on Sapphire Rapids, MKL, AVX-512) sum a
batch's rows in an order that depends on row positions, so "x masked in
place" and "x removed, later rows moved up" can differ in the last bits.
With tombstones the shard network is bit for bit the base network ``N`` of
``train_loo`` on the shard's records with those arguments
(:meth:`SISAEnsemble.shard_training_args`, which carries the shard's
tombstones), and ``train_loo``'s ``N_{-x}`` with ``B = ceil((n_s - 1) /
batch_size)`` is bit for bit the shard after ``delete([x])``, on any CPU:
that is what lets :func:`jobs.guard.lucid.shard_bounds.shard_bounds` compute
per-shard LUCID bounds for the SERVED ensemble. A later ``add`` of a
tombstoned id removes its tombstones (its keys are recomputed from the id);
``fit`` starts with none.

Sliced, under ``schedule="loo"`` (ask for it; the sidecar does): stage ``r`` is
that same ``train_single`` run on the live records of slices ``0..r`` and the
tombstones of records deleted from those slices (``tombstone_slices_``, aligned
with ``tombstones_``: a deleted record's slice), ``B`` and ``E(B)`` from the
stage's live count, starting from the checkpoint after stage ``r - 1`` (stage 0:
the seed's weights), its epochs numbered from ``r * STAGE_EPOCH_STRIDE`` (so
every stage's batches are keyed apart; one slice: from 0). A deletion from slice
``j`` keeps checkpoints ``0..j-1`` as for Adam stages, and the shard's
single-deletion models are what :func:`jobs.guard.lucid.shard_bounds.ensemble_loo_set`
trains stage by stage, so sliced shards get per-shard bounds too. A re-added
record's tombstone leaves the stages from its old slice on, so its shard
retrains from there.

``schedule="adam"`` (the default otherwise: sliced ensembles, the CNN): stage
``r = 0 .. R-1`` trains on the union of slices ``0..r`` for ``E(B)`` epochs
(as above, ``B`` the stage's batch count), starting from the checkpoint after
stage ``r - 1``, with a fresh Adam optimiser (``lr``; no weight decay); a checkpoint
(state dict) is kept after every stage; within a stage, epoch ``e``: a
record's mini-batch is a keyed hash of ``(seed, s, r, e, id)`` mod ``B``,
``B = max(1, ceil(n / batch_size))`` with ``n`` the stage's record count;
records within a batch in key order; empty batches are skipped (see
:mod:`jobs.learners.networks.torch_nets`). Such ensembles are exact and verifiable too, but
per-shard bounds need the ``"loo"`` schedule; the guard serves them with the
bound-free vote rule (every shard fragile).

What "retrain from scratch" means
---------------------------------
Computing ``T`` on the live set: every shard re-initialised from the seed and
every stage retrained, using each live record's recorded origin (hence its
slice: the keyed slice, or the last slice for records that arrived by
``add``) and, under ``schedule="loo"``, the shards' tombstone keys.
:meth:`SISAEnsemble.verify` does exactly that and compares every checkpoint
and the served weights bit for bit. When no record was ever added (or
``add_slice="keyed"``) and none deleted under ``schedule="loo"``, this is the
same as ``SISAEnsemble(**params).fit`` on the live records.

Why updates equal the retrain
-----------------------------
Stage ``r`` of shard ``s`` depends only on the checkpoint after stage ``r-1``
and on the records of shard ``s`` in slices ``0..r``. Deleting a record of
slice ``r`` therefore leaves shard ``s``'s checkpoints ``0..r-1`` and all
other shards untouched, and retraining stages ``r..R-1`` from checkpoint
``r-1`` is the same computation, on the same inputs, as the from-scratch
retrain. An addition lands in slice ``R-1`` (``"last"``), so only stage
``R-1`` of its shard changes: the update retrains that stage from checkpoint
``R-2``; the from-scratch retrain puts the record in the same slice because
its origin is part of the set. The price of the "add to the last slice" rule
is that ``T`` depends on origin: re-``fit`` ting the live records as if all
were present from the start would assign the added ones keyed slices and give
different (equally valid) weights.

Empty shards
------------
A shard without live records keeps its seed-only initial weights (all its
checkpoints equal the initialisation) and is EXCLUDED from the vote/mean; it
still appears in :meth:`SISAEnsemble.shard_logits` and in the content hash,
and :attr:`SISAEnsemble.active_shards_` says which shards vote. With no active
shard at all, :meth:`scores` is all zeros (vote) or uniform (mean) and
:meth:`predict` returns ``classes_[0]``. Note for the guard: deleting the last
record of a shard removes that shard's vote (``v - e_a``) instead of moving it.

Limits of the bit-for-bit claim
-------------------------------
Bits are reproducible on the same device type, torch build and CPU thread
count (``cpu_threads``, fixed during training and inference on CPU). A model
saved on one device type and updated on another is still a correct model of
the live set, but its checkpoints then mix platforms and ``verify`` would
report a mismatch; :meth:`SISAEnsemble.load` warns when that can happen.

What the saved bundle stores per record
---------------------------------------
A live record: its id, features, label and origin (updates and ``verify``
need them). A deleted record: nothing but, under ``schedule="loo"``, its
schedule key in each shard that held it -- a 64-bit keyed hash of its id
under that shard's seed; no id, features or label anywhere in the bundle.
Someone holding the model files (the seed included) who can enumerate
candidate ids can test whether one of them was deleted from the model; the
ledger names deleted ids anyway.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError

from jobs.learners.base import (
    Learner,
    UnknownRecordError,
    UpdateReport,
    as_ids,
    check_features,
    encode_labels,
    ids_to_delete,
    records_to_add,
    unique_ids,
)
from jobs.learners.keyed import prf_u64, prf_u64_many, prf_uniform_many
from jobs.learners.networks.loo_training import schedule_keys
from jobs.learners.networks.torch_nets import (
    build_net,
    deterministic,
    resolve_device,
    torch_threads,
)
from jobs.learners.sisa.bundle import EnsembleBundle
from jobs.learners.sisa.checks import EnsembleChecks
from jobs.learners.sisa.shard_training import _NO_KEYS, _NO_SLICES, ShardTraining, State, Tombstones

# Defaults per schedule (``None`` in the constructor). Plain SGD on inputs in [0, 1]^d needs
# a rate about 20-50x Adam's: with 0.01 small shards stayed at the majority class on
# census-like tables. The "loo" defaults are a network for tables: two hidden layers of 64,
# 40 epochs and at least 8,000 steps per stage, so that a shard of a fifth of the records
# learns what one shard does (bench_sisa.py's table rows; docs/learners.md, "SISA").
SCHEDULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "loo": {"hidden": (64, 64), "epochs_per_slice": 40, "min_steps": 8000, "lr": 0.2},
    "adam": {"hidden": (64,), "epochs_per_slice": 20, "min_steps": 0, "lr": 1e-2},
}


class SISAEnsemble(EnsembleBundle, EnsembleChecks, ShardTraining, Learner, BaseEstimator):
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
        How shards train (module docstring). ``"auto"``: ``"loo"`` for
        ``model="mlp"`` with ``n_slices=1``, ``"adam"`` otherwise. ``"loo"`` (per-shard
        bounds possible, sliced or not) needs ``model="mlp"``.
    aggregation : {"vote", "mean"}
        Majority vote of shard labels (ties -> lowest class index) or mean of
        shard softmax outputs.
    add_slice : {"last", "keyed"}
        Where :meth:`add` puts a record: the shard's last slice (cheap: one
        stage to retrain) or its keyed slice (training depends on the set of
        (id, x, y) alone). See the module docstring.
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
    """

    guarantee = "exact"

    def __init__(
        self,
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

    # ------------------------------------------------------------------ config

    def _validated_config(self) -> dict[str, Any]:
        def pos_int(name: str, v: Any) -> int:
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
            return int(v)

        if self.model not in ("mlp", "cnn"):
            raise ValueError(f"model must be 'mlp' or 'cnn', got {self.model!r}")
        if self.aggregation not in ("vote", "mean"):
            raise ValueError(f"aggregation must be 'vote' or 'mean', got {self.aggregation!r}")
        if self.add_slice not in ("last", "keyed"):
            raise ValueError(f"add_slice must be 'last' or 'keyed', got {self.add_slice!r}")
        if self.sampling not in ("partition", "independent"):
            raise ValueError("sampling must be 'partition' or 'independent', got "
                             f"{self.sampling!r}")
        prob = float(self.shard_prob)
        if not 0 < prob <= 1:
            raise ValueError(f"shard_prob must lie in (0, 1], got {self.shard_prob!r}")
        n_slices = pos_int("n_slices", self.n_slices)
        if self.schedule not in ("auto", "loo", "adam"):
            raise ValueError(f"schedule must be 'auto', 'loo' or 'adam', got {self.schedule!r}")
        schedule = self.schedule
        if schedule == "auto":
            schedule = "loo" if self.model == "mlp" and n_slices == 1 else "adam"
        if schedule == "loo" and self.model != "mlp":
            raise ValueError("schedule='loo' needs model='mlp'")
        dflt = SCHEDULE_DEFAULTS[schedule]
        hidden = tuple(pos_int("hidden[*]", h)
                       for h in (dflt["hidden"] if self.hidden is None else self.hidden))
        lr = float(self.lr if self.lr is not None else dflt["lr"])
        if not np.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        wd = float(self.weight_decay)
        if not np.isfinite(wd) or wd < 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")
        threads = None if self.cpu_threads is None else pos_int("cpu_threads", self.cpu_threads)
        min_steps = dflt["min_steps"] if self.min_steps is None else self.min_steps
        if isinstance(min_steps, bool) or not isinstance(min_steps, int | np.integer) \
                or min_steps < 0:
            raise ValueError(f"min_steps must be an integer >= 0, got {min_steps!r}")
        return {
            "n_shards": pos_int("n_shards", self.n_shards),
            "n_slices": n_slices,
            "model": self.model,
            "hidden": list(hidden),
            "epochs_per_slice": pos_int("epochs_per_slice", dflt["epochs_per_slice"]
                                        if self.epochs_per_slice is None
                                        else self.epochs_per_slice),
            "min_steps": int(min_steps),
            "batch_size": pos_int("batch_size", self.batch_size),
            "lr": lr,
            "weight_decay": wd,
            "schedule": schedule,
            "aggregation": self.aggregation,
            "add_slice": self.add_slice,
            "sampling": self.sampling,
            "shard_prob": prob,
            "cpu_threads": threads,
            # how an MLP trains on the CPU (jobs.learners.networks.torch_nets.KERNELS): part of
            # what the
            # bits depend on, so recorded (bundles from before the compiled one: "torch")
            "kernel": "compiled",
        }

    @property
    def _S(self) -> int:
        return self.config_["n_shards"]

    @property
    def _R(self) -> int:
        return self.config_["n_slices"]

    def _check_fitted(self) -> None:
        if not hasattr(self, "checkpoints_"):
            raise NotFittedError("this SISAEnsemble is not fitted yet; call fit() first")

    def _threads(self):
        n = self.config_["cpu_threads"] if self.device_.type == "cpu" else None
        return torch_threads(n)

    # ------------------------------------------------------------------ keyed assignment

    def _keyed_members(self, ids: np.ndarray) -> np.ndarray:
        """(n, S) booleans: which shards each record belongs to (keyed by its id)."""
        S = self._S
        if self.config_.get("sampling", "partition") == "partition":
            shard = (prf_u64_many(self.seed_, "shard", ids) % np.uint64(S)).astype(np.int64)
            return np.eye(S, dtype=bool)[shard] if len(ids) else np.zeros((0, S), dtype=bool)
        p = self.config_["shard_prob"]
        cols = [prf_uniform_many(self.seed_, ("member", s), ids) < p for s in range(S)]
        return np.stack(cols, axis=1) if len(ids) else np.zeros((0, S), dtype=bool)

    def _keyed_slices(self, ids: np.ndarray) -> np.ndarray:
        return (prf_u64_many(self.seed_, "slice", ids) % np.uint64(self._R)).astype(np.int64)

    def _batch_keys(self, ids: np.ndarray) -> np.ndarray:
        return prf_u64_many(self.seed_, "batch", ids)

    def _slices_for(self, ids: np.ndarray, added: np.ndarray) -> np.ndarray:
        keyed = self._keyed_slices(ids)
        if self.config_["add_slice"] == "last":
            return np.where(added, self._R - 1, keyed).astype(np.int64)
        return keyed

    def _init_seed(self, s: int) -> int:
        return prf_u64(self.seed_, "init", s)

    def _data(self) -> dict[str, np.ndarray]:
        return {
            "ids": self.record_ids_,
            "X": self.X_,
            "y": self.y_,
            "member": self.member_,
            "slice": self.slice_of_,
            "added": self.added_,
            "keys": self._keys,
        }

    def _make_data(
        self, ids: np.ndarray, X: np.ndarray, y: np.ndarray, added: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Arrays of a record set, sorted by id, with keyed shard/slice/batch keys."""
        order = np.argsort(ids, kind="stable")
        ids, X, y, added = ids[order], X[order], y[order], added[order]
        return {
            "ids": ids,
            "X": np.ascontiguousarray(X, dtype=np.float32),
            "y": np.ascontiguousarray(y, dtype=np.int64),
            "member": self._keyed_members(ids),
            "slice": self._slices_for(ids, added),
            "added": added.astype(bool),
            "keys": self._batch_keys(ids),
        }

    def _tombstone_keys(self, ids: np.ndarray,
                        slices: np.ndarray | None = None) -> tuple[Tombstones, Tombstones]:
        """Per shard holding any of ``ids``, their sorted schedule keys under its seed, and
        the slices (``slices``, aligned with ``ids``; default 0) in that order."""
        member = self._keyed_members(ids)
        sl = np.zeros(len(ids), dtype=np.int64) if slices is None else slices
        keys: Tombstones = {}
        at: Tombstones = {}
        for s in np.flatnonzero(member.any(axis=0)).tolist():
            k = schedule_keys(self._init_seed(s), ids[member[:, s]].tolist())
            order = np.argsort(k)
            keys[s], at[s] = k[order], sl[member[:, s]][order]
        return keys, at

    def _commit(
        self,
        data: dict[str, np.ndarray],
        tombstones: Tombstones,
        tomb_slices: Tombstones,
        checkpoints: list[list[State]],
        changed: list[int] | None = None,
    ) -> None:
        self.tombstones_ = tombstones
        self.tombstone_slices_ = tomb_slices
        self.record_ids_ = data["ids"]
        self.X_ = data["X"]
        self.y_ = data["y"]
        self.member_ = data["member"]
        self.slice_of_ = data["slice"]
        self.added_ = data["added"]
        self._keys = data["keys"]
        self._row = {rid: k for k, rid in enumerate(self.record_ids_.tolist())}
        self.checkpoints_ = checkpoints
        if changed is None or not hasattr(self, "_nets"):
            self._nets = [self._serving_net(c[-1]) for c in checkpoints]
        else:
            for s in changed:
                self._nets[s] = self._serving_net(checkpoints[s][-1])

    # ------------------------------------------------------------------ fit / update

    def fit(self, ids: Any, X: Any, y: Any) -> SISAEnsemble:
        """Train every shard from its seed on the records ``(ids, X, y)`` (all ``origin="fit"``)."""
        cfg = self._validated_config()
        rs = self.random_state
        if rs is None:
            seed = secrets.randbits(63)
        elif isinstance(rs, bool) or not isinstance(rs, int | np.integer):
            raise ValueError(f"random_state must be an int or None, got {type(rs).__name__}")
        else:
            seed = int(rs)
        rids = unique_ids(ids)
        if len(rids) == 0:
            raise ValueError("fit needs at least one record")
        Xa = check_features(X, len(rids), None, dtype=np.float32)
        if cfg["model"] == "cnn":
            build_net("cnn", Xa.shape[1], 2, cfg["hidden"])  # raises if not a square image
        yarr = np.asarray(y)
        if yarr.ndim != 1 or yarr.shape[0] != len(rids):
            raise ValueError(f"y must be 1-D with {len(rids)} labels, got shape {yarr.shape}")
        if self.classes is None:
            if yarr.dtype.kind == "f" and not np.isfinite(yarr).all():
                raise ValueError("y contains NaN or infinite labels")
            classes = np.unique(yarr)
        else:
            classes = np.asarray(list(self.classes))
            if len(np.unique(classes)) != len(classes):
                raise ValueError("classes contains duplicates")
            classes = np.sort(classes) if classes.dtype != object else classes
        if len(classes) < 1:
            raise ValueError("no classes")

        # fitted state (set before helpers that read it)
        self.config_ = cfg
        self.seed_ = seed
        self.classes_ = classes
        self.n_features_in_ = int(Xa.shape[1])
        self.device_ = resolve_device(self.device)
        self.platform_ = self._platform()
        yi = encode_labels(yarr, self.classes_, len(rids))
        data = self._make_data(rids, Xa, yi, np.zeros(len(rids), dtype=bool))
        ckpts = [self._train_shard(s, data, {}, {}, 0, None) for s in range(self._S)]
        self._commit(data, {}, {}, ckpts)
        return self

    def _platform(self) -> dict[str, Any]:
        return {
            "device_type": self.device_.type,
            "torch": torch.__version__,
            "cpu_threads": self.config_["cpu_threads"],
        }

    def _retrain(
        self, data: dict[str, np.ndarray], tombstones: Tombstones, tomb_slices: Tombstones,
        from_slice: dict[int, int]
    ) -> tuple[list[list[State]], float]:
        t0 = time.perf_counter()
        ckpts = list(self.checkpoints_)
        for s, r in sorted(from_slice.items()):
            start = self.checkpoints_[s][r - 1] if r > 0 else None
            ckpts[s] = (list(self.checkpoints_[s][:r])
                        + self._train_shard(s, data, tombstones, tomb_slices, r, start))
        return ckpts, time.perf_counter() - t0

    def _report(
        self,
        op: str,
        ids: np.ndarray,
        t0: float,
        from_slice: dict[int, int],
        data: dict[str, np.ndarray],
        train_s: float,
    ) -> UpdateReport:
        shards = sorted(from_slice)
        retrained_records = int(data["member"][:, shards].any(axis=1).sum()) if shards else 0
        return UpdateReport(
            op=op,  # type: ignore[arg-type]
            record_ids=[str(i) for i in ids],
            guarantee="exact",
            seconds=time.perf_counter() - t0,
            retrained={
                "shards": shards,
                "from_slice": {int(s): int(r) for s, r in sorted(from_slice.items())},
                "n_slices": self._R,
            },
            metrics={
                "train_seconds": train_s,
                "records_in_retrained_shards": float(retrained_records),
                "n_records": float(len(data["ids"])),
            },
        )

    def delete(self, ids: Any) -> UpdateReport:
        """Forget records by id; retrains each affected shard from its earliest affected slice.

        Raises :class:`UnknownRecordError` (model unchanged) when an id is not
        live (never seen, or already deleted), :class:`DuplicateRecordError`
        when an id is named twice.
        """
        self._check_fitted()
        t0 = time.perf_counter()
        rids = ids_to_delete(ids, self._row)
        rows = np.array([self._row[i] for i in rids.tolist()], dtype=np.int64)
        from_slice = _earliest_slices(self.member_[rows], self.slice_of_[rows])
        keep = np.ones(len(self.record_ids_), dtype=bool)
        keep[rows] = False
        old = self._data()
        data = {k: v[keep] for k, v in old.items()}
        tombstones, tomb_slices = dict(self.tombstones_), dict(self.tombstone_slices_)
        if self.config_["schedule"] == "loo":
            new, at = self._tombstone_keys(rids, self.slice_of_[rows])
            for s, keys in new.items():
                k = np.concatenate([tombstones.get(s, _NO_KEYS), keys])
                sl = np.concatenate([tomb_slices.get(s, _NO_SLICES), at[s]])
                order = np.argsort(k)
                tombstones[s], tomb_slices[s] = k[order], sl[order]
        ckpts, train_s = self._retrain(data, tombstones, tomb_slices, from_slice)
        self._commit(data, tombstones, tomb_slices, ckpts, changed=sorted(from_slice))
        return self._report("delete", rids, t0, from_slice, data, train_s)

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records; each goes to its keyed shard's last slice (``add_slice="last"``).

        Raises :class:`DuplicateRecordError` for an id already live (or named
        twice) and ``ValueError`` for a wrong shape, NaN/inf or an unknown label;
        the model is unchanged on any error.
        """
        self._check_fitted()
        t0 = time.perf_counter()
        rids, Xa, yi = records_to_add(ids, X, y, self._row, self.n_features_in_,
                                      self.classes_)
        if len(rids) == 0:
            return self._report("add", rids, t0, {}, self._data(), 0.0)
        old = self._data()
        data = self._make_data(
            np.concatenate([old["ids"], rids]),
            np.concatenate([old["X"], Xa]),
            np.concatenate([old["y"], yi]),
            np.concatenate([old["added"], np.ones(len(rids), dtype=bool)]),
        )
        new_rows = np.isin(data["ids"], rids)
        from_slice = _earliest_slices(data["member"][new_rows], data["slice"][new_rows])
        # a re-added id's tombstones are lifted, and its shard retrains from the earliest
        # slice it leaves or joins
        back, _ = self._tombstone_keys(rids)
        tombstones, tomb_slices = {}, {}
        for s, keys in self.tombstones_.items():
            gone = np.isin(keys, back.get(s, _NO_KEYS))
            if not gone.all():
                tombstones[s] = keys[~gone]
                tomb_slices[s] = self.tombstone_slices_[s][~gone]
            if gone.any():
                r0 = int(self.tombstone_slices_[s][gone].min())
                from_slice[s] = min(from_slice.get(s, r0), r0)
        ckpts, train_s = self._retrain(data, tombstones, tomb_slices, from_slice)
        self._commit(data, tombstones, tomb_slices, ckpts, changed=sorted(from_slice))
        return self._report("add", rids, t0, from_slice, data, train_s)

    # ------------------------------------------------------------------ prediction

    @property
    def shard_sizes_(self) -> np.ndarray:
        """Live records per shard, shape (S,)."""
        self._check_fitted()
        return self.member_.sum(axis=0)

    @property
    def shard_networks_(self) -> tuple[torch.nn.Module, ...]:
        """The served shard networks. A shard an update retrains gets a new network object,
        so identity tells a caller which shards may have changed since it last looked."""
        self._check_fitted()
        return tuple(self._nets)

    @property
    def max_shards_per_record_(self) -> int:
        """The most shards one live record belongs to: how many shard models one deletion
        can change (1 for a partition; the SISA vote rule needs it)."""
        self._check_fitted()
        return int(self.member_.sum(axis=1).max(initial=0))

    @property
    def active_shards_(self) -> np.ndarray:
        """Boolean mask (S,): shards with at least one live record (the ones that vote)."""
        return self.shard_sizes_ > 0

    @property
    def n_classes_(self) -> int:
        return len(self.classes_)

    def shard_logits(self, X: Any) -> np.ndarray:
        """Logits of every shard model (empty shards included), shape (S, n, C), float32.

        ``X`` is used as given (no clipping; the service clips to [0, 1]^d).
        """
        self._check_fitted()
        Xa = check_features(X, None, self.n_features_in_, dtype=np.float32)
        xt = torch.from_numpy(Xa).to(self.device_)
        with self._threads(), deterministic(), torch.inference_mode():
            out = [net(xt).float().cpu().numpy() for net in self._nets]
        return np.stack(out) if out else np.zeros((0, len(Xa), self.n_classes_), np.float32)

    def predict(self, X: Any) -> np.ndarray:
        """Labels: argmax of :meth:`scores`, ties to the lowest class index."""
        self._check_fitted()
        return super().predict(X)

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

    def _live_rows(self, ids: Any) -> np.ndarray:
        self._check_fitted()
        rids = as_ids(ids)
        unknown = [i for i in rids.tolist() if i not in self._row]
        if unknown:
            raise UnknownRecordError(unknown, "unknown or already deleted record id")
        return np.array([self._row[i] for i in rids.tolist()], dtype=np.int64)

    def locate(self, ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """(shard, slice) of live records of a partition; :class:`UnknownRecordError` for
        ids not live. With independent sampling use :meth:`memberships`."""
        if self.config_.get("sampling", "partition") != "partition":
            raise ValueError("with sampling='independent' a record may sit in several "
                             "shards: use memberships()")
        rows = self._live_rows(ids)
        return self.member_[rows].argmax(axis=1), self.slice_of_[rows].copy()

    def memberships(self, ids: Any) -> np.ndarray:
        """(n, S) booleans: the shards each live record belongs to."""
        return self.member_[self._live_rows(ids)].copy()





def _earliest_slices(member: np.ndarray, slices: np.ndarray) -> dict[int, int]:
    """Per shard holding any of these records, the earliest of their slices there."""
    out: dict[int, int] = {}
    for row, r in zip(member, slices.tolist(), strict=True):
        for s in np.flatnonzero(row).tolist():
            out[s] = min(r, out.get(s, r))
    return out
