"""One network that forgets a record by swapping in its leave-one-out twin.

:class:`LeaveOneOutMLP` trains a single ReLU MLP with the masked leave-one-out schedule of
:mod:`jobs.learners.networks.loo_training` (``T(D)``: keyed batches, plain SGD, float32, a batch
count ``B``
frozen from the training set at :meth:`~LeaveOneOutMLP.fit`). Retraining is defined once,
here: ``T`` on the live records, with every deleted record's schedule key as a tombstone
(an always-masked slot), the same seed and the same ``B``. So

* ``N_{-x}``, trained beside ``N`` in a LOO set (:meth:`~LeaveOneOutMLP.fit_loo`), IS the
  model retrained without ``x``: a deletion of one record while the LOO set of the
  current records is at hand serves ``N_{-x}`` at once (``retrained["swap"]``), with no
  training at all;
* any other update (several records, an addition, a second deletion before the LOO set
  of the new records exists) retrains the one network from scratch under the same
  definition -- tens of milliseconds for a thousand records on 2 cores;
* :meth:`~LeaveOneOutMLP.verify` retrains from scratch and compares the bits.

A recomputed batch count (``ceil((|D|-1) / batch_size)`` after a deletion) would be a
different training algorithm: the LOO set would no longer hold the retrained models. The
count is part of :attr:`config_` and a LOO set trained with another one is refused
(:meth:`~LeaveOneOutMLP.adopt_loo`).

What a deletion leaves: the served network ``N_{-x}``, the remaining records, and ``x``'s
64-bit keyed schedule key. The LOO set of the old records (every network in it saw ``x``,
except ``N_{-x}``) is dropped in the same step; the LOO set of the new records is trained
again in the background (the sidecar's guard job), as is the LUCID bound that rests on it
(:mod:`jobs.guard.lucid.branch_and_bound`). Bits are reproducible per device type: on CUDA the LOO
set's
slots are checked against the single network before they are adopted.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError

from jobs.learners.base import (
    Learner,
    UpdateReport,
    VerifyReport,
    check_features,
    encode_labels,
    ids_to_delete,
    read_bundle_meta,
    read_bundle_payload,
    records_to_add,
    unique_ids,
    write_bundle,
)
from jobs.learners.networks.loo_training import (
    LOOConfig,
    LOOSet,
    MLPParams,
    schedule_keys,
    train_loo,
    train_single,
)
from jobs.learners.networks.torch_nets import n_batches, resolve_device

FORMAT = "obliviate.loo-mlp/1"
_STATE = "state.npz"
_NO_KEYS = np.zeros(0, dtype=np.uint64)


class LeaveOneOutMLP(Learner, BaseEstimator):
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

    def __init__(self, hidden: Sequence[int] = (32,), epochs: int = 20, batch_size: int = 32,
                 lr: float = 0.1, weight_decay: float = 1e-5,
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

    # ------------------------------------------------------------------ helpers
    def _check_fitted(self) -> None:
        if not hasattr(self, "network_"):
            raise NotFittedError("LeaveOneOutMLP is not fitted; call fit first")

    def _kernel(self) -> str:
        # the compiled loop on the CPU; torch's batched ops on CUDA (loo._run)
        return "compiled" if self.device_.type == "cpu" else "torch"

    def _train_args(self) -> dict[str, Any]:
        """``train_single`` / ``train_loo`` arguments of THE retraining definition."""
        cfg = self.config_
        return {"n_classes": cfg.n_classes, "hidden": cfg.hidden, "epochs": cfg.epochs,
                "batch_size": cfg.batch_size, "lr": cfg.lr, "weight_decay": cfg.weight_decay,
                "seed": cfg.seed, "n_batches": cfg.n_batches,
                "tombstones": self.tombstones_.tolist(), "device": self.device_,
                "kernel": self._kernel()}

    def _retrain(self) -> MLPParams:
        return train_single(self.X_, self.y_, self.record_ids_.tolist(), **self._train_args())

    def _set_records(self, ids: np.ndarray, X: np.ndarray, y: np.ndarray) -> None:
        order = np.argsort(ids.astype(str), kind="stable")
        self.record_ids_ = ids[order]
        self.X_ = np.ascontiguousarray(X[order], dtype=np.float32)
        self.y_ = np.ascontiguousarray(y[order], dtype=np.int64)
        self._row = {rid: k for k, rid in enumerate(self.record_ids_.tolist())}

    def _set_network(self, net: MLPParams) -> None:
        self.network_ = net
        self.network_hash_ = net.content_hash()

    # ------------------------------------------------------------------ fit / update
    def fit(self, ids: Any, X: Any, y: Any) -> LeaveOneOutMLP:
        """Train ``N`` on the records (the LOO set comes later: :meth:`fit_loo`)."""
        rids = unique_ids(ids)
        if len(rids) == 0:
            raise ValueError("fit needs at least one record")
        Xa = check_features(X, len(rids), None, dtype=np.float32)
        yarr = np.asarray(y)
        if yarr.ndim != 1 or len(yarr) != len(rids):
            raise ValueError(f"y must be 1-D with {len(rids)} labels, got shape {yarr.shape}")
        rs = self.random_state
        if rs is not None and (isinstance(rs, bool) or not isinstance(rs, int | np.integer)):
            raise ValueError(f"random_state must be an int or None, got {type(rs).__name__}")
        classes = np.unique(yarr) if self.classes is None else np.asarray(list(self.classes))
        if len(classes) < 2 or len(np.unique(classes)) != len(classes):
            raise ValueError(f"need at least 2 distinct classes, got {classes.tolist()}")
        for name in ("epochs", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        self.classes_ = classes
        self.n_features_in_ = int(Xa.shape[1])
        self.device_ = resolve_device(self.device)
        self.platform_ = {"device_type": self.device_.type, "torch": torch.__version__}
        self.config_ = LOOConfig(
            n_features=self.n_features_in_, n_classes=len(classes),
            hidden=tuple(int(h) for h in self.hidden), epochs=int(self.epochs),
            batch_size=int(self.batch_size), n_batches=n_batches(len(rids), int(self.batch_size)),
            lr=float(self.lr), weight_decay=float(self.weight_decay),
            seed=secrets.randbits(31) if rs is None else int(rs))
        self.tombstones_ = _NO_KEYS
        self._set_records(rids, Xa, encode_labels(yarr, classes, len(rids)))
        self.loo_: LOOSet | None = None
        self._set_network(self._retrain())
        return self

    def delete(self, ids: Any) -> UpdateReport:
        """Forget records by id: one record with the LOO set at hand is a swap to ``N_{-x}``,
        anything else a retrain of the one network. The LOO set is dropped either way."""
        self._check_fitted()
        t0 = time.perf_counter()
        rids = ids_to_delete(ids, self._row)
        swap = self.loo_ is not None and len(rids) == 1
        net = self.loo_.loo(rids[0]) if swap else None
        keep = np.ones(len(self.record_ids_), dtype=bool)
        keep[[self._row[i] for i in rids.tolist()]] = False
        self.loo_ = None  # every network in it but N_{-x} was trained on x
        self.tombstones_ = np.union1d(self.tombstones_,
                                      schedule_keys(self.config_.seed, rids.tolist()))
        self._set_records(self.record_ids_[keep], self.X_[keep], self.y_[keep])
        if net is None:
            net = self._retrain()
        self._set_network(net)
        return self._report("delete", rids, t0, swap)

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records: a retrain under the same definition (a re-added record's
        tombstone is lifted). The LOO set is dropped until it is trained again."""
        self._check_fitted()
        t0 = time.perf_counter()
        rids, Xa, yi = records_to_add(ids, X, y, self._row, self.n_features_in_,
                                      self.classes_)
        if len(rids) == 0:
            return self._report("add", rids, t0, False)
        self.tombstones_ = np.setdiff1d(self.tombstones_,
                                        schedule_keys(self.config_.seed, rids.tolist()))
        self._set_records(np.concatenate([self.record_ids_, rids]),
                          np.concatenate([self.X_, Xa]), np.concatenate([self.y_, yi]))
        self.loo_ = None
        self._set_network(self._retrain())
        return self._report("add", rids, t0, False)

    def _report(self, op: str, rids: np.ndarray, t0: float, swap: bool) -> UpdateReport:
        return UpdateReport(
            op=op,  # type: ignore[arg-type]
            record_ids=[str(i) for i in rids], guarantee="exact",
            seconds=time.perf_counter() - t0,
            retrained={"swap": swap, "networks": 0 if swap or len(rids) == 0 else 1},
            metrics={"n_records": float(len(self.record_ids_))})

    # ------------------------------------------------------------------ the LOO set
    def fit_loo(self, chunk_size: int = 512) -> LOOSet:
        """Train the LOO set of the current records (``N`` and every ``N_{-x}``) and keep it."""
        self._check_fitted()
        loo = train_loo(self.X_, self.y_, self.record_ids_.tolist(), chunk_size=chunk_size,
                        **self._train_args())
        self.adopt_loo(loo)
        return loo

    def adopt_loo(self, loo: LOOSet) -> None:
        """Keep ``loo`` for swaps: only the LOO set of exactly these records under the frozen
        definition (config with its batch count, tombstones), whose ``N`` is the served
        network bit for bit (ValueError otherwise)."""
        self._check_fitted()
        if loo.config != self.config_:
            raise ValueError(f"the LOO set was trained with {loo.config}, the model is defined "
                             f"by {self.config_} (a recomputed batch count is another model)")
        if loo.record_ids.astype(str).tolist() != self.record_ids_.astype(str).tolist():
            raise ValueError("the LOO set holds other records than the model")
        if sorted(int(k) for k in loo.meta.get("tombstones", [])) != self.tombstones_.tolist():
            raise ValueError("the LOO set was trained with other tombstones than the model's")
        if not loo.full().equal(self.network_):
            raise ValueError("the LOO set's N is not the served network bit for bit (another "
                             "device type or torch build?)")
        self.loo_ = loo

    # ------------------------------------------------------------------ prediction
    @property
    def n_features_(self) -> int:
        return self.n_features_in_

    def scores(self, X: Any) -> np.ndarray:
        """Logits in float64 (the function the LUCID bound reasons about)."""
        self._check_fitted()
        return self.network_.logits(check_features(X, None, self.n_features_in_,
                                                   dtype=np.float32))

    # ------------------------------------------------------------------ verify
    def verify(self) -> VerifyReport:
        """Retrain from scratch under the frozen definition and compare bit for bit (and the
        kept LOO set's ``N`` with the served network)."""
        self._check_fitted()
        t0 = time.perf_counter()
        retrained = self._retrain().content_hash()
        loo_ok = self.loo_ is None or self.loo_.full().equal(self.network_)
        return VerifyReport(retrained == self.network_hash_ and loo_ok, self.network_hash_,
                            retrained, time.perf_counter() - t0,
                            {"loo_set_matches": loo_ok, "n_batches": self.config_.n_batches,
                             "device_type": self.device_.type})

    def content_hash(self) -> str:
        self._check_fitted()
        h = hashlib.sha256()
        h.update(json.dumps(self.config_.to_dict(), sort_keys=True).encode())
        h.update(json.dumps(self.classes_.tolist()).encode())
        h.update(json.dumps(self.record_ids_.tolist()).encode())
        h.update(self.tombstones_.tobytes())
        h.update(self.network_hash_.encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """``meta.json`` and ``state.npz`` (network, records); the LOO set is the guard's to
        keep (:meth:`adopt_loo` after a load)."""
        self._check_fitted()
        params = self.get_params(deep=False)
        params["hidden"] = list(params["hidden"])
        if params["classes"] is not None:
            params["classes"] = np.asarray(list(params["classes"])).tolist()
        meta = {"format": FORMAT, "params": params, "config": self.config_.to_dict(),
                "classes": self.classes_.tolist(), "classes_dtype": self.classes_.dtype.str,
                "record_ids": self.record_ids_.tolist(),
                "tombstone_keys": [str(k) for k in self.tombstones_.tolist()],
                "platform": self.platform_, "content_hash": self.content_hash()}
        arrays = {"X": self.X_, "y": self.y_}
        arrays.update({f"W{i}": W for i, W in enumerate(self.network_.weights)})
        arrays.update({f"b{i}": b for i, b in enumerate(self.network_.biases)})
        write_bundle(path, meta, _STATE, lambda fh: np.savez(fh, **arrays))

    @classmethod
    def load(cls, path: str | Path) -> LeaveOneOutMLP:
        """Read a bundle written by :meth:`save`; checks the content hash."""
        meta = read_bundle_meta(path, FORMAT, "leave-one-out MLP")
        params = dict(meta["params"])
        params["hidden"] = tuple(params["hidden"])
        if params["classes"] is not None:
            params["classes"] = tuple(params["classes"])
        self = cls(**params)
        with np.load(io.BytesIO(read_bundle_payload(path, _STATE).read()),
                     allow_pickle=False) as z:
            L = len([k for k in z.files if k.startswith("W")])
            net = MLPParams([z[f"W{i}"] for i in range(L)], [z[f"b{i}"] for i in range(L)])
            X, y = z["X"], z["y"]
        self.config_ = LOOConfig.from_dict(meta["config"])
        self.classes_ = np.asarray(meta["classes"], dtype=np.dtype(meta["classes_dtype"]))
        self.n_features_in_ = self.config_.n_features
        self.platform_ = meta["platform"]
        self.device_ = resolve_device(self.device)
        if self.device_.type != self.platform_["device_type"]:
            warnings.warn(f"trained on {self.platform_['device_type']}, loaded on "
                          f"{self.device_.type}: updates would mix devices and verify() may "
                          "report a bit-level mismatch", RuntimeWarning, stacklevel=2)
        self.tombstones_ = np.array([int(k) for k in meta["tombstone_keys"]], dtype=np.uint64)
        self._set_records(np.asarray(meta["record_ids"], dtype=object), X, y)
        self.loo_ = None
        self._set_network(net)
        if self.content_hash() != meta["content_hash"]:
            raise ValueError(f"{path}: content hash mismatch; the bundle is corrupt or altered")
        return self


__all__ = ["LeaveOneOutMLP"]
