"""Deletions (the game, or plain fine-tuning) and additions (fine-tuning with replay) of the
game learner: APPROXIMATE, measured. Each returns a new state; the old one is left as it
was, so a refused request changes nothing.
See docs/learners.md (How the game learner plays)."""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np
import torch
from torch import nn

from jobs.learners.base import UpdateReport
from jobs.learners.game.attacks import pair_features_np
from jobs.learners.game.config import GameRules
from jobs.learners.game.play import Players, play
from jobs.learners.game.state import GameState
from jobs.learners.game.training import GameTrainer, keyed_pick
from jobs.learners.keyed import prf_u64
from jobs.learners.scoring import accuracy, priaa


def delete(state: GameState, rids: np.ndarray,
           method: str) -> tuple[GameState, UpdateReport]:
    """Forget the live records ``rids`` (checked by the caller) with ``method``; held-out
    ``D_third`` records are just dropped (the network never trained on them)."""
    t0 = time.perf_counter()
    records = state.records
    gone = np.zeros(len(records.ids), dtype=bool)
    gone[[records.row[i] for i in rids.tolist()]] = True
    rows_f = np.flatnonzero(gone & ~records.third)
    rows_r = np.flatnonzero(~gone & ~records.third)
    if len(rows_f) and len(rows_r) == 0:
        raise ValueError("a deletion may not remove every training record of the network")
    metrics: dict[str, float] = {
        "n_forget": float(len(rows_f)), "n_third_dropped": float(len(rids) - len(rows_f)),
        "rounds": float(state.spec.config["rounds"] if len(rows_f) and method == "game" else 0)}
    new = state  # the game may retrain the surrogate: then its ids are a new array
    if len(rows_f):
        new, net = _forget(state, rows_f, rows_r, method, metrics)
        new = dataclasses.replace(new, net=net)
    # dropping held-out records only leaves M_o what a retrain gives
    new = dataclasses.replace(new, records=records.take(~gone), n_updates=state.n_updates + 1,
                              exact=state.exact and not len(rows_f))
    metrics["n_records"] = float(len(new.records.ids))
    return new, UpdateReport(
        op="delete", record_ids=[str(i) for i in rids], guarantee="approximate",
        seconds=time.perf_counter() - t0,
        retrained={"method": method if len(rows_f) else "none",
                   "surrogate_retrained": new.surrogate_ids is not state.surrogate_ids},
        metrics=metrics)


def _forget(state: GameState, rows_f: np.ndarray, rows_r: np.ndarray, method: str,
            metrics: dict[str, float]) -> tuple[GameState, nn.Module]:
    """The network after forgetting rows ``rows_f`` (and the state with the surrogate the
    game used); the frozen attacker's view before and after goes into ``metrics``."""
    trainer = GameTrainer(state.spec)
    records, cfg = state.records, state.spec.config
    net = copy.deepcopy(state.net)
    Xf = records.X[rows_f]
    before = trainer.probs(net, Xf)
    t1 = time.perf_counter()
    if method == "game":
        state = _without_in_surrogate(state, rows_f, rows_r)
        metrics["surrogate_seconds"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        metrics.update(_played(state, net, rows_f, rows_r))
    else:
        net = trainer.train(records.ids[rows_r], records.X[rows_r], records.y[rows_r], "init",
                            ("finetune", state.n_updates), cfg["finetune_epochs"], start=net)
    metrics[f"{method}_seconds"] = time.perf_counter() - t1
    after = trainer.probs(net, Xf)
    p0 = state.attacker.predict_proba(pair_features_np(before, before))
    p1 = state.attacker.predict_proba(pair_features_np(before, after))
    metrics["priaa_before"], metrics["priaa_before_avg"] = priaa(p0)
    metrics["priaa"], metrics["priaa_avg"] = priaa(p1)
    metrics["attack_p_forget"] = float(p1.mean())
    metrics["acc_forget_before"] = accuracy(before, records.y[rows_f])
    metrics["acc_forget"] = accuracy(after, records.y[rows_f])
    return state, net


def _played(state: GameState, net: nn.Module, rows_f: np.ndarray,
            rows_r: np.ndarray) -> dict[str, float]:
    """The game on ``net`` (in place) against the state's surrogate and attacker."""
    spec, records = state.spec, state.records

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(spec.device)

    players = Players(state.attacker, GameTrainer(spec).frozen(state.surrogate_state),
                      prf_u64(spec.seed, "game", state.n_updates))
    with spec.threads(), GameTrainer(spec).kernels("game", state.n_updates):
        return play(net, (tensor(records.X[rows_r]), tensor(records.y[rows_r])),
                    tensor(records.X[rows_f]), tensor(state.X_third), players,
                    GameRules.of(spec.config))


def _without_in_surrogate(state: GameState, rows_f: np.ndarray,
                          rows_r: np.ndarray) -> GameState:
    """The state with a surrogate that holds none of rows ``rows_f`` (retrained only if it
    held one; a new keyed subset of the retain set if it held nothing else)."""
    records = state.records
    forget_ids = set(records.ids[rows_f].tolist())
    if not forget_ids.intersection(state.surrogate_ids.tolist()):
        return state
    sur_ids = np.array([i for i in state.surrogate_ids.tolist() if i not in forget_ids],
                       dtype=object)
    if len(sur_ids) == 0:  # all of it deleted: draw a new subset of the retain set
        k = max(1, round(state.spec.config["surrogate_fraction"] * len(rows_r)))
        live = records.ids[rows_r]
        sur_ids = live[keyed_pick(state.spec.seed, ("surrogate", state.n_updates), live, k)]
    sur_state = GameTrainer(state.spec).surrogate(
        records, np.array([records.row[i] for i in sur_ids]))
    return dataclasses.replace(state, surrogate_ids=sur_ids, surrogate_state=sur_state)


def add(state: GameState, rids: np.ndarray, X: np.ndarray,
        y: np.ndarray) -> tuple[GameState, UpdateReport]:
    """Learn new records (checked by the caller): ``add_epochs`` epochs of fine-tuning on
    them plus a keyed replay sample of ``add_replay`` live training records per new one."""
    t0 = time.perf_counter()
    spec, records = state.spec, state.records
    cfg = spec.config
    tr = records.train
    k = min(len(tr), round(cfg["add_replay"] * len(rids)))
    replay = tr[keyed_pick(spec.seed, ("replay", state.n_updates), records.ids[tr], k)]
    ids_ft = np.concatenate([records.ids[replay], rids])
    order = np.argsort(ids_ft, kind="stable")
    net = state.net
    if len(rids) and cfg["add_epochs"]:
        net = GameTrainer(spec).train(
            ids_ft[order], np.concatenate([records.X[replay], X])[order],
            np.concatenate([records.y[replay], y])[order], "init", ("add", state.n_updates),
            cfg["add_epochs"], start=state.net)
    train_s = time.perf_counter() - t0
    new = dataclasses.replace(
        state, net=net, n_updates=state.n_updates + 1, exact=state.exact and not len(rids),
        records=type(records).by_id(
            np.concatenate([records.ids, rids]), np.concatenate([records.X, X]),
            np.concatenate([records.y, y]),
            third=np.concatenate([records.third, np.zeros(len(rids), dtype=bool)])))
    return new, UpdateReport(
        op="add", record_ids=[str(i) for i in rids], guarantee="approximate",
        seconds=time.perf_counter() - t0,
        retrained={"method": "fine-tune", "epochs": cfg["add_epochs"], "replayed": int(k)},
        metrics={"train_seconds": train_s, "n_records": float(len(new.records.ids))})
