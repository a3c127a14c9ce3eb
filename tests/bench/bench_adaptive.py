"""Adaptive deletions: Gupta et al.'s Sec. 6 attack on plain SISA and on the private mode.

    python tests/bench/bench_adaptive.py [--quick] [--trials N] [--epsilon E]
        [--data digits,table] [--shards 6,2] [--jobs J]

Per data set (scikit-learn's 8x8 digits, 10 classes; a synthetic table,
make_classification 2,000 x 20, 4 classes of one cluster each, class_sep 1.5,
10% flipped labels; features in
[0, 1]; stratified 75/25 split, seed 0) and per number of shards k, each trial
trains a SISA ensemble (partition, one slice, MLP 64 hidden, Adam lr 0.01,
15 epochs, batch 32) from the trial's seed, runs
:func:`jobs.adaptive.attack.run_trial` and records the statistic 1[mean test
accuracy of the targeted shards < the others'] and the test accuracy of what is
published afterwards: the plain vote (mode=plain) or the noisy vote at eps0 per
answer (mode=private). The interval is the 95% Wilson interval of the mean
statistic over the trials; perfect unlearning gives 0.5. ``acc_vote`` is the plain
vote's accuracy of the same ensembles (in private mode, acc_vote - acc is what
the noise costs). ``hit`` is the share of
training records whose shard the attacker guessed right (1/k by chance).
``epsilon_spent`` is the optimal composition (delta 1e-5) of the answers the
private mode published in one trial (one per training and test record):
what the budget would have to allow before a retrain with fresh seeds.

Reference (authors' results, MNIST k=6): plain SISA [0.849, 0.922]. Target:
plain SISA's interval excludes 0.5, the private mode's includes it; the
accuracy cost is reported. Last lines, per (data, k, mode):

    RESULT data=... mode=plain|private k=... ci_low=... ci_high=... acc=... [more]

``--quick``: digits, k = 6, 12 trials per mode (under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DELTA = 1e-5
PARAMS = {"model": "mlp", "hidden": (64,), "n_slices": 1, "schedule": "adam", "lr": 0.01,
          "epochs_per_slice": 15, "batch_size": 32, "device": "cpu", "cpu_threads": 1}


def load(name: str) -> tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits, make_classification
    from sklearn.model_selection import train_test_split

    if name == "digits":
        X, y = load_digits(return_X_y=True)
        X = X / 16.0
    elif name == "table":
        X, y = make_classification(n_samples=2000, n_features=20, n_informative=10,
                                   n_classes=4, n_clusters_per_class=1, class_sep=1.5,
                                   flip_y=0.1, random_state=0)
        X = (X - X.min(axis=0)) / (X.max(axis=0) - X.min(axis=0))
    else:
        raise SystemExit(f"unknown data set {name!r} (digits, table)")
    ids = np.array([f"{name}-{i}" for i in range(len(X))], dtype=object)
    tr, te = train_test_split(np.arange(len(X)), test_size=0.25, random_state=0, stratify=y)
    return ids[tr], X[tr], y[tr], X[te], y[te]


def _trial(args: tuple) -> tuple[int, float, float, int, float]:
    import torch

    from jobs.adaptive.attack import run_trial

    torch.set_num_threads(1)
    name, k, mode, eps, seed = args
    ids, X, y, Xt, yt = load(name)
    r = run_trial({**PARAMS, "n_shards": k}, ids, X, y, Xt, yt, mode=mode, seed=seed,
                  epsilon=eps)
    return r.statistic, r.accuracy, r.vote_accuracy, r.deleted, r.guess_hit_rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=None, help="trials per setting (100)")
    ap.add_argument("--epsilon", type=float, default=2.0, help="eps0 per private answer")
    ap.add_argument("--data", default=None, help="digits,table (quick: digits)")
    ap.add_argument("--shards", default=None, help="6,2 (quick: 6)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    from jobs.adaptive.attack import wilson_interval
    from jobs.adaptive.composition import epsilon_spent

    trials = args.trials or (12 if args.quick else 100)
    names = (args.data or ("digits" if args.quick else "digits,table")).split(",")
    shards = [int(k) for k in (args.shards or ("6" if args.quick else "6,2")).split(",")]
    lines = []
    t_start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name in names:
            _, X, _, X_test, _ = load(name)
            n_answers = len(X) + len(X_test)  # one private answer per train and test record
            for k in shards:
                for mode in ("plain", "private"):
                    t0 = time.perf_counter()
                    res = list(pool.map(_trial, [(name, k, mode, args.epsilon, s)
                                                 for s in range(trials)]))
                    stat = np.array([r[0] for r in res])
                    acc = float(np.mean([r[1] for r in res]))
                    lo, hi = wilson_interval(int(stat.sum()), len(stat))
                    extra = ""
                    if mode == "private":
                        eps = epsilon_spent(n_answers, args.epsilon, DELTA)
                        extra = f" eps0={args.epsilon:g} epsilon_spent={eps:.1f}"
                    line = (f"RESULT data={name} mode={mode} k={k} ci_low={lo:.3f} "
                            f"ci_high={hi:.3f} mean={stat.mean():.3f} acc={acc:.4f} "
                            f"acc_vote={np.mean([r[2] for r in res]):.4f} trials={len(stat)} "
                            f"deleted={np.mean([r[3] for r in res]):.0f} "
                            f"hit={np.mean([r[4] for r in res]):.3f}{extra}")
                    print(f"[{name} k={k} {mode}] {time.perf_counter() - t0:.0f}s: "
                          f"{line[7:]}", flush=True)
                    lines.append(line)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
