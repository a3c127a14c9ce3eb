"""How the game learner's networks train: ``M_o`` (whose retrain from scratch is the
reference), the shadow and the surrogate, and the fine-tunes of updates, all with the
keyed, deterministic loop of :mod:`jobs.learners.networks.torch_nets`; and the frozen
attacker ``M_A`` trained once at ``fit`` from a shadow retrain.
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from jobs.learners.game.attacks import Attacker, pair_features_np
from jobs.learners.game.config import attack_config
from jobs.learners.game.state import GameRecords
from jobs.learners.keyed import prf_u64, prf_u64_many, prf_uniform_many
from jobs.learners.networks import torch_nets as nets
from jobs.learners.networks.training_spec import TrainingSpec


def keyed_pick(seed: int, tag: object, ids: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the ``k`` ids with the smallest keyed draw (a random subset of size k)."""
    mask = np.zeros(len(ids), dtype=bool)
    if k > 0:
        mask[np.argsort(prf_uniform_many(seed, tag, ids), kind="stable")[:k]] = True
    return mask


@dataclass(frozen=True)
class GameTrainer:
    """Trains and runs the networks of one learner (its spec)."""

    spec: TrainingSpec

    def new_net(self, seed: int | None = None) -> nn.Module:
        """An untrained network of the learner's architecture, initialised from ``seed``
        (None: left as built, for a state to be loaded into)."""
        spec = self.spec
        if spec.network is not None:  # the user's: its own initialisation, seeded
            return spec.network.build(spec.n_features, spec.n_classes, seed)
        net = nets.build_net(spec.config["model"], spec.n_features, spec.n_classes,
                             spec.config["hidden"])
        return net if seed is None else nets.init_net(net, seed)

    def kernels(self, *key: object) -> contextlib.AbstractContextManager[None]:
        """Deterministic kernels; for a user network also torch's random draws (dropout)
        seeded by ``key``, and an operation without a deterministic kernel refused by
        name."""
        network = self.spec.network
        if network is None:
            return nets.deterministic()
        return network.training(prf_u64(self.spec.seed, "user-rng", *key))

    def frozen(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """A network holding ``state`` on the device, without gradients."""
        net = self.new_net()
        net.load_state_dict(state)
        net = net.to(self.spec.device).eval()
        for q in net.parameters():
            q.requires_grad_(False)
        return net

    def train(self, ids: np.ndarray, X: np.ndarray, y: np.ndarray, init: str,
              stage: tuple[object, ...], epochs: int, start: nn.Module | None = None
              ) -> nn.Module:
        """A network trained on rows (ids sorted) from the seed ``init`` (or from ``start``)."""
        spec, cfg = self.spec, self.spec.config
        net = self.new_net(prf_u64(spec.seed, init)) if start is None else copy.deepcopy(start)
        net.to(spec.device)
        for p in net.parameters():
            p.requires_grad_(True)
        with spec.threads(), self.kernels(*stage):
            nets.train_stage(net, torch.from_numpy(X).to(spec.device),
                             torch.from_numpy(y).to(spec.device),
                             prf_u64_many(spec.seed, "batch", ids), seed=spec.seed,
                             stage_key=stage, epochs=epochs, batch_size=cfg["batch_size"],
                             lr=cfg["lr"])
        for p in net.parameters():
            p.requires_grad_(False)
        return net.eval()

    def main(self, records: GameRecords, rows: np.ndarray) -> nn.Module:
        """``M_o`` on these training rows: the definition of a retrain from scratch."""
        return self.train(records.ids[rows], records.X[rows], records.y[rows], "init",
                          ("main",), self.spec.config["epochs"])

    def surrogate(self, records: GameRecords, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The weights of the surrogate ``M_r'`` trained on these rows, from its own seed."""
        net = self.train(records.ids[rows], records.X[rows], records.y[rows],
                         "surrogate-init", ("surrogate",), self.spec.config["surrogate_epochs"])
        return nets.state_to_cpu(net)

    def probs(self, net: nn.Module, X: np.ndarray) -> np.ndarray:
        """Softmax outputs of ``net`` on float32 rows ``X``, float64 numpy."""
        if len(X) == 0:
            return np.zeros((0, self.spec.n_classes))
        with self.spec.threads(), nets.deterministic(), torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32)).to(self.spec.device)
            return F.softmax(net(x).double(), dim=1).cpu().numpy()

    def attacker(self, records: GameRecords, net: nn.Module, X_third: np.ndarray) -> Attacker:
        """``M_A`` from a shadow retrain without a keyed ``attack_fraction`` of the training
        rows: those are its positives; its negatives (``attack_negatives``) are pairs of
        ``D_third`` and of retained training records."""
        spec, cfg = self.spec, self.spec.config
        tr = records.train
        k = min(len(tr) - 1, max(1, round(cfg["attack_fraction"] * len(tr))))
        out = keyed_pick(spec.seed, "shadow", records.ids[tr], k)
        gone, kept = tr[out], tr[~out]
        shadow = self.main(records, kept)

        def pairs(X: np.ndarray) -> np.ndarray:
            return pair_features_np(self.probs(net, X), self.probs(shadow, X))

        pos = pairs(records.X[gone])
        negatives = []
        if cfg["attack_negatives"] in ("both", "nonmembers") and len(X_third):
            negatives.append(pairs(X_third))
        if cfg["attack_negatives"] in ("both", "members") or not negatives:
            m = min(len(kept), max(len(gone), len(X_third)))
            members = kept[keyed_pick(spec.seed, "attack-members", records.ids[kept], m)]
            negatives.append(pairs(records.X[members]))
        neg = np.concatenate(negatives)
        att = Attacker(pos.shape[1], attack_config(cfg), prf_u64(spec.seed, "attacker"))
        att = att.to(spec.device)
        with spec.threads():
            att.fit(np.concatenate([pos, neg]), np.r_[np.ones(len(pos)), np.zeros(len(neg))])
        return att
