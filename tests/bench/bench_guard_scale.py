"""How the DaRE forest guard grows with the training set (issue "Guarded answers at
production scale").

Generated data only, of two characters: ``gaussian`` (``make_classification``, 14
features, 2 classes, ``flip_y=0.05``, ``class_sep=0.8``: every value distinct) and
``table`` (what real tables look like: skewed amounts rounded to two significant digits,
small counts, categories as codes, flags, 8% label noise: few distinct values per
feature, so many ties); features scaled to [0, 1]; the sidecar's default forest
(``jobs.orchestration.served_model.DEFAULT_PARAMS["dare"]``: 50 trees, depth 8, k 10, d_rmax 1, a
fixed
random-node domain). Per n, on 2,000 held-out queries:

- ``fit_s``: time to fit the guard (fragility of every (node, record), the subtrees of the
  fragile pairs within the state budget);
- ``incr10_s``: median time to bring it up to date after a batch of 10 random deletions
  (3 batches; ``ForestGuard.update``), and its CPU time (steadier on a shared machine);
- ``certified``: share of the held-out queries certified; ``acc``: the forest's accuracy;
  ``acc_eps0``: accuracy at epsilon 0 (uncertain answers are a fair coin);
- ``peak_rss_mb``; ``guard_mb`` / ``forest_mb``: the guard's and the forest's saved state.

Then ``RESULT data=... exponent=...``: the least-squares slope of log fit_s on log n. Targets
(the issue's): exponent <= 1.15; fit_s at 64k <= 120 s; incr10_s at 64k <= 2 s;
acc_eps0 within 1.4 points of acc at n >= 16k; peak RSS at 64k <= 4 GB; guard_mb <=
2 x forest_mb. ``--quick`` stops at 4k. Each n runs in a fresh process, so peak RSS is
that n's own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = (1_000, 4_000, 16_000, 64_000)


DATA = ("gaussian", "table")


def table(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A table's character: skew, ties, categories, flags, label noise."""
    rng = np.random.default_rng(seed)
    amounts = rng.lognormal(3.0, 1.0, (n, 4))
    amounts = np.array([float(f"{v:.2g}") for v in amounts.ravel()]).reshape(n, 4)
    counts = rng.poisson([1.0, 3.0, 8.0], (n, 3)).astype(float)
    codes = np.stack([rng.choice(k, n, p=rng.dirichlet(np.ones(k))) for k in (4, 7, 12)],
                     axis=1).astype(float)
    flags = (rng.random((n, 3)) < [0.1, 0.4, 0.7]).astype(float)
    z = (np.log(amounts[:, 0]) - 3 + 0.4 * (counts[:, 1] - 3) - 0.8 * flags[:, 0]
         + np.where(codes[:, 1] % 3 == 0, 1.0, -0.5) + 0.3 * np.log1p(amounts[:, 2]) - 1.0)
    y = (rng.random(n) < 1 / (1 + np.exp(-1.5 * z))).astype(int)
    y = np.where(rng.random(n) < 0.08, 1 - y, y)
    return np.hstack([amounts, counts, codes, flags]), y


def one(n: int, data: str) -> dict:
    from sklearn.datasets import make_classification

    if data == "table":
        X, y = table(n + 2000)
    else:
        X, y = make_classification(n_samples=n + 2000, n_features=14, n_informative=7,
                                   flip_y=0.05, class_sep=0.8, random_state=0)
    X = (X - X.min(axis=0)) / (X.max(axis=0) - X.min(axis=0))
    return {"data": data, **measure_guard(X[:n], y[:n], X[n:], y[n:])}


def measure_guard(Xtr: np.ndarray, ytr: np.ndarray, Xte: np.ndarray,
                  yte: np.ndarray) -> dict:
    """The sidecar's default forest on the rows and its guard: fit (wall and CPU time),
    certified share, accuracies, saved sizes, updates after 10 deletions, peak RSS.
    bench_scale.py uses it too."""
    from jobs.guard.forest.forest_guard import ForestGuard
    from jobs.learners.dare.forest import DaREForest
    from jobs.orchestration.served_model import DEFAULT_PARAMS

    n = len(Xtr)
    ids = np.array([f"r{i:07d}" for i in range(n)], dtype=object)
    forest = DaREForest(**DEFAULT_PARAMS["dare"], random_state=1).fit(Xtr, ytr, record_ids=ids)
    # compile the kernels on a small forest first: compile time is not fit time
    small = DaREForest(**DEFAULT_PARAMS["dare"], random_state=1).fit(Xtr[:300], ytr[:300],
                                                                     record_ids=ids[:300])
    ForestGuard.fit(small).certain(Xte[:5])
    t0, c0 = time.perf_counter(), time.process_time()
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0)
    fit_s, fit_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    c0 = time.process_time()
    _, certain = guard.certain(Xte)
    query_ms = (time.process_time() - c0) / len(Xte) * 1e3
    plain = forest.predict(Xte)
    acc = float(np.mean(plain == yte))
    acc_eps0 = float(np.mean(np.where(certain, plain == yte, 0.5)))
    with tempfile.TemporaryDirectory() as d:
        forest.save(Path(d) / "forest")
        guard.save(Path(d) / "guard")
        size = {k: sum(f.stat().st_size for f in (Path(d) / k).rglob("*") if f.is_file())
                for k in ("forest", "guard")}
    rng = np.random.default_rng(2)
    live = list(ids)
    incr, incr_cpu = [], []
    for _ in range(3):
        gone = [live.pop(int(i)) for i in sorted(rng.choice(len(live), 10, replace=False),
                                                  reverse=True)]
        forest.delete(gone)
        t0, c0 = time.perf_counter(), time.process_time()
        guard.update(gone)
        incr.append(time.perf_counter() - t0)
        incr_cpu.append(time.process_time() - c0)
    return {"n": n,
            "distinct": float(np.mean([len(np.unique(c)) for c in Xtr.T])), "fit_s": fit_s,
            "fit_cpu_s": fit_cpu_s,
            "incr10_s": float(np.median(incr)), "incr10_cpu_s": float(np.median(incr_cpu)),
            "certified": float(certain.mean()), "acc": acc, "acc_eps0": acc_eps0,
            "query_ms": query_ms,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "guard_mb": size["guard"] / 2**20, "forest_mb": size["forest"] / 2**20,
            "exact_share": guard.fit_report.detail["exact_pairs"]
            / max(1, guard.fit_report.fragile_pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="stop at 4k records")
    ap.add_argument("--data", choices=DATA, action="append",
                    help="data character (default: both)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process's size
    args = ap.parse_args()
    kinds = args.data or list(DATA)
    if args.one:
        print(json.dumps(one(args.one, kinds[0])))
        return
    sizes = [n for n in SIZES if not args.quick or n <= 4_000]
    rows = []
    for data in kinds:
        for n in sizes:
            out = subprocess.run([sys.executable, __file__, "--one", str(n), "--data", data],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rows.append(r)
            report(r)
    for r in rows:
        print(f"RESULT data={r['data']} n={r['n']} fit_s={r['fit_s']:.3f} "
              f"incr10_s={r['incr10_s']:.3f} certified={r['certified']:.3f} "
              f"acc={r['acc']:.3f} acc_eps0={r['acc_eps0']:.3f} "
              f"peak_rss_mb={r['peak_rss_mb']:.0f} guard_mb={r['guard_mb']:.2f} "
              f"forest_mb={r['forest_mb']:.2f}")
    for data in kinds:
        mine = [r for r in rows if r["data"] == data]
        slope = np.polyfit(np.log([r["n"] for r in mine]), np.log([r["fit_s"] for r in mine]),
                           1)[0]
        print(f"RESULT data={data} exponent={slope:.3f}")


def report(r: dict) -> None:
    print(f"{r['data']:>8} n={r['n']:>6} ({r['distinct']:.0f} distinct values per feature): "
          f"guard fit {r['fit_s']:.2f} s, update after 10 deletions {r['incr10_s']:.2f} s, "
          f"certified {r['certified']:.3f}, acc {r['acc']:.3f}, acc at eps 0 "
          f"{r['acc_eps0']:.3f}, {r['exact_share']:.2f} of fragile pairs exact, guard "
          f"{r['guard_mb']:.1f} MB / forest {r['forest_mb']:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
