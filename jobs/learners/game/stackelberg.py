"""One network that forgets by a Stackelberg game (Liu et al.): APPROXIMATE unlearning.

After a deletion the served network is NOT what a retrain would give, and nothing bounds
the gap; what it offers instead is measured: ``delete`` reports the frozen attacker's
advantage before and after, ``verify`` retrains and reports the gap, and
:func:`jobs.eval.evaluate_unlearning` measures more. Low attacker advantage alone does not
mean forgotten (docs/benchmarks.md, bench_game).
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

import copy
import dataclasses
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from sklearn.base import _fit_context
from sklearn.utils._param_validation import StrOptions
from torch import nn

from jobs.learners import base
from jobs.learners.base import UpdateReport, VerifyReport
from jobs.learners.game import bundle, checks, updates
from jobs.learners.game.attacks import Attacker, pair_features_np
from jobs.learners.game.config import resolve_config
from jobs.learners.game.state import GameRecords, GameState
from jobs.learners.game.training import GameTrainer, keyed_pick
from jobs.learners.networks import torch_nets as nets
from jobs.learners.networks.estimator import SpecClassifier
from jobs.learners.networks.hyperparameters import SEED, Widths, count, number
from jobs.learners.networks.training_spec import TrainingSpec
from jobs.learners.networks.user_network import UserNetwork

METHODS = ("game", "finetune")


class GameUnlearningNet(SpecClassifier):
    """One network (MLP or small CNN) that forgets by the game of Liu et al. (approximate).

    Parameters
    ----------
    model : {"mlp", "cnn"}
        ``"mlp"`` for tables; ``"cnn"`` for square one-channel images as flat rows.
    hidden : tuple of int
        Hidden widths of the MLP (or of the CNN's fully connected head).
    epochs, batch_size, lr : int, int, float
        Training of ``M_o`` (and of every retrain, shadow and surrogate): Adam
        with learning rate ``lr``, ``epochs`` epochs, keyed mini-batches of about
        ``batch_size`` records.
    third_fraction : float in [0, 1)
        Share of the records given to ``fit`` held out of training as ``D_third``
        when ``fit`` gets no ``X_third`` (ignored when it does).
    surrogate_fraction : float in (0, 1]
        Share of the training records the surrogate ``M_r'`` trains on (paper: 0.2).
    surrogate_epochs : int or None
        Epochs of the surrogate (``None``: ``epochs``).
    attack_fraction : float in (0, 1)
        Share of the training records the shadow retrain leaves out: the
        attacker's positive examples.
    attack_negatives : {"both", "nonmembers", "members"}
        The attacker's negative examples: ``D_third`` pairs ("nonmembers"), pairs
        of retained training records ("members"), or both (as many of each).
    attack_hidden, attack_steps, attack_lr, attack_batch_size
        The attacker network ``M_A`` (MLP, two-way softmax) and its training:
        ``attack_steps`` Adam steps over class-balanced keyed mini-batches.
    rounds : int
        Game rounds per deletion (paper: about 100); each is ``leader_steps``
        leader steps then ``follower_steps`` follower steps.
    leader_steps, follower_steps : int
        Gradient steps per round of each player.
    lam : float in (0, 1)
        The follower's target attack probability ``lambda`` (paper: 0.5).
    optimizer : {"sgd", "adam"}
        The players' optimiser; each player has its own, fresh at every
        deletion. The paper uses plain gradient descent ("sgd"); the default is
        Adam because the follower's gradient scales with how sharp the attacker
        is: with "sgd" a step size that moves a soft attacker overshoots a sharp
        one (measured: the advantage went UP on small memorising problems), and
        Adam's normalised steps do not depend on that scale.
    leader_lr, follower_lr : float
        Step sizes of the leader and the follower. The defaults (1e-3 each) kept
        test accuracy within about a point of the retrain in
        ``tests/bench/bench_game.py``; a follower 10x faster (1e-2) reduced the
        frozen attacker's advantage more on small memorising problems but cost
        up to 10 points of accuracy on breast cancer.
    distance_weight, ce_weight : float
        Weights of the two terms of the leader's loss (paper: 1 and 1).
    retain_batch_size, third_batch_size : int
        Records of the retain set and of ``D_third`` per leader step.
    forget_batch_size : int or None
        Records of the forget set per follower step (``None``: all of them).
    method : {"game", "finetune"}
        How :meth:`delete` forgets: the game (default), or the plain baseline
        of fine-tuning the network on the retain set for ``finetune_epochs``
        epochs (no surrogate, no follower; kept for comparison).
    finetune_epochs : int
        Epochs of ``method="finetune"``.
    add_epochs : int
        Fine-tuning epochs of :meth:`add`.
    add_replay : float >= 0
        Live training records replayed per new record while fine-tuning in :meth:`add`.
    network : str or None
        A network of your own instead of ``model``/``hidden``: the import path
        ``"package.module:build"`` of ``build(n_features, n_classes, **network_params)``
        returning a ``torch.nn.Module`` of logits (docs/learners.md, "Your own network").
        ``M_o``, every retrain, the shadow and the surrogate are that network; it is
        checked at ``fit``, trains under deterministic kernels with seeded random draws,
        and its source is pinned by SHA-256 and saved with the model.
    network_params : dict or None
        Keyword arguments of ``network``'s build function.
    classes : sequence or None
        All labels the model may ever see; ``None``: the labels present at fit.
    cpu_threads : int or None
        Intra-op CPU threads while training and predicting on CPU (``None``:
        torch's setting). Part of what makes bits reproducible.
    device : str
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ...
    random_state : int or None
        Seed of every keyed choice; ``None`` draws one at fit (kept in ``seed_``).
    """


    guarantee = "approximate"

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "model": [StrOptions({"mlp", "cnn"})],
        "hidden": [Widths()],
        "epochs": [count(1)],
        "batch_size": [count(1)],
        "lr": [number(0, None, "neither")],
        "third_fraction": [number(0, 1, "left")],
        "surrogate_fraction": [number(0, 1, "right")],
        "surrogate_epochs": [count(1), None],
        "attack_fraction": [number(0, 1, "neither")],
        "attack_negatives": [StrOptions({"both", "nonmembers", "members"})],
        "attack_hidden": [Widths()],
        "attack_steps": [count(1)],
        "attack_lr": [number(0, None, "neither")],
        "attack_batch_size": [count(1)],
        "rounds": [count(0)],
        "leader_steps": [count(0)],
        "follower_steps": [count(0)],
        "lam": [number(0, 1, "neither")],
        "optimizer": [StrOptions({"sgd", "adam"})],
        "leader_lr": [number(0, None, "neither")],
        "follower_lr": [number(0, None, "neither")],
        "distance_weight": [number(0, None, "left")],
        "ce_weight": [number(0, None, "left")],
        "retain_batch_size": [count(1)],
        "third_batch_size": [count(1)],
        "forget_batch_size": [count(1), None],
        "method": [StrOptions(set(METHODS))],
        "finetune_epochs": [count(0)],
        "add_epochs": [count(0)],
        "add_replay": [number(0, None, "left")],
        "network": [str, None],
        "network_params": [dict, None],
        "classes": ["array-like", None],
        "cpu_threads": [count(1), None],
        "device": [str, torch.device],
        "random_state": [SEED, None],
    }

    def __init__(
        self,
        *,
        model: str = "mlp",
        hidden: Sequence[int] = (64,),
        epochs: int = 30,
        batch_size: int = 32,
        lr: float = 0.01,
        third_fraction: float = 0.1,
        surrogate_fraction: float = 0.2,
        surrogate_epochs: int | None = None,
        attack_fraction: float = 0.1,
        attack_negatives: str = "both",
        attack_hidden: Sequence[int] = (32,),
        attack_steps: int = 500,
        attack_lr: float = 0.01,
        attack_batch_size: int = 64,
        rounds: int = 100,
        leader_steps: int = 1,
        follower_steps: int = 1,
        lam: float = 0.5,
        optimizer: str = "adam",
        leader_lr: float = 1e-3,
        follower_lr: float = 1e-3,
        distance_weight: float = 1.0,
        ce_weight: float = 1.0,
        retain_batch_size: int = 128,
        third_batch_size: int = 128,
        forget_batch_size: int | None = None,
        method: str = "game",
        finetune_epochs: int = 3,
        add_epochs: int = 5,
        add_replay: float = 1.0,
        network: str | None = None,
        network_params: dict[str, Any] | None = None,
        classes: Sequence[Any] | None = None,
        cpu_threads: int | None = 1,
        device: str = "auto",
        random_state: int | None = 0,
    ) -> None:
        self.model = model
        self.hidden = hidden
        self.epochs = epochs
        self.batch_size = batch_size
        self.lr = lr
        self.third_fraction = third_fraction
        self.surrogate_fraction = surrogate_fraction
        self.surrogate_epochs = surrogate_epochs
        self.attack_fraction = attack_fraction
        self.attack_negatives = attack_negatives
        self.attack_hidden = attack_hidden
        self.attack_steps = attack_steps
        self.attack_lr = attack_lr
        self.attack_batch_size = attack_batch_size
        self.rounds = rounds
        self.leader_steps = leader_steps
        self.follower_steps = follower_steps
        self.lam = lam
        self.optimizer = optimizer
        self.leader_lr = leader_lr
        self.follower_lr = follower_lr
        self.distance_weight = distance_weight
        self.ce_weight = ce_weight
        self.retain_batch_size = retain_batch_size
        self.third_batch_size = third_batch_size
        self.forget_batch_size = forget_batch_size
        self.method = method
        self.finetune_epochs = finetune_epochs
        self.add_epochs = add_epochs
        self.add_replay = add_replay
        self.network = network
        self.network_params = network_params
        self.classes = classes
        self.cpu_threads = cpu_threads
        self.device = device
        self.random_state = random_state

    # ------------------------------------------------------------------ fit

    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X: Any, y: Any, *, record_ids: Any = None,
            X_third: Any = None) -> GameUnlearningNet:
        """Train ``M_o`` on the records and prepare ``D_third``, ``M_r'`` and ``M_A``;
        ``record_ids`` default to the row numbers.

        ``X_third``: optional third-party inputs (no labels) disjoint from the
        training records; without it a keyed ``third_fraction`` of the records is
        held out of training and used instead.
        """
        t0 = time.perf_counter()
        cfg = resolve_config(self.get_params(deep=False))
        rids, Xa, y = self._training_data(X, y, record_ids)
        if cfg["model"] == "cnn" and self.network is None:
            nets.build_net("cnn", Xa.shape[1], 2, cfg["hidden"])  # refuses a non-square image
        classes = self._label_set(y, min_classes=2)
        network = None
        if self.network is not None:  # resolved and checked before anything trains
            network = UserNetwork.resolve(self.network, self.network_params)
            network.check(int(Xa.shape[1]), len(classes))
            cfg.update(model="network", network=network.record())
        rs = self.random_state
        spec = TrainingSpec(cfg, secrets.randbits(63) if rs is None else int(rs), classes,
                            int(Xa.shape[1]), nets.resolve_device(self.device), network)
        if X_third is None:
            third = keyed_pick(spec.seed, "third", rids, round(cfg["third_fraction"] * len(rids)))
            X_third_ext = np.zeros((0, spec.n_features), dtype=np.float32)
        else:
            third = np.zeros(len(rids), dtype=bool)
            X_third_ext = base.check_features(X_third, None, spec.n_features, np.float32)
        n_train = int((~third).sum())
        if n_train < 2:
            raise ValueError(f"fit needs at least 2 training records, got {n_train} "
                             "(after holding out third_fraction)")
        records = GameRecords.by_id(rids, Xa, base.encode_labels(y, classes, len(rids)),
                                    third=third)
        self.classes_ = classes
        self.state_, self.fit_seconds_ = _fitted_state(spec, records, X_third_ext, t0)
        return self

    # ------------------------------------------------------------------ fitted state

    state_: GameState

    @property
    def third_mask_(self) -> np.ndarray:
        """Rows of ``record_ids_`` held out as ``D_third``."""
        return self._fitted().records.third

    @property
    def train_mask_(self) -> np.ndarray:
        """Rows of ``record_ids_`` the network trains on (the others are held-out ``D_third``)."""
        return ~self._fitted().records.third

    @property
    def X_third_(self) -> np.ndarray:
        """The third-party inputs ``D_third``: held-out records, then the given ``X_third``."""
        return self._fitted().X_third

    @property
    def net_(self) -> nn.Module:
        """The served network."""
        return self._fitted().net

    @property
    def surrogate_ids_(self) -> np.ndarray:
        return self._fitted().surrogate_ids

    @property
    def attacker_(self) -> Attacker:
        """The frozen attacker ``M_A``."""
        return self._fitted().attacker

    @property
    def n_updates_(self) -> int:
        return self._fitted().n_updates

    @property
    def network_(self) -> dict[str, Any] | None:
        """The user network it trains (import path, SHA-256 of its source, params); None
        for a built-in network."""
        return self._fitted().spec.config.get("network")

    @property
    def exact_(self) -> bool:
        """Whether the served network is ``M_o`` retrained from scratch on the live
        training records (after ``fit`` or :meth:`exact_retrain`, until the next update
        that trains it): what an answer of it is certified against."""
        return self._fitted().exact

    # ------------------------------------------------------------------ prediction

    def scores(self, X: Any) -> np.ndarray:
        """Class probabilities (softmax of the network), shape (n, n_classes), float64."""
        state = self._fitted()
        return GameTrainer(state.spec).probs(state.net, self._queries(X))

    def attack_probability(self, X_forget: Any, before: Any) -> np.ndarray:
        """The frozen attacker's P("deleted") for rows, given their posteriors ``before``
        (the model's :meth:`scores` before the deletion) and the current model."""
        feats = pair_features_np(np.asarray(before), self.scores(X_forget))
        return self.attacker_.predict_proba(feats)

    # ------------------------------------------------------------------ updates

    def delete(self, ids: Any, method: str | None = None) -> UpdateReport:
        """Forget records by id with the game (APPROXIMATE; docs/learners.md).

        ``method`` overrides the constructor's ``method`` for this call
        (``"finetune"``: the plain baseline, e.g. to compare on a copy).

        Held-out ``D_third`` records are simply dropped (the network never trained
        on them). Raises :class:`UnknownRecordError` / :class:`DuplicateRecordError`
        for ids that are not live or named twice, and ``ValueError`` when the
        deletion would leave no training record; the model is unchanged on any error.
        ``metrics`` carries the frozen attacker's advantage on the deleted
        training records before (``priaa_before``, the model as it was) and after
        the game (``priaa`` = mean_i |p_i - 0.5|, ``priaa_avg`` = |mean_i p_i - 0.5|).
        """
        state = self._fitted()
        method = state.spec.config["method"] if method is None else method
        if method not in METHODS:
            raise ValueError(f"method must be 'game' or 'finetune', got {method!r}")
        rids = base.ids_to_delete(ids, state.records.row)
        self.state_, report = updates.delete(state, rids, method)
        return report

    def add(self, ids: Any, X: Any, y: Any) -> UpdateReport:
        """Learn new records by fine-tuning (APPROXIMATE: not a retrain on the larger set).

        The network trains ``add_epochs`` epochs on the new records plus a keyed
        replay sample of ``add_replay`` live training records per new one. Raises
        :class:`DuplicateRecordError` for an id already live (or named twice) and
        ``ValueError`` for a wrong shape, NaN/inf or an unknown label; the model
        is unchanged on any error.
        """
        state = self._fitted()
        rids, Xa, yi = base.records_to_add(ids, X, y, state.records.row, self.n_features_in_,
                                           self.classes_)
        self.state_, report = updates.add(state, rids, Xa, yi)
        return report

    # ------------------------------------------------------------------ hashes, verify, bundle

    def content_hash(self) -> str:
        """SHA-256 over the served network's weights (bit for bit), classes and architecture."""
        state = self._fitted()
        return checks.network_hash(state.spec, state.net)

    def retrain(self) -> GameUnlearningNet:
        """The reference: a copy whose network is ``M_o`` retrained from scratch on the
        live training records (surrogate, attacker and records shared with ``self``;
        updates on either replace, never mutate, what they share)."""
        ref = copy.copy(self)
        ref.state_ = dataclasses.replace(self._fitted(), net=checks.retrained(self._fitted()))
        return ref

    def exact_retrain(self) -> GameUnlearningNet:
        """A copy that is exact again: ``M_o`` and the frozen attacker retrained from
        scratch on the live records (:func:`checks.exact_state`); the sidecar publishes it
        to replace approximate versions. :meth:`verify` of the copy retrains once more and
        compares content hashes."""
        ref = copy.copy(self)
        ref.state_ = checks.exact_state(self._fitted())
        return ref

    def verify(self) -> VerifyReport:
        """Retrain ``M_o`` from scratch on the live training records and measure the gap.

        ``exact`` is True only when the weights are bit-identical (no update since
        ``fit``, or updates that happened to change nothing). ``detail`` holds the
        measured gap between the served and the retrained network on the live
        training records and on ``D_third``: prediction agreement, mean
        KL(retrained || served), accuracies on the training records, the largest
        probability difference, and the relative L2 distance of the weights.
        """
        return checks.verify(self._fitted())

    def save(self, path: str | Path) -> None:
        """Write ``path/meta.json`` (JSON) and ``path/state.pt`` (tensors only)."""
        bundle.save(path, self.get_params(deep=False), self._fitted())

    @classmethod
    def load(cls, path: str | Path) -> GameUnlearningNet:
        """Read a bundle written by :meth:`save`; checks the content hash."""
        params, state = bundle.load(path)
        return cls._restored(params, state, state.spec.n_features, state.spec.classes)


def _fitted_state(spec: TrainingSpec, records: GameRecords, X_third_ext: np.ndarray,
                  t0: float) -> tuple[GameState, dict[str, float]]:
    """``M_o`` trained on the training records, the surrogate ``M_r'`` on a keyed
    ``surrogate_fraction`` of them and the frozen attacker ``M_A``; and the seconds each
    took."""
    trainer = GameTrainer(spec)
    tr = records.train
    t1 = time.perf_counter()
    net = trainer.main(records, tr)
    t_main = time.perf_counter() - t1
    t1 = time.perf_counter()
    k_sur = max(1, round(spec.config["surrogate_fraction"] * len(tr)))
    sur_rows = tr[keyed_pick(spec.seed, "surrogate", records.ids[tr], k_sur)]
    surrogate = trainer.surrogate(records, sur_rows)
    t_sur = time.perf_counter() - t1
    t1 = time.perf_counter()
    X_third = np.concatenate([records.X[records.third], X_third_ext])
    attacker = trainer.attacker(records, net, X_third)
    t_att = time.perf_counter() - t1
    state = GameState(spec, spec.platform(), records, X_third_ext, net, records.ids[sur_rows],
                      surrogate, attacker)
    return state, {"main": t_main, "surrogate": t_sur, "attacker": t_att,
                   "total": time.perf_counter() - t0}
