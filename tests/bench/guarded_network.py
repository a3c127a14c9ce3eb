"""A guarded network: label-only, eps-iDP answers from one verified MLP (LUCID, Alg. 2).

The benchmarks' and tests' stand-alone form of what the sidecar serves with
``--learner mlp`` (:class:`jobs.orchestration.served_model.GuardedMLPModel` with
:class:`jobs.learners.mlp.leave_one_out.LeaveOneOutMLP`, the service's own guard and memo):
``bench_guard.py`` measures accuracy through it without a ledger or a service.

:class:`GuardedNetwork` serves the full network N of a
:class:`~jobs.learners.networks.loo_training.LOOSet`
through :class:`~jobs.guard.label_guard.LabelGuard`:

* every query is clipped to [0, 1]^d (the box the bound was verified over);
* the label c = argmax N(x) (lowest index on ties) is published as is when
  its margin is STRICTLY above the verified bound beta_c (then no LOO network
  can answer differently);
* every other query goes through the exponential mechanism with ``epsilon``,
  memoised in an LRU memo of ``memo_size`` answers (oldest evicted), so that
  repeating a query replays its answer instead of resampling the noise;
* scores/logits are never returned (there is deliberately no public method
  that gives them).

A bound is only ever used for the network it was computed for. A
:class:`BoundBinding` ties per-class serving bounds to the content hash of the
LOO set they were computed on (``BoundReport.loo_hash``) and to the content
hash of that set's full network N. The guard is in *sound* mode exactly when a
binding exists whose hashes are those of the served LOO set and the served
network; otherwise it is in *noise-all* mode (every query noised). A report
for a different LOO set is not adopted (noise-all stays).

Deletion, the fast path (docs/PAPERS.md §1, "Connection to unlearning"):

1. :meth:`GuardedNetwork.swap_in_loo` makes N_{-x} the served model at once --
   it IS the exactly-unlearned model (same keyed schedule with x masked) --
   and, in the same atomic step, drops to noise-all: N's bound says nothing
   about N_{-x}, and no LOO set for the new data exists yet;
2. :meth:`GuardedNetwork.recompute_bounds` (a background job in the service)
   retrains the LOO set of the remaining records with the frozen
   hyper-parameters, the frozen batch count ``B`` and ``x``'s schedule key as a
   tombstone (an always-masked slot; the LOO set keeps the key in
   ``meta["tombstones"]``, never the id), checks that the new full network is
   bit-identical to the served N_{-x} (refusing to install otherwise), computes
   the new bounds and installs them: sound mode again, same served network.

One swap at a time: N_{-x,-y} is not in any LOO set, so a second deletion
before the recompute raises (the caller can fall back to a full retrain and
:meth:`GuardedNetwork.install`). Additions have no fast path: train a new LOO
set and :meth:`~GuardedNetwork.install` it (noise-all until its bound is in).

The memo is bound to the served network (its hash is the guard's version):
a noised answer of one model is never replayed for another.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jobs.guard.label_guard import LabelGuard, clip_unit, lucid_certain
from jobs.guard.lucid.binding import BoundBinding
from jobs.guard.lucid.branch_and_bound import BoundReport, compute_bounds
from jobs.learners.networks.loo_training import LOOSet, MLPParams, schedule_keys, train_loo

log = logging.getLogger(__name__)

SOUND = "sound"
NOISE_ALL = "noise-all"


def _plain(v: object) -> object:
    """numpy scalars -> Python scalars (ids as they appear in manifests)."""
    return v.item() if isinstance(v, np.generic) else v


@dataclass(frozen=True)
class _Serving:
    """One immutable serving state; swapped as a whole (so never a network with the
    wrong bound). ``betas`` is None in noise-all mode."""

    params: MLPParams
    network_hash: str
    Ws: tuple[np.ndarray, ...]  # float64, transposed: (in, out)
    bs: tuple[np.ndarray, ...]
    loo: LOOSet | None  # the LOO set whose N is ``params`` (None after a swap)
    loo_hash: str | None
    bound: BoundBinding | None
    betas: np.ndarray | None

    @classmethod
    def make(cls, params: MLPParams, loo: LOOSet | None, bound: BoundBinding | None,
             network_hash: str | None = None, loo_hash: str | None = None) -> _Serving:
        nh = network_hash or params.content_hash()
        lh = loo_hash if loo_hash is not None else (None if loo is None else loo.content_hash())
        sound = bound is not None and loo is not None and bound.matches(nh, lh)
        return cls(
            params, nh,
            tuple(np.ascontiguousarray(W.astype(np.float64).T) for W in params.weights),
            tuple(b.astype(np.float64) for b in params.biases),
            loo, lh, bound if sound else None,
            np.asarray(bound.beta, dtype=np.float64) if sound else None,
        )

    def logits(self, X: np.ndarray) -> np.ndarray:
        """Float64 logits of the float32 weights (the function the MILP reasons about)."""
        a = X.astype(np.float64)
        last = len(self.Ws) - 1
        for i, (W, b) in enumerate(zip(self.Ws, self.bs, strict=True)):
            a = a @ W + b
            if i < last:
                np.maximum(a, 0.0, out=a)
        return a


class GuardedNetwork:
    """Label-only serving of a LOO set's full network with LUCID's guard.

    Parameters
    ----------
    loo_set
        The LOO set (index 0 = the served network N).
    bound
        A :class:`~jobs.guard.lucid.branch_and_bound.BoundReport` computed on ``loo_set`` (or a
        :class:`BoundBinding`); without one, or with one for another set, the
        guard serves in noise-all mode until :meth:`set_bound` gets a match.
    epsilon
        The exponential mechanism's epsilon for uncertain queries.
    memo_size
        How many noised answers are remembered (LRU); size it to the
        attacker's memory (docs/PAPERS.md §1).
    random_state
        Seed of the mechanism's generator (tests, benchmarks); None = fresh entropy.
    """

    def __init__(self, loo_set: LOOSet, bound: BoundReport | BoundBinding | None = None, *,
                 epsilon: float = 1.0, memo_size: int = 100_000,
                 random_state: int | None = None) -> None:
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}")
        self.n_classes = loo_set.n_classes
        self.n_features = loo_set.config.n_features
        self._lock = threading.RLock()
        self._guard = LabelGuard(self.n_classes, epsilon=float(epsilon), memo_size=memo_size,
                                 random_state=random_state)
        self._pending: object | None = None  # record id swapped in, waiting for a recompute
        self._pending_ids: list[object] | None = None  # the records that remain after it
        self._swapped_from: LOOSet | None = None  # the LOO set N_{-x} was taken from
        self._state = _Serving.make(loo_set.full(), loo_set, None)
        self._guard.bind(self._state.network_hash, False)
        if bound is not None:
            self.set_bound(bound)

    # ------------------------------------------------------------------ state
    def _install_state(self, state: _Serving) -> None:
        with self._lock:
            self._state = state
            self._guard.bind(state.network_hash, state.betas is not None)

    @property
    def epsilon(self) -> float:
        return self._guard.epsilon

    @property
    def mode(self) -> str:
        """``"sound"`` (a verified bound for the served network) or ``"noise-all"``."""
        return SOUND if self._state.betas is not None else NOISE_ALL

    @property
    def sound(self) -> bool:
        return self._state.betas is not None

    @property
    def served_hash(self) -> str:
        """Content hash of the served network (:meth:`MLPParams.content_hash`)."""
        return self._state.network_hash

    @property
    def loo_hash(self) -> str | None:
        """Content hash of the served network's LOO set (None right after a swap)."""
        return self._state.loo_hash

    @property
    def bound(self) -> BoundBinding | None:
        """The binding in use (None in noise-all mode). Its betas are public anyway."""
        return self._state.bound

    @property
    def pending_deletion(self) -> object | None:
        """The record whose N_{-x} is served while its bound is being recomputed."""
        return self._pending

    @property
    def config(self):  # noqa: ANN201 - LOOConfig
        """The frozen training hyper-parameters (shared by every later retrain)."""
        return self._config_loo().config

    def _config_loo(self) -> LOOSet:
        return self._state.loo if self._state.loo is not None else self._swapped_from

    def counters(self) -> dict[str, int | str]:
        """Query counters for metrics: certain / noised (incl. memo replays) / memo hits
        / memo evictions / memo size, and the mode."""
        with self._lock:
            c = self._guard.counts
            return {"certain": c.certain, "noised": c.noised, "memo_hits": c.memo_hits,
                    "memo_evictions": self._guard.memo.evictions,
                    "memo_entries": len(self._guard.memo), "mode": self.mode}

    # ------------------------------------------------------------------ serving
    def predict(self, X: np.ndarray) -> np.ndarray:
        """Published labels (class indices) for the rows of ``X``; never scores."""
        X = np.asarray(X)
        if X.ndim == 1:
            X = X[None, :]
        if X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"queries must be (n, {self.n_features}), got {X.shape}")
        Xc = clip_unit(X)  # float32 without -0.0: the memo's key as well
        if np.isnan(Xc).any():
            raise ValueError("queries must not contain NaN")
        with self._lock:
            st = self._state
            scores = st.logits(Xc)
            if st.betas is not None:
                labels, certain = lucid_certain(scores, st.betas)
            else:
                labels = np.argmax(scores, axis=1)
                certain = np.zeros(len(Xc), dtype=bool)
            return self._guard.answer(Xc, labels, certain,
                                      lambda C: np.argmax(st.logits(C), axis=1))

    # ------------------------------------------------------------------ bounds
    def set_bound(self, bound: BoundReport | BoundBinding) -> bool:
        """Adopt ``bound`` if it was computed for the served network's LOO set.

        Returns whether the guard is now in sound mode. A bound for anything
        else is not adopted (the mode stays as it was, noise-all if no bound).
        """
        with self._lock:
            st = self._state
            if st.loo is None:
                log.warning("no LOO set for the served network (swap pending): bound ignored")
                return False
            if isinstance(bound, BoundReport):
                if bound.loo_hash != st.loo_hash:
                    log.warning("bound for LOO set %s does not match the served set %s: ignored",
                                bound.loo_hash[:12], (st.loo_hash or "")[:12])
                    return self.sound
                bound = BoundBinding.from_report(bound, st.loo)
            if not bound.matches(st.network_hash, st.loo_hash):
                log.warning("bound for network %s does not match the served %s: ignored",
                            bound.network_hash[:12], st.network_hash[:12])
                return self.sound
            self._install_state(_Serving.make(st.params, st.loo, bound, st.network_hash,
                                              st.loo_hash))
            return True

    def install(self, loo_set: LOOSet, bound: BoundReport | BoundBinding | None = None) -> bool:
        """Serve ``loo_set``'s full network, with ``bound`` if it matches (else noise-all).

        While a swap is pending, ``loo_set``'s N must be bit-identical to the
        served N_{-x} (ValueError otherwise); the swap is then complete.
        Returns whether the guard is in sound mode.
        """
        if loo_set.n_classes != self.n_classes or loo_set.config.n_features != self.n_features:
            raise ValueError(f"the guard serves {self.n_features} features and "
                             f"{self.n_classes} classes, the LOO set has "
                             f"{loo_set.config.n_features} and {loo_set.n_classes}")
        full = loo_set.full()
        with self._lock:
            if self._pending is not None:
                if not full.equal(self._state.params):
                    raise ValueError("the new LOO set's network differs from the swapped-in "
                                     f"N_-{self._pending!r}; refusing to install it")
                self._pending = None
                self._pending_ids = None
            binding = None
            if isinstance(bound, BoundReport):
                if bound.loo_hash == loo_set.content_hash():
                    binding = BoundBinding.from_report(bound, loo_set)
                else:
                    log.warning("bound does not match the installed LOO set: noise-all")
            elif bound is not None:
                binding = bound
            self._install_state(_Serving.make(full, loo_set, binding))
            return self.sound

    # ------------------------------------------------------------------ deletion
    def swap_in_loo(self, record_id: object) -> None:
        """Serve N_{-record_id} now (the exactly-unlearned model), in noise-all mode."""
        with self._lock:
            st = self._state
            if st.loo is None:
                raise RuntimeError(f"N_-{self._pending!r} is already swapped in; recompute its "
                                   "LOO set (recompute_bounds) before the next swap")
            net = st.loo.loo(record_id)  # KeyError for an unknown record
            rid = _plain(st.loo.record_ids[st.loo.index_of(record_id) - 1])
            self._swapped_from = st.loo
            self._pending = rid
            self._pending_ids = [_plain(v) for v in st.loo.record_ids.tolist() if v != rid]
            # one atomic state change: the new network without any bound
            self._install_state(_Serving.make(net, None, None))

    def retrain(self, X: np.ndarray, y: np.ndarray, ids: Sequence[object], *,
                chunk_size: int = 512, device: str | None = None) -> LOOSet:
        """The LOO set of the served data: frozen config, frozen B, deleted records' keys
        as tombstones.

        While a swap of x is pending, ``ids`` must be the old records minus x,
        and the new full network is checked to be bit-identical to the served
        N_{-x} (RuntimeError otherwise). Without a pending swap, ``ids`` must be
        the served LOO set's records (a recompute, e.g. with a bigger budget)
        and the retrain must reproduce that set's content hash.
        """
        with self._lock:
            base = self._config_loo()
            pending = self._pending
            expected = (self._pending_ids if pending is not None
                        else [_plain(v) for v in base.record_ids.tolist()])
            served = self._state.params
        given = [_plain(v) for v in ids]
        if sorted(map(repr, given)) != sorted(map(repr, expected)):
            raise ValueError("ids must be exactly the records of the served model "
                             f"({len(expected)} records), got {len(given)}")
        cfg = base.config
        tombstones = list(base.meta.get("tombstones", []))
        if pending is not None:
            tombstones += schedule_keys(cfg.seed, [pending]).tolist()
        meta = base.meta
        new = train_loo(
            X, y, given, n_classes=cfg.n_classes, hidden=cfg.hidden, epochs=cfg.epochs,
            batch_size=cfg.batch_size, lr=cfg.lr, weight_decay=cfg.weight_decay, seed=cfg.seed,
            n_batches=cfg.n_batches, tombstones=tombstones,
            device=device or meta.get("device", "cpu"), chunk_size=chunk_size,
            kernel=meta.get("kernel", "torch"), classes=base.classes,
        )
        if not new.full().equal(served):
            raise RuntimeError("the retrained full network is not bit-identical to the served "
                               "one (different data or device?)")
        if pending is None and new.content_hash() != base.content_hash():
            raise RuntimeError("the retrained LOO set differs from the served one")
        return new

    def recompute_bounds(self, X: np.ndarray, y: np.ndarray, ids: Sequence[object], *,
                         time_budget_s: float = 600.0, solver: str = "highs",
                         chunk_size: int = 512, device: str | None = None,
                         **bound_kwargs: object) -> BoundReport:
        """:meth:`retrain` on the remaining records, :func:`compute_bounds`, :meth:`install`.

        ``X, y, ids``: the records of the served model (after a swap: the old
        ones minus the deleted record, whose data is no longer needed).
        Until the install at the end the guard keeps serving in its current
        mode (noise-all after a swap). Returns the report; the guard is sound
        afterwards when the report's bound matches (always, unless it raised).
        """
        new = self.retrain(X, y, ids, chunk_size=chunk_size, device=device)
        report = compute_bounds(new, time_budget_s, solver, **bound_kwargs)
        self.install(new, report)
        return report


__all__ = ["NOISE_ALL", "SOUND", "GuardedNetwork"]
