"""One network that forgets a record by swapping in its leave-one-out twin.

:class:`LeaveOneOutMLP` trains with the masked leave-one-out schedule and defines the
retrain once (live records, deleted records as tombstone keys, the same seed and a batch
count frozen at ``fit``), so ``N_{-x}`` of its LOO set IS the model retrained without
``x``: a single deletion is a swap, anything else a retrain; a LOO set trained under another
batch count is refused (:meth:`~LeaveOneOutMLP.adopt_loo`).
See docs/learners.md (mlp: one network, deletions by swap)."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from sklearn.base import _fit_context

from jobs.learners.base import (
    UpdateReport,
    VerifyReport,
    encode_labels,
    ids_to_delete,
    records_to_add,
)
from jobs.learners.mlp import bundle
from jobs.learners.mlp.network_state import NO_KEYS, NetworkState
from jobs.learners.networks.estimator import NetworkClassifier
from jobs.learners.networks.hyperparameters import SEED, Widths, count, number
from jobs.learners.networks.loo_training import (
    LOOConfig,
    LOOSet,
    MLPParams,
    schedule_keys,
    train_loo,
)
from jobs.learners.networks.records import RecordTable
from jobs.learners.networks.torch_nets import n_batches, resolve_device


class LeaveOneOutMLP(NetworkClassifier):
    """A single MLP (inputs in [0, 1]^d) whose deletions are exact; see the module doc.

    Parameters
    ----------
    hidden : sequence of int
        Widths of the hidden ReLU layers.
    epochs : int
        Passes over the keyed batches.
    batch_size : int
        Sets the batch count ``B = ceil(n / batch_size)`` at :meth:`fit`; frozen after.
    lr, weight_decay : float
        Plain SGD: ``p <- p - lr (grad + weight_decay p)``.
    classes : sequence or None
        All labels the model may see (default: those of ``fit``'s ``y``).
    device : str
        ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``; chosen at :meth:`fit` and
        kept (:attr:`platform_`): the bits depend on the device type.
    random_state : int or None
        Seed of the initial weights and the keyed schedule (None: a fresh one).
    """

    guarantee = "exact"

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "hidden": [Widths()],
        "epochs": [count(1)],
        "batch_size": [count(1)],
        "lr": [number(0, None, "neither")],
        "weight_decay": [number(0, None, "left")],
        "classes": ["array-like", None],
        "device": [str, torch.device],
        "random_state": [SEED, None],
    }

    def __init__(self, *, hidden: Sequence[int] = (32,), epochs: int = 20,
                 batch_size: int = 32, lr: float = 0.1, weight_decay: float = 1e-5,
                 classes: Sequence[Any] | None = None, device: str = "auto",
                 random_state: int | None = None) -> None:
        self.hidden = hidden
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.classes = classes
        self.device = device
        self.random_state = random_state

    # ------------------------------------------------------------------ fit / update
    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X: Any, y: Any, *, record_ids: Any = None) -> LeaveOneOutMLP:
        """Train ``N`` on the records (the LOO set comes later: :meth:`fit_loo`);
        ``record_ids`` default to the row numbers."""
        rids, Xa, y = self._training_data(X, y, record_ids)
        classes = self._label_set(y, min_classes=2)
        device = resolve_device(self.device)
        rs = self.random_state
        config = LOOConfig(
            n_features=int(Xa.shape[1]), n_classes=len(classes),
            hidden=tuple(int(h) for h in self.hidden), epochs=int(self.epochs),
            batch_size=int(self.batch_size), n_batches=n_batches(len(rids), int(self.batch_size)),
            lr=float(self.lr), weight_decay=float(self.weight_decay),
            seed=secrets.randbits(31) if rs is None else int(rs))
        untrained = NetworkState(
            config, classes, device, {"device_type": device.type, "torch": torch.__version__},
            RecordTable.by_id(rids, Xa, encode_labels(y, classes, len(rids))), NO_KEYS,
            network=MLPParams([], []))
        self.classes_ = classes
        self.state_ = dataclasses.replace(untrained, network=untrained.retrained())
        return self

    def delete(self, ids: Any) -> UpdateReport:
        """Forget records by id: one record with the LOO set at hand is a swap to ``N_{-x}``,
        anything else a retrain of the one network. The LOO set is dropped either way."""
        state = self._fitted()
        t0 = time.perf_counter()
        records = state.records
        rids = ids_to_delete(ids, records.row)
        swap = state.loo is not None and len(rids) == 1
        keep = np.ones(len(records.ids), dtype=bool)
        keep[[records.row[i] for i in rids.tolist()]] = False
        self.state_ = state.with_records(  # every network of the LOO set but N_{-x} saw x
            records.take(keep),
            np.union1d(state.tombstones, schedule_keys(state.config.seed, rids.tolist())),
            state.loo.loo(rids[0]) if swap else None)
        return self._report("delete", rids, t0, swap)

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records: a retrain under the same definition (a re-added record's
        tombstone is lifted). The LOO set is dropped until it is trained again."""
        state = self._fitted()
        t0 = time.perf_counter()
        records = state.records
        rids, Xa, yi = records_to_add(ids, X, y, records.row, self.n_features_in_,
                                      self.classes_)
        if len(rids) == 0:
            return self._report("add", rids, t0, False)
        self.state_ = state.with_records(
            RecordTable.by_id(np.concatenate([records.ids, rids]),
                              np.concatenate([records.X, Xa]), np.concatenate([records.y, yi])),
            np.setdiff1d(state.tombstones, schedule_keys(state.config.seed, rids.tolist())))
        return self._report("add", rids, t0, False)

    def _report(self, op: str, rids: np.ndarray, t0: float, swap: bool) -> UpdateReport:
        return UpdateReport(
            op=op,  # type: ignore[arg-type]
            record_ids=[str(i) for i in rids], guarantee="exact",
            seconds=time.perf_counter() - t0,
            retrained={"swap": swap, "networks": 0 if swap or len(rids) == 0 else 1},
            metrics={"n_records": float(len(self.state_.records.ids))})

    # ------------------------------------------------------------------ the LOO set
    def fit_loo(self, chunk_size: int = 512) -> LOOSet:
        """Train the LOO set of the current records (``N`` and every ``N_{-x}``) and keep it."""
        state = self._fitted()
        r = state.records
        loo = train_loo(r.X, r.y, r.ids.tolist(), chunk_size=chunk_size, **state.train_args())
        self.adopt_loo(loo)
        return loo

    def adopt_loo(self, loo: LOOSet) -> None:
        """Keep ``loo`` for swaps: only the LOO set of exactly these records under the frozen
        definition (config with its batch count, tombstones), whose ``N`` is the served
        network bit for bit (ValueError otherwise)."""
        state = self._fitted()
        if loo.config != state.config:
            raise ValueError(f"the LOO set was trained with {loo.config}, the model is defined "
                             f"by {state.config} (a recomputed batch count is another model)")
        if loo.record_ids.astype(str).tolist() != state.records.ids.astype(str).tolist():
            raise ValueError("the LOO set holds other records than the model")
        if sorted(int(k) for k in loo.meta.get("tombstones", [])) != state.tombstones.tolist():
            raise ValueError("the LOO set was trained with other tombstones than the model's")
        if not loo.full().equal(state.network):
            raise ValueError("the LOO set's N is not the served network bit for bit (another "
                             "device type or torch build?)")
        self.state_ = dataclasses.replace(state, loo=loo)

    # ------------------------------------------------------------------ fitted state
    state_: NetworkState

    @property
    def config_(self) -> LOOConfig:
        """``T``'s definition, with the batch count frozen at :meth:`fit`."""
        return self._fitted().config

    @property
    def device_(self) -> torch.device:
        return self._fitted().device

    @property
    def tombstones_(self) -> np.ndarray:
        """Sorted schedule keys of the deleted records."""
        return self._fitted().tombstones

    @property
    def network_(self) -> MLPParams:
        return self._fitted().network

    @property
    def network_hash_(self) -> str:
        return self._fitted().network_hash

    @property
    def loo_(self) -> LOOSet | None:
        """The LOO set of the current records, or None until it is trained (again)."""
        return self._fitted().loo

    # ------------------------------------------------------------------ prediction
    def scores(self, X: Any) -> np.ndarray:
        """Logits in float64 (the function the LUCID bound reasons about)."""
        return self._fitted().network.logits(self._queries(X))

    # ------------------------------------------------------------------ verify, bundle
    def verify(self) -> VerifyReport:
        """Retrain from scratch under the frozen definition and compare bit for bit (and the
        kept LOO set's ``N`` with the served network)."""
        state = self._fitted()
        t0 = time.perf_counter()
        retrained = state.retrained().content_hash()
        loo_ok = state.loo is None or state.loo.full().equal(state.network)
        return VerifyReport(retrained == state.network_hash and loo_ok, state.network_hash,
                            retrained, time.perf_counter() - t0,
                            {"loo_set_matches": loo_ok, "n_batches": state.config.n_batches,
                             "device_type": state.device.type})

    def content_hash(self) -> str:
        return self._fitted().content_hash()

    def save(self, path: str | Path) -> None:
        """``meta.json`` and ``state.npz`` (network, records); the LOO set is the guard's to
        keep (:meth:`adopt_loo` after a load)."""
        bundle.save(path, self.get_params(deep=False), self._fitted())

    @classmethod
    def load(cls, path: str | Path) -> LeaveOneOutMLP:
        """Read a bundle written by :meth:`save`; checks the content hash."""
        params, state = bundle.load(path)
        return cls._restored(params, state, state.config.n_features, state.classes)


__all__ = ["LeaveOneOutMLP"]
