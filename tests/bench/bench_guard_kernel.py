"""The forest guard's fragility kernel at scale (issue "A million records"): the CPU time
of a guard fit and of its update after one batch of deletions, how much of each the
compiled kernel takes, and its cost per visited (node, record) pair.

The census-like table (``ledger.datasets.load("census")``), in two encodings: ``coded``
(14 features, as ``bench_scale.py`` uses it) and ``onehot`` (each coded column of 3 to 64
values split into 0/1 features, as the sidecar encodes a table's categories: 119
features, so each node samples 11 attributes instead of 4). The sidecar's default forest,
one thread. The update after a batch of a worker pass's size is the guard's part of a
pass; the ratio to the fit is ``update_vs_fit_cpu``.

Last lines, one per encoding: ``RESULT bench=guard_kernel encoding=... n=... deletions=...
fit_cpu_s=... fit_kernel_cpu_s=... update_cpu_s=... update_kernel_cpu_s=...
update_vs_fit_cpu=... visited=... ns_per_visit=... certified=... peak_rss_mb=...``.
Default: 10^6 rows, 2,000 deletions (about 20 minutes); ``--quick``: 10^4 rows, 100
deletions.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_dare import log  # noqa: E402, I001 (one thread)

import numpy as np  # noqa: E402

ENCODINGS = ("coded", "onehot")


def one_hot(X: np.ndarray) -> np.ndarray:
    """Each column of 3 to 64 distinct values as one 0/1 feature per value."""
    cols = []
    for a in range(X.shape[1]):
        values = np.unique(X[:, a])
        if 2 < len(values) <= 64:
            cols += [(X[:, a] == v).astype(np.float64) for v in values]
        else:
            cols.append(X[:, a])
    return np.column_stack(cols)


def measure(n: int, encoding: str, deletions: int) -> dict:
    """Fit the default forest and its guard on n rows, then delete a random batch and
    update the guard: CPU seconds and the kernel's share of each."""
    from jobs.guard.forest.forest_guard import ForestGuard
    from jobs.learners.dare.forest import DaREForest
    from jobs.orchestration.served_model import DEFAULT_PARAMS
    from tests.bench.bench_scale import coded_table

    Xtr, ytr, Xte, yte = coded_table(n)
    if encoding == "onehot":
        X = one_hot(np.vstack([Xtr, Xte]))
        Xtr, Xte = X[:n], X[n:]
    ids = np.array([f"r{i:07d}" for i in range(n)], dtype=object)
    params = DEFAULT_PARAMS["dare"]
    small = DaREForest(**params, random_state=1).fit(Xtr[:300], ytr[:300], record_ids=ids[:300])
    ForestGuard.fit(small).certain(Xte[:5])  # compile first: compile time is not fit time
    log(f"== [{encoding} n={n}] {Xtr.shape[1]} features: training the forest")
    forest = DaREForest(**params, random_state=1).fit(Xtr, ytr, record_ids=ids)
    c0 = time.process_time()
    guard = ForestGuard.fit(forest, epsilon=0.0, random_state=0)
    fit_cpu = time.process_time() - c0
    fit = guard.fit_report.detail
    log(f"   guard fit {fit_cpu:.1f} s CPU, kernel {fit['kernel_cpu_s']:.1f} s over "
        f"{fit['visited']:,} visits")
    gone = list(ids[np.random.default_rng(2).choice(n, deletions, replace=False)])
    forest.delete(gone)
    c0 = time.process_time()
    guard.update(gone)
    update_cpu = time.process_time() - c0
    upd = guard.fit_report.detail
    _, certain = guard.certain(Xte)
    log(f"   update after {deletions} deletions {update_cpu:.1f} s CPU, kernel "
        f"{upd['kernel_cpu_s']:.1f} s over {upd['visited']:,} visits; certified "
        f"{certain.mean():.4f}")
    return {"encoding": encoding, "n": n, "deletions": deletions, "fit_cpu_s": fit_cpu,
            "fit_kernel_cpu_s": fit["kernel_cpu_s"], "update_cpu_s": update_cpu,
            "update_kernel_cpu_s": upd["kernel_cpu_s"],
            "update_vs_fit_cpu": update_cpu / fit_cpu, "visited": fit["visited"],
            "ns_per_visit": 1e9 * fit["kernel_cpu_s"] / max(1, fit["visited"]),
            "certified": float(certain.mean()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10^4 rows, 100 deletions")
    ap.add_argument("--rows", type=float, default=1e6)
    ap.add_argument("--deletions", type=int, default=2000)
    ap.add_argument("--encoding", choices=ENCODINGS, action="append",
                    help="table encoding (default: both)")
    args = ap.parse_args()
    n, deletions = (10_000, 100) if args.quick else (int(args.rows), args.deletions)
    if deletions >= n:
        ap.error("--deletions must be below --rows")
    rows = []
    for encoding in args.encoding or ENCODINGS:
        rows.append(measure(n, encoding, deletions))
        gc.collect()
    for row in rows:
        print("RESULT bench=guard_kernel " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
