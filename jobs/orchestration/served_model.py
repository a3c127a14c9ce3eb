"""A learner together with the guard that decides which of its answers are certain.

``dare``: the forest guard, updated with every update before publishing; ``sisa``: the SISA
vote rule, sound with no bound at all (a shard without one is fragile), per-shard bounds
added by the guard job; ``mlp``: LUCID's bound for its network and LOO set; ``game``: no
guard (no sound bound is known): plain labels, each said to be `approximate` or `exact`.
Each rule is sound for the current training set only.
See docs/DESIGN.md (Serving while forgetting)."""

from __future__ import annotations

import abc
import hashlib
import inspect
import io
import json
import logging
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from jobs import sealing
from jobs.guard.forest.forest_guard import ForestGuard
from jobs.guard.label_guard import lucid_certain, sisa_certain
from jobs.guard.lucid.binding import BoundBinding
from jobs.guard.lucid.branch_and_bound import compute_bounds
from jobs.guard.lucid.shard_bounds import ShardBounds, shard_bounds, shard_loo_work
from jobs.guard.lucid.solvers import jsonable_float
from jobs.learners.base import Learner
from jobs.learners.dare.forest import DaREForest
from jobs.learners.game.stackelberg import GameUnlearningNet
from jobs.learners.mlp.leave_one_out import LeaveOneOutMLP
from jobs.learners.networks.loo_training import LOOSet, loo_work
from jobs.learners.sisa.config import unused_params
from jobs.learners.sisa.ensemble import SISAEnsemble

log = logging.getLogger("obliviate.served_model")

LEARNER_DIR = "learner"
GUARD_DIR = "guard"
KIND_FILE = "served.json"

# Sidecar defaults: small enough to retrain, verify and guard in seconds on 2 cores.
# The seed is drawn afresh for every training (`secrets`): which shard holds whom, and every
# keyed choice, must not be guessable; it is recorded in the manifest (admins only).
DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    # features are scaled to [0, 1]: a fixed random-node domain, which no deletion moves
    "dare": {"n_estimators": 50, "max_depth": 8, "k": 10, "d_rmax": 1, "random_domain": 2.0},
    # plain SGD (the masked LOO schedule, sliced ones too: bounds need it) on a network
    # small enough for the guard job's LOO sets (a 400-record shard's in 2 s, its bound in
    # 20 s); the learner's own defaults (two layers of 64, an 8,000-step floor) learn more on
    # some tables but make a shard's LOO set take minutes on 2 cores (docs/learners.md, "SISA")
    "sisa": {"n_shards": 5, "n_slices": 1, "hidden": [32], "epochs_per_slice": 20,
             "min_steps": 0, "lr": 0.5, "batch_size": 32, "schedule": "loo"},
    # one network and its LOO set (n + 1 networks, trained by the guard job): small tables.
    # LUCID's rate: on breast cancer lr 0.1 gives acc 0.944 with 78% of answers certified,
    # lr 0.5 0.972 with 20% (the LOO networks move further apart)
    "mlp": {"hidden": [32], "epochs": 20, "batch_size": 32, "lr": 0.1},
    "game": {"hidden": [64], "epochs": 30},
}
# SISA with a network of the user's (`network`), no step floor: a plain Linear/ReLU MLP
# trains with the masked LOO schedule (per-shard bounds, as for the sidecar's own network),
# any other with Adam stages, served under the vote rule alone (docs/learners.md)
NETWORK_PARAMS: dict[str, Any] = {"n_shards": 5, "n_slices": 1, "epochs_per_slice": 20,
                                  "min_steps": 0, "batch_size": 32, "schedule": "auto"}


# A LOO set is n + 1 networks. On the CPU the guard job trains one only where that is
# estimated to take at most LOO_MAX_SECONDS, so that the exactness check sharing the job is
# not held back for hours by a large table (a 20,000-record shard: about two hours); such a
# shard stays fragile (SISA) and such a network in noise-all mode (mlp), both sound. The
# estimate: the compiled kernel's time per loo_work unit, measured on this project's 2-core
# machine (1.9 s for a 401-record shard of the sidecar's network, 0.4 s for a 130-record
# one, 174 s for a 130-record shard of SISA's table network, all within 10% of it).
LOO_MAX_SECONDS = 600.0
LOO_SECONDS_PER_UNIT = 1.1e-9


def loo_estimate_s(work: float, device: str) -> float:
    """Estimated seconds of a LOO set of `work` units
    (:func:`jobs.learners.networks.loo_training.loo_work`);
    0 on a GPU, where LOO sets train about 24x faster and the cap does not apply."""
    return 0.0 if device != "cpu" else work * LOO_SECONDS_PER_UNIT


def loo_too_large(work: float, device: str) -> str | None:
    """Why the guard job will not train this LOO set, or None when it will."""
    est = loo_estimate_s(work, device)
    if est <= LOO_MAX_SECONDS:
        return None
    return (f"LOO set too large for the CPU: estimated {est:.0f} s > {LOO_MAX_SECONDS:.0f} s "
            "(left without a bound, which is sound)")


def fresh_seed() -> int:
    """A seed no one can guess (never 0, never a default)."""
    return 1 + secrets.randbelow(2**31 - 1)


class ServedModel(abc.ABC):
    """The unit the registry stores and the service answers with."""

    kind: ClassVar[str]
    learner_cls: ClassVar[type[Learner]]
    # False: no guard certifies or noises its answers; they are its plain labels, each
    # promising only what the model's forgetting is (:attr:`forgetting`)
    guarded: ClassVar[bool] = True

    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    @classmethod
    def train(cls, kind: str, ids: np.ndarray, X: np.ndarray, y: np.ndarray,
              params: dict[str, Any] | None = None, fit_guard: bool = True) -> ServedModel:
        """Fit a new learner of `kind` on the records, and its guard unless told not to
        (then it answers in noise-all mode until a worker refits it)."""
        sub = _kind(kind)
        valid = set(inspect.signature(sub.learner_cls).parameters)
        unknown = sorted(set(params or {}) - valid)
        if unknown:
            raise ValueError(f"unknown parameter(s) of the {kind} learner: "
                             f"{', '.join(map(repr, unknown))} (valid: {', '.join(sorted(valid))})")
        merged = {**sub.defaults(params or {}), "random_state": fresh_seed(), **(params or {})}
        for key in ("hidden", "attack_hidden"):
            if key in merged:
                merged[key] = tuple(merged[key])
        model = sub(sub.learner_cls(**merged).fit(X, y, record_ids=ids))
        if fit_guard:
            model.refresh_guard()
        return model

    @classmethod
    def defaults(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The sidecar's hyperparameters under those given (`params` wins over them)."""
        return DEFAULT_PARAMS[cls.kind]

    @property
    def classes(self) -> np.ndarray:
        return self.learner.classes_

    def network_record(self) -> dict[str, Any] | None:
        """The user network the learner trains (path, source hash, params); None: its own."""
        return None

    @property
    def n_features(self) -> int:
        return int(self.learner.n_features_in_)

    @property
    def forgetting(self) -> str:
        """``"exact"``: the model is bit for bit a retrain from scratch on its live records
        (the exact learners, always); ``"approximate"``: an update left it otherwise."""
        return "exact"

    @property
    def device(self) -> str:
        """The device type the learner trains on (chosen at fit; the bits depend on it)."""
        dev = getattr(self.learner, "device_", None)
        return "cpu" if dev is None else str(getattr(dev, "type", dev))

    def params(self) -> dict[str, Any]:
        """Constructor hyperparameters (JSON-able), for the manifest."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in self.learner.get_params().items()}

    @property
    @abc.abstractmethod
    def guard_ready(self) -> bool:
        """Whether the guard's certainty rule is valid for the learner as it is now."""

    @abc.abstractmethod
    def certain(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(class index, certain) per clipped query; certain is all False when not ready."""

    def refresh_guard(self, bound_s: float | None = None) -> dict[str, Any]:
        """Make the guard valid for the current learner; returns its manifest record.
        `bound_s`: what a guard that searches for bounds part by part (SISA: per shard)
        may spend on each (None or 0: none). Here, a rule with nothing to fit."""
        return {**self.guard_record(), "seconds": 0.0}

    def update_guard(self, deleted: Sequence[str] = (), added: Sequence[str] = (),
                     grow_seconds: float | None = None) -> dict[str, Any]:
        """Bring the guard up to date after the learner deleted and added these records, in
        about the time of the update itself where the guard allows (else a refit).
        `grow_seconds`: a guard that can trade certainty for time (the forest guard) stops
        refining after this long and stays sound; :meth:`refresh_guard` completes it."""
        return self.refresh_guard()

    @property
    def guard_complete(self) -> bool:
        """False while an update left the guard sound but coarser than a refit."""
        return True

    @property
    def noise_all(self) -> bool:
        """The rule holds but certifies nothing until the guard job has run (the mlp
        learner between a deletion and its new bound): every answer is noised."""
        return False

    @abc.abstractmethod
    def guard_record(self) -> dict[str, Any]:
        """What the guard rests on (rule, bound summary), for the manifest."""

    def guard_hash(self) -> str | None:
        """Content hash of the guard state :meth:`save_guard` writes (None: it writes none),
        the same before saving and after loading: the manifest records it, and a load
        refuses a guard that is not the one published (:func:`load_as_published`)."""
        return None

    def class_bounds(self) -> list[float] | None:
        """Per class, the margin above which an answer is certain everywhere (for metrics);
        None for a rule that has no such number."""
        return None

    def vote_counts(self, X: np.ndarray) -> np.ndarray:
        """(n, C) votes of the shard models, for the private prediction mode."""
        raise ValueError(f"private prediction mode needs a SISA ensemble, not {self.kind!r}")

    def holdout_ids(self) -> np.ndarray:
        """Records of the model's data it never trained on (non-members for the privacy
        evaluation); empty for a learner that trains on every record."""
        return np.empty(0, dtype=object)

    def exact_replacement(self) -> ServedModel:
        """The model retrained from scratch on its live records, replacing an approximate
        one (only an approximate learner has anything to replace)."""
        raise ValueError(f"the {self.kind} learner is exact: nothing to replace")

    def plain_labels(self, X: np.ndarray) -> np.ndarray:
        """Unguarded class indices (benchmark baseline only: not private)."""
        return np.argmax(self.learner.scores(X), axis=1)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.learner.save(p / LEARNER_DIR)
        self.save_guard(p / GUARD_DIR)
        (p / KIND_FILE).write_text(json.dumps({"kind": self.kind}))

    @staticmethod
    def load(path: str | Path, with_guard: bool = True) -> ServedModel:
        p = Path(path)
        kind = json.loads((p / KIND_FILE).read_text())["kind"]
        sub = _kind(kind)
        model = sub(sub.learner_cls.load(p / LEARNER_DIR))
        if with_guard and (p / GUARD_DIR).exists():
            model.load_guard(p / GUARD_DIR)
        return model

    def save_guard(self, path: Path) -> None:  # noqa: B027 - a guard may have no state
        """Persist fitted guard state, if the guard has any."""

    def load_guard(self, path: Path) -> None:  # noqa: B027 - a guard may have no state
        """Install guard state written by :meth:`save_guard` (checked against the learner)."""

    def adopt_guard(self, path: Path) -> bool:
        """Take from another version's saved guard state what still holds for this learner;
        True if that made the guard finer. Here, nothing carries over."""
        return False


class ForestModel(ServedModel):
    kind = "dare"
    learner_cls = DaREForest

    def __init__(self, learner: DaREForest, guard: ForestGuard | None = None) -> None:
        super().__init__(learner)
        self.guard = guard

    @property
    def guard_ready(self) -> bool:
        return self.guard is not None and self.guard.mode == "sound"

    def certain(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.guard_ready:
            return self.plain_labels(X), np.zeros(len(X), dtype=bool)
        return self.guard.certain(X)

    def refresh_guard(self, bound_s: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        # a guard loaded with its version is valid already; one an update left coarser
        # (out of time) is refitted
        if not self.guard_ready or not self.guard_complete:
            self.guard = ForestGuard.fit(self.learner)
        return {**self.guard_record(), "seconds": time.perf_counter() - t0}

    def update_guard(self, deleted: Sequence[str] = (), added: Sequence[str] = (),
                     grow_seconds: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        if self.guard is None:
            self.guard = ForestGuard.fit(self.learner)
        else:
            self.guard.update(deleted, added, grow_seconds=grow_seconds)
        return {**self.guard_record(), "seconds": time.perf_counter() - t0}

    @property
    def guard_complete(self) -> bool:
        return self.guard is None or self.guard.complete

    def guard_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"rule": "forest-loo", "ready": self.guard_ready}
        if self.guard_ready:
            rec["bound"] = self.guard.bound_summary
        return rec

    def class_bounds(self) -> list[float] | None:
        if not self.guard_ready:
            return None
        # the margin needed never exceeds twice the largest move of one probability
        return [2.0 * self.guard.bound_summary["delta_max_bound"]] * len(self.classes)

    def guard_hash(self) -> str | None:
        return self.guard.state_hash() if self.guard_ready else None

    def save_guard(self, path: Path) -> None:
        if self.guard_ready:
            self.guard.save(path)

    def load_guard(self, path: Path) -> None:
        self.guard = ForestGuard.load(path, self.learner)


class ShardVoteModel(ServedModel):
    """The SISA vote rule with per-shard bounds where the ensemble admits them (the masked
    LOO schedule): a shard counts as fragile (bound +inf) until the guard job
    has computed the bound of its current network (:meth:`refresh_guard`), and again
    once an update retrains it (the bound is tied to the shard network's hash), so every
    answer is sound at every moment and answers improve as bounds arrive."""

    kind = "sisa"
    learner_cls = SISAEnsemble

    @classmethod
    def defaults(cls, params: dict[str, Any]) -> dict[str, Any]:
        return NETWORK_PARAMS if params.get("network") else DEFAULT_PARAMS[cls.kind]

    def network_record(self) -> dict[str, Any] | None:
        return self.learner.network_

    def params(self) -> dict[str, Any]:
        unused = unused_params(self.learner.config_)
        return {k: v for k, v in super().params().items() if k not in unused}

    def __init__(self, learner: SISAEnsemble) -> None:
        super().__init__(learner)
        S, C = len(learner.shard_sizes_), len(learner.classes_)
        self.bounds = ShardBounds.none(S, C)
        self.bound_info: dict[int, dict[str, Any]] = {}  # per shard: how it was computed
        # (bounds, shard networks, which bounds are current, the served bounds): see _served
        self._resolved: tuple[ShardBounds, tuple[Any, ...], np.ndarray, np.ndarray] | None = None

    @property
    def guard_ready(self) -> bool:
        return True

    @property
    def boundable(self) -> bool:
        """Whether the shards train with the masked LOO schedule (bounds exist)."""
        return self.learner.config_.get("schedule") == "loo"

    def _wanted(self) -> np.ndarray:
        """Shards that can have a bound: boundable, more than one record, a LOO set the
        guard job trains (:func:`loo_too_large`)."""
        if not self.boundable:
            return np.zeros(len(self.learner.shard_sizes_), dtype=bool)
        return np.array([n > 1 and self._too_large(s) is None
                         for s, n in enumerate(self.learner.shard_sizes_.tolist())], dtype=bool)

    def _too_large(self, s: int) -> str | None:
        return loo_too_large(shard_loo_work(self.learner, s), self.device)

    def _served(self) -> tuple[np.ndarray, np.ndarray]:
        """(which shards' bounds are current, the (S, C) bounds served). Hashing every
        shard's weights for each batch of queries doubled the guard's time, so the answer
        is kept while the bounds and every shard network object are those it was worked
        out for (a shard an update retrains gets a new network object)."""
        nets = self.learner.shard_networks_
        r = self._resolved
        if (r is None or r[0] is not self.bounds or len(r[1]) != len(nets)
                or any(a is not b for a, b in zip(r[1], nets, strict=True))):
            current = self.bounds.current(self.learner)
            r = self._resolved = (self.bounds, nets, current, self.bounds.masked(current))
        return r[2], r[3]

    @property
    def guard_complete(self) -> bool:
        return bool(self._served()[0][self._wanted()].all())

    def certain(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ens = self.learner
        return sisa_certain(ens.shard_logits(X), self._served()[1], ens.active_shards_,
                            max(1, ens.max_shards_per_record_))

    def refresh_guard(self, bound_s: float | None = None) -> dict[str, Any]:
        """Bound the shards that lack a bound for their current network, one after the
        other, until about `bound_s` has passed (at least one): a guard job publishes what
        it has, so bounds arrive one job at a time and the exactness check that shares
        the job is not held back by all of them."""
        t0 = time.perf_counter()
        todo = np.flatnonzero(self._wanted() & ~self._served()[0])
        reports: dict[int, Any] = {}
        for s in todo.tolist() if bound_s else []:
            if time.perf_counter() - t0 >= bound_s:
                break
            t1 = time.perf_counter()
            self.bounds = shard_bounds(self.learner, [s], previous=self.bounds,
                                       time_budget_s=bound_s, reports=reports)
            self.bound_info[s] = _bound_info(reports.get(s), time.perf_counter() - t1)
        return {**self.guard_record(), "seconds": time.perf_counter() - t0}

    def update_guard(self, deleted: Sequence[str] = (), added: Sequence[str] = (),
                     grow_seconds: float | None = None) -> dict[str, Any]:
        # nothing to do before publishing: a retrained shard's bound no longer matches
        # its network and is refused (+inf) until the guard job recomputes it
        return {**self.guard_record(), "seconds": 0.0}

    def vote_counts(self, X: np.ndarray) -> np.ndarray:
        pred = self.learner.shard_predictions(X)  # -1 for shards without records
        votes = np.zeros((pred.shape[1], len(self.classes)), dtype=np.int64)
        for row in pred:
            voted = row >= 0
            np.add.at(votes, (np.flatnonzero(voted), row[voted]), 1)
        return votes

    def guard_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"rule": "sisa-vote", "ready": True,
                               "n_shards": int(self.learner.n_shards)}
        if not self.boundable:  # "serves": which rule decides certainty (vote / bounds)
            rec.update(serves="vote", shard_bound="inf")
            if self.network_record() is not None:
                rec["why"] = (f"no per-shard bounds: {self.learner.bound_obstacle_}; "
                              "the vote rule needs none")
            return rec
        shards = []
        for s, ok in enumerate(self._served()[0].tolist()):
            row = {"shard": s, "current": ok,
                   "beta": [jsonable_float(b) for b in self.bounds.beta[s]] if ok else None}
            if ok:
                row.update(self.bound_info.get(s, {}))
            elif (why := self._too_large(s)) is not None:
                row["skipped"] = why
            shards.append(row)
        return {**rec, "serves": "bounds", "shard_bound": "per-shard",
                "bound": {"complete": self.guard_complete, "shards": shards}}

    def _guard_state(self) -> dict[str, Any]:
        """What :meth:`save_guard` writes (JSON)."""
        return {"networks": list(self.bounds.networks),
                "beta": [[jsonable_float(b) for b in row] for row in self.bounds.beta],
                "info": {str(s): v for s, v in self.bound_info.items()}}

    def guard_hash(self) -> str | None:
        return _digest(self._guard_state())

    def save_guard(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        sealing.write_file(path / SHARD_BOUNDS_FILE, json.dumps(self._guard_state()).encode())

    def load_guard(self, path: Path) -> None:
        if (path / SHARD_BOUNDS_FILE).exists():
            # rows of shards whose network differs are refused on use
            self.bounds, self.bound_info = self._read_bounds(path)

    def adopt_guard(self, path: Path) -> bool:
        """Another version's bounds for the shards whose network is the same here (a
        guard job that finished after an update retrained other shards)."""
        if not (path / SHARD_BOUNDS_FILE).exists():
            return False
        bounds, info = self._read_bounds(path)
        theirs = bounds.current(self.learner) & ~self._served()[0]
        if not theirs.any():
            return False
        self.bounds = ShardBounds(
            tuple(b if t else a for a, b, t in zip(self.bounds.networks, bounds.networks,
                                                  theirs, strict=True)),
            np.where(theirs[:, None], bounds.beta, self.bounds.beta))
        self.bound_info.update({s: info[s] for s in np.flatnonzero(theirs).tolist()
                                if s in info})
        return True

    def _read_bounds(self, path: Path) -> tuple[ShardBounds, dict[int, dict[str, Any]]]:
        data = json.loads(sealing.read_file(path / SHARD_BOUNDS_FILE))
        beta = np.array([[float(b) for b in row] for row in data["beta"]], dtype=np.float64)
        bounds = ShardBounds(tuple(data["networks"]), beta)
        bounds.for_ensemble(self.learner)  # ValueError for another ensemble's shape
        return bounds, {int(s): v for s, v in data["info"].items()}


class GuardedMLPModel(ServedModel):
    """One network served with LUCID's guard (:mod:`jobs.guard.lucid.branch_and_bound`): an answer
    is certain
    when its logit margin is strictly above the bound of its class, computed over the
    network's LOO set. The guard job trains the LOO set of the current records and bounds
    it (:meth:`refresh_guard`); a deletion swaps in ``N_{-x}`` (the learner drops the LOO
    set) and the version answers in noise-all mode until the guard job has the LOO set
    and bound of the new records. Bound and LOO set are tied to the content hashes of
    the networks they cover and refused for any other."""

    kind = "mlp"
    learner_cls = LeaveOneOutMLP

    def __init__(self, learner: LeaveOneOutMLP) -> None:
        super().__init__(learner)
        self.binding: BoundBinding | None = None
        self.bound_info: dict[str, Any] = {}
        # (LOO set, its content hash): hashing it per query batch would cost milliseconds
        self._loo_hash: tuple[LOOSet, str] | None = None

    @property
    def guard_ready(self) -> bool:
        return True  # noise-all until a bound holds: sound at every moment

    def _loo_digest(self) -> str | None:
        loo = self.learner.loo_
        if loo is None:
            return None
        if self._loo_hash is None or self._loo_hash[0] is not loo:
            self._loo_hash = (loo, loo.content_hash())
        return self._loo_hash[1]

    def _betas(self) -> np.ndarray | None:
        """The bound's betas if it is the bound of the served network's LOO set."""
        b = self.binding
        if b is None or not b.matches(self.learner.network_hash_, self._loo_digest()):
            return None
        return np.asarray(b.beta, dtype=np.float64)

    @property
    def guard_complete(self) -> bool:
        return self._betas() is not None

    @property
    def noise_all(self) -> bool:
        return self._betas() is None

    def _too_large(self) -> str | None:
        m = self.learner
        if m.loo_ is not None:
            return None  # at hand (a test's, or one trained before): bounding it is cheap
        cfg = m.config_
        widths = [cfg.n_features, *cfg.hidden, cfg.n_classes]
        return loo_too_large(loo_work(len(m.record_ids_), cfg.epochs, widths), self.device)

    def certain(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scores = self.learner.scores(X)
        betas = self._betas()
        if betas is None:
            return np.argmax(scores, axis=1), np.zeros(len(X), dtype=bool)
        return lucid_certain(scores, betas)

    def refresh_guard(self, bound_s: float | None = None) -> dict[str, Any]:
        """Train the LOO set of the current records if there is none, then bound it for
        about `bound_s` (anytime: what the search has proved when time runs out)."""
        t0 = time.perf_counter()
        if bound_s and self._betas() is None and self._too_large() is None:
            loo = self.learner.loo_
            if loo is None:
                loo = self.learner.fit_loo()
            t1 = time.perf_counter()
            report = compute_bounds(loo, float(bound_s))
            self.binding = BoundBinding.from_report(report, loo)
            self.bound_info = {**_bound_info(report, time.perf_counter() - t1),
                               "loo_seconds": round(t1 - t0, 3)}
        return {**self.guard_record(), "seconds": time.perf_counter() - t0}

    def guard_record(self) -> dict[str, Any]:
        betas = self._betas()
        rec: dict[str, Any] = {"rule": "lucid", "ready": True,
                               "mode": "sound" if betas is not None else "noise-all"}
        bound: dict[str, Any] = {"complete": betas is not None,
                                 "network_hash": self.learner.network_hash_,
                                 "loo_set": self.learner.loo_ is not None}
        if betas is None and (why := self._too_large()) is not None:
            bound["skipped"] = why
        if betas is not None:
            bound.update(beta=[jsonable_float(b) for b in betas], **self.bound_info)
        return {**rec, "bound": bound}

    def class_bounds(self) -> list[float] | None:
        betas = self._betas()
        return None if betas is None else betas.tolist()

    def _bound_state(self) -> dict[str, Any] | None:
        """What :meth:`save_guard` writes of the bound (JSON); None without one."""
        if self._betas() is None:
            return None
        b = self.binding
        return {"network_hash": b.network_hash, "loo_hash": b.loo_hash,
                "beta": [jsonable_float(v) for v in b.beta], "info": self.bound_info}

    def guard_hash(self) -> str | None:
        loo = self._loo_digest()
        return None if loo is None else _digest({"loo_set": loo, "bound": self._bound_state()})

    def save_guard(self, path: Path) -> None:
        loo = self.learner.loo_
        if loo is None:
            return
        path.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        loo.write(buf)
        sealing.write_file(path / LOO_SET_FILE, buf.getbuffer())
        if (bound := self._bound_state()) is not None:
            sealing.write_file(path / BOUND_FILE, json.dumps(bound).encode())

    def load_guard(self, path: Path) -> None:
        """Install a saved LOO set and bound: the LOO set only if its ``N`` is the served
        network under the frozen definition, the bound only if its hashes are those of
        that network and LOO set (ValueError otherwise; a sealed file that was altered
        fails to open)."""
        if not (path / LOO_SET_FILE).exists():
            return
        loo = LOOSet.load(io.BytesIO(sealing.read_file(path / LOO_SET_FILE)))
        self.learner.adopt_loo(loo)
        if (path / BOUND_FILE).exists():
            data = json.loads(sealing.read_file(path / BOUND_FILE))
            binding = BoundBinding(data["network_hash"], data["loo_hash"],
                                   tuple(float(v) for v in data["beta"]))
            if not binding.matches(self.learner.network_hash_, self._loo_digest()):
                raise ValueError("the saved bound is not the bound of this network and LOO set")
            if len(binding.beta) != len(self.classes) or any(np.isnan(binding.beta)):
                raise ValueError("the saved bound does not give one number per class")
            self.binding, self.bound_info = binding, data["info"]

    def adopt_guard(self, path: Path) -> bool:
        """Another version's LOO set and bound hold here only for the same network and
        records (a guard job that finished after an update that changed nothing)."""
        if self.guard_complete:
            return False
        try:
            self.load_guard(path)
        except ValueError:
            return False
        return self.guard_complete


class GameModel(ServedModel):
    """The game learner, unguarded: its answers are the network's labels, `approximate`
    while a game update is served and `exact` once the worker's exact retrain replaced
    it (docs/sidecar.md, "The game learner in the sidecar")."""

    kind = "game"
    learner_cls = GameUnlearningNet
    guarded = False

    @property
    def guard_ready(self) -> bool:
        return False

    @property
    def forgetting(self) -> str:
        return "exact" if self.learner.exact_ else "approximate"

    def certain(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.plain_labels(X), np.zeros(len(X), dtype=bool)

    def network_record(self) -> dict[str, Any] | None:
        return self.learner.network_

    def exact_replacement(self) -> GameModel:
        return GameModel(self.learner.exact_retrain())

    def guard_record(self) -> dict[str, Any]:
        return {"rule": UNGUARDED, "ready": False, "answers": self.forgetting,
                "reason": "no sound bound is known for the game's network: answers are "
                          "its plain labels, each saying whether the version is the game's "
                          "approximate update or an exact retrain"}

    def vote_counts(self, X: np.ndarray) -> np.ndarray:
        """(n, C) votes of the shard models, for the private prediction mode."""
        raise ValueError(f"private prediction mode needs a SISA ensemble, not {self.kind!r}")

    def holdout_ids(self) -> np.ndarray:
        learner = self.learner
        return learner.record_ids_[~learner.train_mask_]


UNGUARDED = "none"  # the guard rule of a model that no guard covers (GameModel)
SHARD_BOUNDS_FILE = "shard_bounds.json"
LOO_SET_FILE = "loo_set.npz"
BOUND_FILE = "bound.json"


def _bound_info(report: Any, seconds: float) -> dict[str, Any]:
    """How a shard's bound was computed, for the manifest (solver, status, gap)."""
    if report is None:
        return {"seconds": round(seconds, 3), "status": "one record or none: no bound"}
    man = report.manifest()
    milps = [m for cb in report.per_class.values() for m in cb.milps]
    gaps = [m["gap"] for m in milps if isinstance(m.get("gap"), float)]
    return {"seconds": round(seconds, 3), "solvers": man["solvers_used"],
            "loo_hash": report.loo_hash,
            "status": sorted({cb.stop_reason for cb in report.per_class.values()}),
            "exact": all(cb.exact for cb in report.per_class.values()),
            "max_gap": max(gaps) if gaps else None, "n_milps": man.get("n_milps")}


def _digest(state: Any) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


class NotAsPublished(ValueError):
    """A version's files are not the model its manifest says was published."""


def load_as_published(path: str | Path, manifest: dict[str, Any]) -> ServedModel:
    """Load a version's files and hold them to its manifest: the learner's kind and content
    hash, and the guard's content hash. A guard the manifest records must be there (never a
    silent noise-all), and one it does not record must not be."""
    p = Path(path)
    if "content_hash" not in manifest["guard"]:
        return _load_unhashed_guard(p, manifest)
    recorded = manifest["guard"]["content_hash"]
    if (recorded is not None) != (p / GUARD_DIR).is_dir():
        raise NotAsPublished(f"its guard ({GUARD_DIR}/) is missing, though its manifest "
                             "records one" if recorded is not None else
                             f"it holds a guard ({GUARD_DIR}/) its manifest does not record")
    model = ServedModel.load(p)
    network = model.network_record()
    for what, got, want in (("learner", model.kind, manifest["learner"]),
                            ("network's source", network and network["sha256"],
                             manifest.get("network", {}).get("sha256")),
                            ("learner's content hash", model.learner.content_hash(),
                             manifest["content_hash"]),
                            ("guard's content hash", model.guard_hash(), recorded)):
        if got != want:
            raise NotAsPublished(f"its {what} is {_short(got)}, its manifest says "
                                 f"{_short(want)}")
    return model


def _load_unhashed_guard(path: Path, manifest: dict[str, Any]) -> ServedModel:
    """A version published before guards were hashed: its learner is held to the manifest,
    its guard files cannot be and are not loaded. It answers in noise-all mode (sound)
    until the worker refits its guard and publishes it (:func:`guard_owed`)."""
    log.warning("the manifest of %s records no content hash of its guard (published before "
                "guards were hashed): its guard is not loaded, answers are noised until the "
                "worker publishes a refitted one", path.name)
    model = ServedModel.load(path, with_guard=False)
    if (model.kind, model.learner.content_hash()) != (manifest["learner"],
                                                      manifest["content_hash"]):
        raise NotAsPublished(f"its learner is {model.kind} {_short(model.learner.content_hash())}"
                             f", its manifest says {manifest['learner']} "
                             f"{_short(manifest['content_hash'])}")
    return model


def guard_owed(manifest: dict[str, Any]) -> bool:
    """The version answers in noise-all mode until its guard is refitted: it was published
    without it, or before guards were hashed (a learner with no guard by design owes
    nothing, but an approximate one owes its exact retrain: :func:`exact_owed`)."""
    guard = manifest["guard"]
    unhashed = "content_hash" not in guard
    return ((unhashed or not guard["ready"]) and guard["rule"] not in ("noise-all", UNGUARDED)
            or exact_owed(manifest))


def exact_owed(manifest: dict[str, Any]) -> bool:
    """The version is an approximate update: the worker owes it an exact retrain that
    replaces it (docs/sidecar.md, "The game learner in the sidecar"). A manifest from
    before `forgetting` was recorded: an approximate learner's version not trained from
    scratch."""
    forgetting = manifest.get("forgetting")
    if forgetting is None:
        fresh = (manifest.get("change") or {}).get("op") in ("train", "retrain")
        approximate = manifest.get("guarantee") == "approximate" and not fresh
        forgetting = "approximate" if approximate else "exact"
    return forgetting == "approximate"


def _short(value: str | None) -> str:
    return repr(value if value is None or len(value) <= 20 else value[:16] + "...")


KINDS: dict[str, type[ServedModel]] = {
    m.kind: m for m in (ForestModel, ShardVoteModel, GuardedMLPModel, GameModel)}


def _kind(kind: str) -> type[ServedModel]:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown learner {kind!r}; choose one of {sorted(KINDS)}") from None
