"""What can be checked of a game-unlearning network: the content hash of the network it
serves, and the measured gap to a retrain from scratch (it is approximate: ``exact`` only
while no update has changed the bits).
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import numpy as np
import torch
from torch import nn

from jobs.learners.base import VerifyReport
from jobs.learners.game.state import FORMAT, GameState
from jobs.learners.game.training import GameTrainer
from jobs.learners.networks import torch_nets as nets
from jobs.learners.networks.training_spec import TrainingSpec
from jobs.learners.scoring import accuracy, agreement, mean_kl


def network_hash(spec: TrainingSpec, net: nn.Module) -> str:
    """SHA-256 over a network's weights (bit for bit), the classes and the architecture."""
    head = {"format": FORMAT, "classes": [str(c) for c in spec.classes.tolist()],
            "n_features": spec.n_features, "model": spec.config["model"],
            "hidden": spec.config["hidden"]}
    if (network := spec.config.get("network")) is not None:  # the user's, by source hash
        head["network"] = network["sha256"]
    weights = nets.hash_state(nets.state_to_cpu(net)).encode()
    return hashlib.sha256(json.dumps(head, sort_keys=True).encode() + weights).hexdigest()


def retrained(state: GameState) -> nn.Module:
    """``M_o`` retrained from its seed on the live training records."""
    return GameTrainer(state.spec).main(state.records, state.records.train)


def exact_state(state: GameState) -> GameState:
    """The exact replacement of ``state``: ``M_o`` retrained from scratch on the live
    training records and the frozen attacker ``M_A`` trained again from it (its shadow
    and positives drawn from the live records, so nothing in it derives from a deleted
    record; the surrogate already holds none). Deterministic: the same live records give
    the same bits."""
    trainer = GameTrainer(state.spec)
    net = retrained(state)
    attacker = trainer.attacker(state.records, net, state.X_third)
    return dataclasses.replace(state, net=net, attacker=attacker, exact=True)


def verify(state: GameState) -> VerifyReport:
    """Retrain ``M_o`` from scratch on the live training records and measure the gap:
    prediction agreement, mean KL(retrained || served), accuracies, the largest
    probability difference and the relative L2 distance of the weights."""
    t0 = time.perf_counter()
    spec, records = state.spec, state.records
    tr = records.train
    fresh = retrained(state)
    served, again = network_hash(spec, state.net), network_hash(spec, fresh)
    trainer = GameTrainer(spec)
    Xtr, Xth = records.X[tr], state.X_third
    ps, pr = trainer.probs(state.net, Xtr), trainer.probs(fresh, Xtr)
    ts, trd = trainer.probs(state.net, Xth), trainer.probs(fresh, Xth)
    ws = torch.cat([p.detach().cpu().flatten() for p in state.net.parameters()])
    wr = torch.cat([p.detach().cpu().flatten() for p in fresh.parameters()])
    detail = {
        "definition": "M_o retrained from its seed on the live training records "
                      "(held-out D_third excluded, added records included)",
        "guarantee": "approximate",
        "n_records": len(records.ids),
        "n_train": len(tr),
        "n_updates": state.n_updates,
        "exact_state": state.exact,
        "agreement_train": agreement(pr, ps),
        "agreement_third": agreement(trd, ts),
        "kl_train": mean_kl(pr, ps),
        "kl_third": mean_kl(trd, ts),
        "acc_train_served": accuracy(ps, records.y[tr]),
        "acc_train_retrained": accuracy(pr, records.y[tr]),
        "max_abs_prob_diff": float(max(np.abs(ps - pr).max(initial=0.0),
                                       np.abs(ts - trd).max(initial=0.0))),
        "weight_rel_distance": float((ws - wr).norm() / max(float(wr.norm()), 1e-12)),
        "platform": spec.platform(),
    }
    return VerifyReport(served == again, served, again, time.perf_counter() - t0, detail)
