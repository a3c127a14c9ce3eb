"""iDP guard benchmark: accuracy through the guard, bounds, access time, tightness, SISA.

    python tests/bench/bench_guard.py [--quick] [--data moons,cancer,wine]
        [--models mlp,sisa,dare] [--budget S] [--gurobi auto|yes|no] [--no-sisa] [--reps R]

Data (min-max scaled to [0, 1]^d over the whole set; stratified 75/25
train/test split, seed 0), model = MLP 2 x hidden, SGD lr 0.1, weight decay
1e-5, 30 epochs (LUCID's settings), batch 16 (SISA shards: batch 4), one CPU
thread; hidden width 16 for moons, 8 for breast cancer and wine (2x16 on
wine ran out of a 600 s bound budget here, 2 shared cores). Exception, full
run only: the breast cancer MLP trains with SGD lr 0.05 (``MLP_LR``). At lr
0.1 its LOO influence is large (beta ~3.6/3.1 logits, eps-0 drop 5.5 points);
at lr 0.05 beta is ~0.75/1.24 and the drop ~1 point, for 1.4 points less test
accuracy (0.944 vs 0.958). Wine keeps lr 0.1: no setting tried here (lr,
weight decay 1e-4..3e-2, epochs, batch, width 4/16, feature selection) kept
its accuracy with an eps-0 drop <= 1.4 points:

* ``moons``  -- make_moons, 400 points, noise 0.25 (2-D, 2 classes);
* ``cancer`` -- scikit-learn breast cancer, 569 x 30 (2 classes);
* ``wine``   -- scikit-learn wine, 178 x 13 (3 classes).

``--quick``: 160 moons points, breast cancer 200 records x 10 features, wine
as is, hidden 8, a 20 s bound budget per network (anytime, still sound),
fewer queries, the SISA part on moons only, no Gurobi.

Per data set:

1. ``train_loo``: N and every N_{-x}; ``acc`` = N's test accuracy (no privacy);
2. ``compute_bounds`` with HiGHS (``bound_s``; per-class ``beta``); with Gurobi
   too when its size-limited licence accepts the MILPs (printed as a GUROBI
   line: time, betas and which solver really ran; its fallback is HiGHS);
3. accuracy through :class:`GuardedNetwork` (guarded_network.py) at eps 0, 0.2
   and 1 on the test split: the mean over ``--reps`` fresh guards (fresh memo
   and noise); the exact expectation is printed beside it. ``acc_eps0_loo`` is
   the ceiling of any sound guard: the expected accuracy at eps 0 of exact
   iDP, certain iff every LOO network gives the query N's label;
4. access time per query in process (one query per call, median over many
   distinct uniform queries, model already loaded): the guard, and naive iDP
   (all |D| + 1 networks per query, answer the label iff they all agree, else
   the memoised mechanism) on the same queries in the same run;
5. falsifier: leaking inputs from 20,000 uniform samples + the training and
   test points + jitter around each class's MILP witness + the gradient search
   of :func:`jobs.guard.lucid.falsifier.find_leaking`; ``tightness`` = beta_c / the largest
   leaking margin found (per class; "-" when no leaking input exists),
   ``violations`` = found inputs whose margin exceeds beta_c (must be 0).

SISA-aware guard (``model=sisa``): the SERVED ensemble,
:class:`~jobs.learners.sisa.ensemble.SISAEnsemble` (S = 5 shards, ``n_slices=1``,
``schedule="loo"``: MLP 2 x hidden, SGD lr 0.1, weight decay 1e-5, 30 epochs,
batch 4, random_state 0); per-shard HiGHS bounds from
:func:`jobs.guard.lucid.shard_bounds.shard_bounds` (each shard's LOO set rebuilt from the
ensemble's own records; budget / S seconds per shard; ``bound_s``). On the test
split, the fraction of queries answered as certain and the accuracy at eps 0 and 1
(mean over ``--reps``) under three rules: ``sisa`` = :func:`~jobs.guard.label_guard.sisa_certain`
with the per-shard bounds; ``free`` = the same vote rule with every bound +inf (what
the sidecar serves without bounds: sound because one record lives in one shard);
``naive`` = the ensemble treated as one network, certain only when every shard's
margin exceeds its bound; ``uniform_*`` = the certain fractions of the three rules on
2,000 uniform queries in [0, 1]^d. ``violations`` = test or uniform queries certified
by the ``sisa`` rule whose vote some single deletion (every record of every shard,
its exact LOO network through the float32 serving path) changes (must be 0).

DaRE forest guard (``model=dare``): same data and split; a
:class:`~jobs.learners.dare.forest.DaREForest` (full: 50 trees, max_depth 8, k 10, d_rmax 1;
``--quick``: 20 trees, max_depth 6), record ids = the training ids, random_state 0, and
:class:`~jobs.guard.forest.forest_guard.ForestGuard` (``bound_s`` = its fit time: one exact
deletion per record + the tables). ``acc_eps*``: mean over ``--reps`` fresh
:class:`~jobs.guard.label_guard.LabelGuard` s installed as ``ForestGuard.guard`` and answered
through ``ForestGuard.answer``. Every LOO forest F_{-x} is built exactly (deep copy +
``delete([x])``, all records); ``naive_ms`` = all |D| + 1 forests per query (label iff
all agree, else the memoised mechanism). ``access_ms`` is one query per call as above;
``batch_ms`` = the time of one ``ForestGuard.answer`` on all the uniform queries (1000;
quick 200; fresh LabelGuard, best of 3) / their number. Forests have no per-class beta:
``beta`` is the median over test queries of the certified threshold 2*delta(q) (delta(q) =
the guard's value of the largest change of any class probability under one deletion; the
guard's pairwise test is at least as tight). ``tightness`` = mean over test queries with
a nonzero true change of delta(q) / max_{x,c} |p_{-x,c}(q) - p_c(q)| (exact LOO forests;
1 when the guard's per-record aggregation is exact). ``violations`` = queries certified
certain where some exact LOO forest predicts a different class, over the test split and
the uniform access queries (must be 0).

Reference (LUCID Table 1): accuracy decrease 1.4 points at eps 0, 1.1 at
eps 1; access 0.16 ms per query.

Served SISA (``served=``, issue 17): the sidecar's own
:class:`jobs.orchestration.served_model.ShardVoteModel`
with the served defaults (5 shards, one hidden layer of 32, 20 epochs, batch 32,
random_state 0) on breast cancer, digits (1,797 x 64, 10 classes) and a generated
16,000-record table (``--served``; quick: breast cancer 200 x 10): ``served=inf`` as a
version is first published (every shard fragile), ``served=bounds`` once
``refresh_guard`` (the guard job's call) has bounded every shard (``--budget`` / 5 s
each; ``--quick``: 5 s in all, and 5 s for the mlp row); ``acc_eps0`` = the expected
accuracy at eps 0; ``violations`` as above.
``synthetic<N>`` (``synthetic2667``, ``synthetic16k``) is a generated table of N records.
The same for the sidecar's one-network learner (``model=mlp``,
:class:`jobs.orchestration.served_model.GuardedMLPModel`: ``served=inf`` is its noise-all mode
before
the guard job, ``served=bounds`` after its LOO set and ``--budget`` s of bound).

The last lines are, per data set,

    RESULT data=... model=mlp acc=... acc_eps0=... acc_eps02=... acc_eps1=... acc_eps0_loo=... \
beta=b0/b1 bound_s=... access_ms=... naive_ms=... tightness=t0/t1 violations=0
    RESULT data=... model=sisa shards=5 acc=... certain_sisa=... certain_free=... \
certain_naive=... acc_eps0_sisa=... acc_eps0_free=... acc_eps0_naive=... \
uniform_sisa=... uniform_free=... uniform_naive=... bound_s=... violations=0
    RESULT data=... model=sisa|mlp served=inf|bounds certified=... acc=... acc_eps0=... \
bound_s=... violations=0
    RESULT data=... model=dare acc=... acc_eps0=... acc_eps02=... acc_eps1=... beta=... \
bound_s=... access_ms=... batch_ms=... naive_ms=... tightness=... violations=0
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits, load_wine, make_moons
from sklearn.model_selection import train_test_split

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jobs.guard.forest.forest_guard import ForestGuard  # noqa: E402
from jobs.guard.label_guard import (  # noqa: E402
    LabelGuard,
    clip_unit,
    lucid_certain,
    mechanism_probabilities,
    sisa_certain,
)
from jobs.guard.lucid.branch_and_bound import BoundReport, compute_bounds  # noqa: E402
from jobs.guard.lucid.falsifier import find_leaking, margins  # noqa: E402
from jobs.guard.lucid.shard_bounds import ensemble_loo_set, naive_certain, shard_bounds  # noqa: E402
from jobs.guard.lucid.solvers import gurobi_available  # noqa: E402
from jobs.learners.dare.forest import DaREForest  # noqa: E402
from jobs.learners.networks.loo_training import LOOSet, train_loo  # noqa: E402
from jobs.learners.sisa.ensemble import SISAEnsemble  # noqa: E402
from tests.bench.guarded_network import GuardedNetwork  # noqa: E402

EPSILONS = (0.0, 0.2, 1.0)
MODELS = ("mlp", "sisa", "dare")
#: DaRE forest settings (full, --quick)
DARE_FULL = dict(n_estimators=50, max_depth=8, k=10, d_rmax=1)
DARE_QUICK = dict(n_estimators=20, max_depth=6, k=10, d_rmax=1)
#: per-data-set SGD learning rate of the benchmarked MLP (full run only; default 0.1)
MLP_LR = {"cancer": 0.05}
SHARD_BATCH = 4  # shards hold |D|/5 records: smaller batches give them enough SGD steps


# --------------------------------------------------------------------------- data


@dataclass
class Data:
    name: str
    Xtr: np.ndarray
    ytr: np.ndarray
    Xte: np.ndarray
    yte: np.ndarray
    ids: list[str]
    note: str


def _scale(X: np.ndarray) -> np.ndarray:
    span = X.max(0) - X.min(0)
    return (X - X.min(0)) / np.where(span > 0, span, 1.0)


def load(name: str, quick: bool) -> Data:
    if name == "moons":
        n = 160 if quick else 400
        X, y = make_moons(n, noise=0.25, random_state=0)
        X, note = _scale(X), f"make_moons n={n} noise=0.25 d=2"
    elif name == "cancer":
        d = load_breast_cancer()
        X, y = _scale(d.data), d.target
        note = "breast cancer 569x30"
        if quick:
            idx = np.random.default_rng(0).choice(len(y), 200, replace=False)
            X, y = X[idx][:, :10], y[idx]
            note = "breast cancer 200 random records x first 10 features"
    elif name == "wine":
        d = load_wine()
        X, y, note = _scale(d.data), d.target, "wine 178x13 (3 classes)"
    elif name == "digits":
        d = load_digits()
        X, y, note = _scale(d.data), d.target, "digits 1797x64 (10 classes)"
    elif name.startswith("synthetic"):  # synthetic16k, synthetic2667, ...
        from ledger import datasets

        size = name.removeprefix("synthetic")
        n = int(float(size[:-1]) * 1000) if size.endswith("k") else int(size)
        d = datasets.load("synthetic", n_samples=n)
        X, y, note = _scale(d.X), d.y, f"make_classification {n}x20 (3 classes)"
    else:
        raise SystemExit(f"unknown data set {name!r}")
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
    ids = [f"{name}{i:04d}" for i in range(len(ytr))]
    return Data(name, Xtr, ytr, Xte, yte, ids, note)


# --------------------------------------------------------------------------- naive iDP


class NaiveIDP:
    """Naive iDP: run N and all N_{-x} on the query; the label iff all agree, else the
    memoised mechanism. Weights pre-stacked in float64 (a fair, vectorised baseline)."""

    def __init__(self, loo: LOOSet, epsilon: float, random_state: int = 0) -> None:
        self.Ws = [np.ascontiguousarray(W.astype(np.float64).transpose(0, 2, 1))
                   for W in loo.weights]
        self.bs = [b.astype(np.float64)[:, None, :] for b in loo.biases]
        self.guard = LabelGuard(loo.n_classes, epsilon, random_state=random_state)
        self.guard.bind("naive", sound=True)

    def _labels(self, Xc: np.ndarray) -> np.ndarray:
        """(M, n) labels of every network (N first) at the clipped points."""
        a = np.broadcast_to(Xc.astype(np.float64), (self.Ws[0].shape[0], *Xc.shape))
        last = len(self.Ws) - 1
        for i, (W, b) in enumerate(zip(self.Ws, self.bs, strict=True)):
            a = np.matmul(a, W) + b
            if i < last:
                a = np.maximum(a, 0.0)
        return a.argmax(2)

    def predict(self, X: np.ndarray) -> np.ndarray:
        Xc = clip_unit(X)
        labels = self._labels(Xc)
        agree = (labels == labels[0][None, :]).all(0)
        # a noised answer is drawn around N's label at its cell's centre
        return self.guard.answer(Xc, labels[0], agree, lambda C: self._labels(C)[0])


def median_ms(fn, Q: np.ndarray) -> float:
    times = np.empty(len(Q))
    for i in range(len(Q)):
        q = Q[i:i + 1]
        t0 = time.perf_counter()
        fn(q)
        times[i] = time.perf_counter() - t0
    return float(np.median(times) * 1e3)


# --------------------------------------------------------------------------- parts


def guard_accuracy(loo: LOOSet, rep: BoundReport, d: Data, eps: float, reps: int
                   ) -> tuple[float, float, float]:
    """(mean accuracy over fresh guards, exact expectation, certain fraction)."""
    accs = []
    for r in range(reps):
        gn = GuardedNetwork(loo, rep, epsilon=eps, random_state=1000 + r)
        accs.append(float((gn.predict(d.Xte) == d.yte).mean()))
    betas = np.array([rep.serving_beta()[c] for c in range(loo.n_classes)])
    labels, cert = lucid_certain(loo.logits(clip_unit(d.Xte), [0])[0], betas)
    return float(np.mean(accs)), expected_accuracy(labels, cert, d.yte, loo.n_classes, eps), \
        float(cert.mean())


def expected_accuracy(labels: np.ndarray, cert: np.ndarray, y: np.ndarray, C: int,
                      eps: float) -> float:
    p = mechanism_probabilities(0, C, eps)
    right = labels == y
    per = np.where(cert, right.astype(float), np.where(right, p[0], p[1]))
    return float(per.mean())


def falsify(loo: LOOSet, rep: BoundReport, d: Data, quick: bool
            ) -> tuple[list[float], int, list[str]]:
    """Largest leaking margin found per class, violation count, a line per class."""
    rng = np.random.default_rng(11)
    dim = d.Xtr.shape[1]
    pts = [rng.random((5000 if quick else 20000, dim)), d.Xtr, d.Xte]
    for cb in rep.per_class.values():
        if cb.witness is not None:
            w = np.asarray(cb.witness["x"])
            for s in (1e-4, 1e-3, 1e-2):
                pts.append(np.clip(w + rng.normal(0, s, (200, dim)), 0, 1))
    P = np.concatenate(pts)
    lg = loo.logits(P)
    found, violations, lines = [], 0, []
    for c in range(loo.n_classes):
        beta = rep.beta[c]
        mN = margins(lg[0], c)
        leak = margins(lg[1:], c).min(0) <= 0
        best = float(mN[leak].max()) if leak.any() else -np.inf
        violations += int((mN[leak] > beta).sum())
        s = find_leaking(loo, c, n_samples=2000, n_starts=16 if quick else 64,
                         steps=100 if quick else 300, seed=c)
        if s.best_margin > beta:
            violations += 1
        w = rep.per_class[c].witness
        if w is not None and w["leaking"]:
            violations += int(w["n_margin"] > beta)
            best = max(best, w["n_margin"])
        best = max(best, s.best_margin)
        found.append(best)
        lines.append(f"  class {c}: beta {beta:.5f}, largest leaking margin found {best:.5f} "
                     f"(samples {float(mN[leak].max()) if leak.any() else float('-inf'):.5f}, "
                     f"gradient {s.gradient_best:.5f}, witness "
                     f"{w['n_margin'] if w else float('nan'):.5f}); exact={rep.per_class[c].exact}")
    return found, violations, lines


def fmt_beta(rep: BoundReport, C: int) -> str:
    return "/".join(f"{rep.beta[c]:.4f}" if np.isfinite(rep.beta[c]) else str(rep.beta[c])
                    for c in range(C))


def bench_mlp(d: Data, args: argparse.Namespace, hidden: int) -> tuple[str, float]:
    lr = 0.1 if args.quick else MLP_LR.get(d.name, 0.1)
    kw = dict(hidden=(hidden, hidden), epochs=30, batch_size=16, lr=lr, weight_decay=1e-5,
              seed=0)
    t0 = time.perf_counter()
    loo = train_loo(d.Xtr, d.ytr, d.ids, **kw)
    train_s = time.perf_counter() - t0
    C = loo.n_classes
    acc = float((loo.logits(d.Xte, [0])[0].argmax(1) == d.yte).mean())
    print(f"[{d.name}] {d.note}; train {len(d.ytr)} / test {len(d.yte)}; MLP 2x{hidden}; "
          f"lr {lr}; LOO training {loo.n_networks} networks {train_s:.1f}s; "
          f"test accuracy {acc:.4f}", flush=True)

    t0 = time.perf_counter()
    rep = compute_bounds(loo, args.budget, "highs")
    bound_s = time.perf_counter() - t0
    man = rep.manifest()
    print(f"[{d.name}] HiGHS bounds {bound_s:.1f}s: beta {fmt_beta(rep, C)} "
          f"({man['n_milps']} MILPs, exact {man['exact']}, stop "
          f"{[cb.stop_reason for cb in rep.per_class.values()]})", flush=True)
    want_gurobi = args.gurobi == "yes" or (args.gurobi == "auto" and gurobi_available())
    if want_gurobi:
        t0 = time.perf_counter()
        g = compute_bounds(loo, args.budget, "gurobi")
        gm = g.manifest()
        notes = {m.get("note") for cb in g.per_class.values() for m in cb.milps
                 if m.get("note")}
        print(f"GUROBI data={d.name} bound_s={time.perf_counter() - t0:.1f} beta="
              f"{fmt_beta(g, C)} solvers_used={','.join(gm['solvers_used'])}"
              + (f" note={sorted(notes)[0][:90]!r}" if notes else ""), flush=True)

    lg = loo.logits(clip_unit(d.Xte))
    stable = (lg.argmax(2) == lg[0].argmax(1)[None, :]).all(0)
    floor = expected_accuracy(lg[0].argmax(1), stable, d.yte, C, 0.0)
    print(f"[{d.name}] exact iDP (certain iff every LOO network agrees): {stable.mean():.3f} "
          f"of test queries certain, expected accuracy at eps 0 {floor:.4f} (drop "
          f"{100 * (acc - floor):.2f} points): no sound guard certifies more", flush=True)
    accs = {}
    for eps in EPSILONS:
        mean, expect, cert = guard_accuracy(loo, rep, d, eps, args.reps)
        accs[eps] = mean
        print(f"[{d.name}] eps {eps}: guard accuracy {mean:.4f} (expected {expect:.4f}; "
              f"{cert:.3f} of test queries certain; drop {100 * (acc - mean):.2f} points)",
              flush=True)

    rng = np.random.default_rng(5)
    nq = 500 if args.quick else 2000
    Q = rng.random((nq, d.Xtr.shape[1])).astype(np.float32)
    gn = GuardedNetwork(loo, rep, epsilon=1.0, random_state=0)
    naive = NaiveIDP(loo, 1.0)
    gn.predict(Q[:10])
    naive.predict(Q[:10])  # warm-up
    access = median_ms(gn.predict, Q)
    naive_ms = median_ms(naive.predict, Q[: nq // 4])
    print(f"[{d.name}] access per query: guard {access:.4f} ms, naive iDP "
          f"({loo.n_networks} networks) {naive_ms:.4f} ms; counters {gn.counters()}",
          flush=True)

    t0 = time.perf_counter()
    found, violations, lines = falsify(loo, rep, d, args.quick)
    print(f"[{d.name}] falsifier {time.perf_counter() - t0:.1f}s", flush=True)
    for line in lines:
        print(line)
    tight = "/".join(f"{rep.beta[c] / found[c]:.4f}" if found[c] > 0 and np.isfinite(
        rep.beta[c]) else "-" for c in range(C))
    return (f"RESULT data={d.name} model=mlp acc={acc:.4f} acc_eps0={accs[0.0]:.4f} "
            f"acc_eps02={accs[0.2]:.4f} acc_eps1={accs[1.0]:.4f} acc_eps0_loo={floor:.4f} "
            f"beta={fmt_beta(rep, C)} "
            f"bound_s={bound_s:.1f} access_ms={access:.4f} naive_ms={naive_ms:.4f} "
            f"tightness={tight} violations={violations}"), acc


def sisa_violations(ens: SISAEnsemble, Q: np.ndarray, certain: np.ndarray,
                    winner: np.ndarray) -> int:
    """Certified queries whose vote one deletion changes (exact LOO networks, float32)."""
    Q = Q[certain]
    winner = winner[certain]
    if not len(Q):
        return 0
    L = ens.shard_logits(Q)
    labels = L.argmax(2)
    votes = np.zeros((len(Q), L.shape[2]), dtype=np.int64)
    active = np.flatnonzero(ens.active_shards_)
    for s in active:
        np.add.at(votes, (np.arange(len(Q)), labels[s]), 1)
    bad = np.zeros(len(Q), dtype=bool)
    Qt = torch.from_numpy(np.ascontiguousarray(Q, dtype=np.float32))
    for s in active:
        base = votes.copy()
        base[np.arange(len(Q)), labels[s]] -= 1
        loo = ensemble_loo_set(ens, int(s))
        if loo.n_records == 1:  # the shard empties: its vote goes
            bad |= base.argmax(1) != winner
            continue
        for i in range(1, loo.n_networks):
            with torch.inference_mode():
                lab = loo.network(i).to_module()(Qt).numpy().argmax(1)
            v = base.copy()
            v[np.arange(len(Q)), lab] += 1
            bad |= v.argmax(1) != winner
    return int(bad.sum())


def bench_sisa(d: Data, args: argparse.Namespace, hidden: int, shards: int = 5) -> str:
    t0 = time.perf_counter()
    C = int(d.ytr.max()) + 1
    ens = SISAEnsemble(n_shards=shards, n_slices=1, model="mlp", hidden=(hidden, hidden),
                       epochs_per_slice=30, batch_size=SHARD_BATCH, lr=0.1, weight_decay=1e-5,
                       classes=tuple(range(C)), device="cpu", random_state=0)
    ens.fit(d.Xtr, d.ytr, record_ids=np.array(d.ids, dtype=object))
    assert ens.config_["schedule"] == "loo"
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    betas = shard_bounds(ens, time_budget_s=args.budget / shards,
                         solver="highs").for_ensemble(ens)
    bound_s = time.perf_counter() - t0
    print(f"[{d.name}] SISA (served SISAEnsemble) {shards} shards, sizes "
          f"{ens.shard_sizes_.tolist()}; train {train_s:.1f}s, bounds {bound_s:.1f}s; betas "
          f"per shard {[[round(float(b), 3) for b in row] for row in betas]}", flush=True)
    Xc = clip_unit(d.Xte)
    L = ens.shard_logits(Xc)
    active = ens.active_shards_
    winner, cert_sisa = sisa_certain(L, betas, active)
    _, cert_free = sisa_certain(L, np.full_like(betas, np.inf), active)
    _, cert_naive = naive_certain(L, betas, active)
    acc = float((winner == d.yte).mean())
    res = {}
    for rule, cert in (("sisa", cert_sisa), ("free", cert_free), ("naive", cert_naive)):
        for eps in (0.0, 1.0):
            accs = []
            for r in range(args.reps):
                g = LabelGuard(C, eps, random_state=2000 + r)
                g.bind("sisa", sound=True)
                at = lambda C: sisa_certain(ens.shard_logits(C), betas, active)[0]  # noqa: E731
                accs.append(float((g.answer(Xc, winner, cert, at) == d.yte).mean()))
            res[rule, eps] = float(np.mean(accs))
            print(f"[{d.name}] SISA rule {rule}: certain {cert.mean():.3f}, eps {eps}: "
                  f"accuracy {res[rule, eps]:.4f} (expected "
                  f"{expected_accuracy(winner, cert, d.yte, C, eps):.4f}; drop "
                  f"{100 * (acc - res[rule, eps]):.2f} points)", flush=True)
    t0 = time.perf_counter()
    Q = clip_unit(np.random.default_rng(5).random((2000, d.Xtr.shape[1])))
    LQ = ens.shard_logits(Q)
    wq, cq = sisa_certain(LQ, betas, active)
    cq_free = sisa_certain(LQ, np.full_like(betas, np.inf), active)[1]
    cq_naive = naive_certain(LQ, betas, active)[1]
    violations = sisa_violations(ens, Xc, cert_sisa, winner) + sisa_violations(ens, Q, cq, wq)
    print(f"[{d.name}] SISA on 2000 uniform queries: certain sisa {cq.mean():.3f}, free "
          f"{cq_free.mean():.3f}, naive {cq_naive.mean():.3f}; brute force over every single "
          f"deletion: {violations} violations (test + uniform; "
          f"{time.perf_counter() - t0:.1f}s)", flush=True)
    return (f"RESULT data={d.name} model=sisa shards={shards} acc={acc:.4f} "
            f"certain_sisa={cert_sisa.mean():.4f} certain_free={cert_free.mean():.4f} "
            f"certain_naive={cert_naive.mean():.4f} acc_eps0_sisa={res['sisa', 0.0]:.4f} "
            f"acc_eps0_free={res['free', 0.0]:.4f} acc_eps0_naive={res['naive', 0.0]:.4f} "
            f"uniform_sisa={cq.mean():.4f} uniform_free={cq_free.mean():.4f} "
            f"uniform_naive={cq_naive.mean():.4f} bound_s={bound_s:.1f} violations={violations}")


def _served_budget(args: argparse.Namespace) -> float:
    """Seconds of bound search for a served model (``--quick``: 5, a run under a minute)."""
    return 5.0 if args.quick else args.budget


def _served_rows(d: Data, kind: str, model: Any, bound: Callable[[], None],
                 violations: Callable[[np.ndarray, np.ndarray, np.ndarray], int],
                 note: str = "") -> list[str]:
    """``served=inf`` as a version is first published, ``served=bounds`` after ``bound()``
    (the guard job's calls), both through the served model's own ``certain``."""
    C = int(d.ytr.max()) + 1
    Xc = clip_unit(d.Xte)
    out = []
    for served in ("inf", "bounds"):
        bound_s = 0.0
        if served == "bounds":
            t0 = time.perf_counter()
            bound()
            bound_s = time.perf_counter() - t0
        winner, certain = model.certain(Xc)
        v = violations(Xc, certain, winner)
        print(f"[{d.name}] served {kind} ({served}): {note}certain {certain.mean():.3f}, "
              f"bounds {bound_s:.1f}s, violations {v}", flush=True)
        out.append(f"RESULT data={d.name} model={kind} served={served} "
                   f"certified={certain.mean():.4f} acc={float((winner == d.yte).mean()):.4f} "
                   f"acc_eps0={expected_accuracy(winner, certain, d.yte, C, 0.0):.4f} "
                   f"bound_s={bound_s:.1f} violations={v}")
    return out


def bench_served(d: Data, args: argparse.Namespace) -> list[str]:
    """The sidecar's own code path for SISA (``ShardVoteModel`` with the served defaults):
    bounds by the guard job's ``refresh_guard`` (``args.budget / shards`` s per shard)."""
    from jobs.orchestration.served_model import DEFAULT_PARAMS, ShardVoteModel

    model = ShardVoteModel.train("sisa", np.array(d.ids, dtype=object), d.Xtr, d.ytr,
                                 params={"random_state": 0})
    ens = model.learner
    shards = int(DEFAULT_PARAMS["sisa"]["n_shards"])

    def bound() -> None:
        while not model.guard_complete:  # the guard jobs' calls, a shard or more each
            model.refresh_guard(bound_s=_served_budget(args) / shards)

    rows = _served_rows(d, "sisa", model, bound,
                        lambda Q, certain, winner: sisa_violations(ens, Q, certain, winner),
                        f"shards {ens.shard_sizes_.tolist()}, ")
    return rows + bench_served_mlp(d, args)


def bench_served_mlp(d: Data, args: argparse.Namespace) -> list[str]:
    """The sidecar's ``mlp`` learner (``GuardedMLPModel``): noise-all as a version is
    first published, then the guard job's ``refresh_guard`` (LOO set + ``args.budget`` s of
    bound); violations: certified answers some LOO network answers differently."""
    from jobs.orchestration.served_model import GuardedMLPModel

    if len(d.ids) > args.mlp_max_records:
        print(f"[{d.name}] served mlp skipped: its LOO set is {len(d.ids) + 1} networks of "
              f"{len(d.ids)} records (hours on 2 cores; --mlp-max-records)", flush=True)
        return []
    model = GuardedMLPModel.train("mlp", np.array(d.ids, dtype=object), d.Xtr, d.ytr,
                                  params={"random_state": 0, "device": "cpu"})

    def violations(Q: np.ndarray, certain: np.ndarray, winner: np.ndarray) -> int:
        loo = model.learner.loo_
        if loo is None:
            return 0
        return int((np.argmax(loo.logits(Q), axis=2)[:, certain] != winner[certain]).any(0).sum())

    return _served_rows(d, "mlp", model, lambda: model.refresh_guard(_served_budget(args)),
                        violations)


class NaiveForestIDP:
    """Naive iDP for a forest: the served forest and every exact LOO forest on the query;
    the label iff all agree (argmax, lowest index on ties, in the served class space), else
    the memoised mechanism."""

    def __init__(self, forest: DaREForest, loo: list[DaREForest], epsilon: float,
                 random_state: int = 0) -> None:
        self.forest, self.loo = forest, loo
        index = {c: i for i, c in enumerate(forest.classes_.tolist())}
        self.cols = [np.array([index[c] for c in g.classes_.tolist()]) for g in loo]
        self.guard = LabelGuard(max(2, forest.n_classes_), epsilon, random_state=random_state)
        self.guard.bind("naive", sound=True)

    def scores(self, X: np.ndarray) -> np.ndarray:
        """(1 + |D|, n, C) scores: the served forest first, then the LOO forests."""
        C = self.forest.n_classes_
        out = np.zeros((1 + len(self.loo), len(X), C))
        out[0] = self.forest.scores(X)
        for i, (g, col) in enumerate(zip(self.loo, self.cols, strict=True)):
            out[1 + i][:, col] = g.scores(X)
        return out

    def predict(self, X: np.ndarray) -> np.ndarray:
        labels = self.scores(X).argmax(2)
        agree = (labels == labels[0][None, :]).all(0)
        return self.guard.answer(X, labels[0], agree, lambda C: self.forest.scores(C).argmax(1))


def bench_dare(d: Data, args: argparse.Namespace) -> str:
    params = DARE_QUICK if args.quick else DARE_FULL
    ids = np.array(d.ids)
    t0 = time.perf_counter()
    forest = DaREForest(random_state=0, **params).fit(d.Xtr, d.ytr, record_ids=ids)
    train_s = time.perf_counter() - t0
    C = forest.n_classes_
    acc = float((forest.predict(d.Xte) == d.yte).mean())
    print(f"[{d.name}] DaRE {params}; train {train_s:.2f}s; test accuracy {acc:.4f}", flush=True)

    fg = ForestGuard.fit(forest, epsilon=0.0, random_state=0)
    rep = fg.fit_report
    bound_s = rep.seconds
    print(f"[{d.name}] ForestGuard fit {bound_s:.2f}s: {rep.n_records} records, "
          f"{rep.n_leaves} leaves, {rep.fragile_pairs} fragile (node, record) pairs "
          f"({rep.detail['exact_pairs']} with grown subtrees of "
          f"{rep.detail['subtree_nodes']} nodes)", flush=True)

    t0 = time.perf_counter()
    loo = []
    for rid in ids.tolist():
        g = copy.deepcopy(forest)
        g.delete([rid])
        loo.append(g)
    print(f"[{d.name}] {len(loo)} exact LOO forests (copy + delete) "
          f"{time.perf_counter() - t0:.2f}s", flush=True)
    naive = NaiveForestIDP(forest, loo, 1.0)

    # accuracy through the guard: fresh LabelGuards answering via ForestGuard.answer
    labels, cert = fg.certain(d.Xte)
    accs = {}
    for eps in EPSILONS:
        vals = []
        for r in range(args.reps):
            fg.guard = LabelGuard(max(2, C), eps, random_state=1000 + r)
            vals.append(float((fg.answer(d.Xte) == d.yte).mean()))
        accs[eps] = float(np.mean(vals))
        print(f"[{d.name}] eps {eps}: guard accuracy {accs[eps]:.4f} (expected "
              f"{expected_accuracy(labels, cert, d.yte, C, eps):.4f}; {cert.mean():.3f} of "
              f"test queries certain; drop {100 * (acc - accs[eps]):.2f} points)", flush=True)

    # bounds vs the exact LOO forests at the test queries
    scores, delta, _ = fg.bounds(d.Xte)
    loo_s = naive.scores(d.Xte)
    true = np.abs(loo_s[1:] - loo_s[0][None]).max(axis=(0, 2))
    if (delta < true - 1e-12).any():
        print(f"[{d.name}] WARNING: delta below the true change at "
              f"{int((delta < true - 1e-12).sum())} test queries", flush=True)
    nz = true > 0
    tight = f"{float(np.mean(delta[nz] / true[nz])):.4f}" if nz.any() else "n/a"
    beta = float(np.median(2 * delta))

    # violations: certified queries where some exact LOO forest predicts otherwise
    rng = np.random.default_rng(5)
    nq = 200 if args.quick else 1000
    Q = rng.random((nq, d.Xtr.shape[1]))
    violations, lines = 0, []
    for what, X in (("test", d.Xte), ("uniform", Q)):
        lab, c = fg.certain(X)
        pred = naive.scores(X).argmax(2)
        agree = (pred == lab[None]).all(0)
        v = int((c & ~agree).sum())
        violations += v
        lines.append(f"{what}: certain {c.mean():.3f}, LOO-stable {agree.mean():.3f}, "
                     f"violations {v}")
    print(f"[{d.name}] " + "; ".join(lines), flush=True)

    # access per query in process (fitted guard; naive on a tenth of the queries)
    fg.guard = LabelGuard(max(2, C), 1.0, random_state=0)
    fg.answer(Q[:10])
    naive.predict(Q[:10])  # warm-up
    batch = []
    for r in range(3):  # one call on the whole batch, fresh memo each time
        fg.guard = LabelGuard(max(2, C), 1.0, random_state=r)
        t0 = time.perf_counter()
        fg.answer(Q)
        batch.append((time.perf_counter() - t0) * 1e3 / len(Q))
    batch_ms = min(batch)
    access = median_ms(fg.answer, Q)
    naive_ms = median_ms(naive.predict, Q[: max(20, nq // 10)])
    print(f"[{d.name}] access per query: ForestGuard {access:.4f} ms (batch of {len(Q)}: "
          f"{batch_ms:.4f} ms), naive iDP ({len(loo) + 1} forests) {naive_ms:.4f} ms; beta "
          f"(median 2 delta) {beta:.4f}, tightness (mean delta / true) {tight}", flush=True)
    return (f"RESULT data={d.name} model=dare acc={acc:.4f} acc_eps0={accs[0.0]:.4f} "
            f"acc_eps02={accs[0.2]:.4f} acc_eps1={accs[1.0]:.4f} beta={beta:.4f} "
            f"bound_s={bound_s:.1f} access_ms={access:.4f} batch_ms={batch_ms:.4f} "
            f"naive_ms={naive_ms:.4f} tightness={tight} violations={violations}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", default="moons,cancer,wine")
    ap.add_argument("--budget", type=float, default=None,
                    help="bound time budget per network (seconds); default 600 (quick 20)")
    ap.add_argument("--gurobi", choices=["auto", "yes", "no"], default=None,
                    help="also time Gurobi (default: auto; quick: no)")
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated subset of mlp,sisa,dare (default: all)")
    ap.add_argument("--no-sisa", action="store_true")
    ap.add_argument("--served", default=None,
                    help="data sets for the served SISA and mlp rows (default cancer,digits,"
                         "synthetic16k; quick: cancer; 'none' to skip)")
    ap.add_argument("--mlp-max-records", type=int, default=3000,
                    help="served mlp rows only up to this many training records")
    ap.add_argument("--reps", type=int, default=None, help="guards per accuracy (default 50)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="hidden width (default: moons 16, cancer 8, wine 8; quick 8)")
    args = ap.parse_args(argv)
    models = {m for m in args.models.split(",") if m}
    if models - set(MODELS):
        ap.error(f"unknown models {sorted(models - set(MODELS))}; choose from {MODELS}")
    if args.no_sisa:
        models.discard("sisa")
    torch.set_num_threads(1)
    args.budget = args.budget or (20.0 if args.quick else 600.0)
    args.gurobi = args.gurobi or ("no" if args.quick else "auto")
    args.reps = args.reps or (20 if args.quick else 50)
    hidden_default = {"moons": 16, "cancer": 8, "wine": 8}
    t_start = time.perf_counter()
    results, sisa_results, dare_results = [], [], []
    names = [n for n in args.data.split(",") if n]
    for i, name in enumerate(names):
        d = load(name, args.quick)
        hidden = args.hidden or (8 if args.quick else hidden_default.get(name, 8))
        if "mlp" in models:
            line, _acc = bench_mlp(d, args, hidden)
            results.append(line)
        if "sisa" in models and (not args.quick or i == 0):
            sisa_results.append(bench_sisa(d, args, hidden))
        if "dare" in models:
            dare_results.append(bench_dare(d, args))
    served = args.served or ("cancer" if args.quick else "cancer,digits,synthetic16k")
    served_results = []
    if "sisa" in models:
        for name in [n for n in served.split(",") if n and n != "none"]:
            served_results += bench_served(load(name, args.quick), args)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    lines = results + sisa_results + dare_results + served_results
    for line in lines:
        print(line)
    bad = [r for r in lines if not r.endswith("violations=0")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
