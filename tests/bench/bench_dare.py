"""DaRE forest benchmark: training, single and batch deletions, accuracy, memory, exactness.

    python tests/bench/bench_dare.py [--quick]

Data: make_classification(n_samples=20000, n_features=20, n_informative=10,
random_state=0); train on the first 16,000 rows, test on the last 4,000. Forest:
100 trees, max_depth 10, k 25, d_rmax in {0, 3}. Per setting: training time,
100 random single-record deletions applied one after the other (p50 and mean
latency), then one batch of 100 deletions, test accuracy, peak RSS, and finally
``verify()`` (retrain from scratch on the live records, compare content hashes).

Memory: every setting runs in its own child process, which first fits a
scikit-learn RandomForestClassifier(100 trees, max_depth 10) on the same data
as a baseline (time, accuracy, pickle size, and the process's peak RSS after
it), then the DaRE forest. ``peak_rss_mb`` is the child's peak RSS (ru_maxrss)
after training and all deletions, before ``verify()`` (which trains a second
forest); it includes Python, numpy, scikit-learn and the data. Also printed:
the rise of the peak over the RSS measured before the baseline, for both
models, and the model-size "overhead" (data + model) / (data + scikit-learn
model) of the DaRE paper's Table 3 (the DaRE figure counts every array the
forest holds, including its own copy of the training data and indexes).

The last lines are, per setting,

    RESULT d_rmax=... train_s=... delete_p50_ms=... delete_mean_ms=... batch100_s=...
    retrain_speedup=... acc=... peak_rss_mb=... exact=true

with ``retrain_speedup = train_s / (delete_mean_ms / 1000)``. ``--quick`` uses
4,000 rows, 20 trees and 30 deletions (under a minute).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402
from sklearn.datasets import make_classification  # noqa: E402
from sklearn.ensemble import RandomForestClassifier  # noqa: E402

from jobs.learners.dare import DaREForest  # noqa: E402


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_bytes(m: DaREForest) -> int:
    """Bytes of the arrays a DaRE forest holds (nodes, caches, layout, its data copy)."""
    return sum(v.nbytes for v in vars(m).values() if isinstance(v, np.ndarray))


def log(msg: str) -> None:
    print(msg, flush=True)


def run(d_rmax: int, quick: bool) -> dict:
    n, trees, n_del, batch = (4000, 20, 30, 100) if quick else (20000, 100, 100, 100)
    X, y = make_classification(n_samples=n, n_features=20, n_informative=10, random_state=0)
    cut = int(0.8 * n)
    Xtr, ytr, Xte, yte = X[:cut], y[:cut], X[cut:], y[cut:]
    gc.collect()
    rss0 = psutil.Process(os.getpid()).memory_info().rss / 2**20
    log(f"== [d_rmax={d_rmax}] scikit-learn RandomForestClassifier({trees} trees, max_depth 10) "
        f"baseline on {cut} rows ...")
    t0 = time.perf_counter()
    rf = RandomForestClassifier(n_estimators=trees, max_depth=10, random_state=0, n_jobs=1)
    rf.fit(Xtr, ytr)
    sk_s = time.perf_counter() - t0
    sk_acc = float((rf.predict(Xte) == yte).mean())
    sk_mb = len(pickle.dumps(rf)) / 2**20
    sk_peak = maxrss_mb()
    log(f"   trained in {sk_s:.2f} s, accuracy {sk_acc:.4f}, model (pickle) {sk_mb:.1f} MB, "
        f"process peak RSS {sk_peak:.0f} MB (+{sk_peak - rss0:.0f} MB over {rss0:.0f} MB)")
    del rf
    gc.collect()
    log(f"== [d_rmax={d_rmax}] DaRE: fitting {trees} trees ...")
    t0 = time.perf_counter()
    m = DaREForest(n_estimators=trees, max_depth=10, k=25, d_rmax=d_rmax, random_state=0)
    m.fit(np.arange(cut), Xtr, ytr)
    train_s = time.perf_counter() - t0
    mb = model_bytes(m) / 2**20
    log(f"   trained in {train_s:.2f} s ({train_s / sk_s:.1f}x scikit-learn), accuracy "
        f"{(m.predict(Xte) == yte).mean():.4f}, model arrays {mb:.1f} MB")
    rng = np.random.default_rng(1)
    order = rng.permutation(cut)
    singles, rest = order[:n_del], order[n_del : n_del + batch]
    lat, retrained = [], []
    for j, i in enumerate(singles):
        t0 = time.perf_counter()
        rep = m.delete([i])
        lat.append(time.perf_counter() - t0)
        retrained.append(rep.retrained["subtrees_retrained"])
        if (j + 1) % 25 == 0:
            log(f"   {j + 1}/{n_del} single deletions, running mean {np.mean(lat) * 1e3:.1f} ms")
    lat_ms = np.array(lat) * 1e3
    log(f"   single deletions: p50 {np.median(lat_ms):.2f} ms, mean {lat_ms.mean():.2f} ms, "
        f"p90 {np.percentile(lat_ms, 90):.2f} ms, max {lat_ms.max():.1f} ms; subtrees retrained "
        f"per deletion {np.mean(retrained):.1f}")
    t0 = time.perf_counter()
    rep = m.delete(rest)
    batch_s = time.perf_counter() - t0
    log(f"   batch of {batch} deletions: {batch_s:.2f} s ({rep.retrained})")
    acc = float((m.predict(Xte) == yte).mean())
    peak = maxrss_mb()
    data_mb = (Xtr.nbytes + ytr.nbytes) / 2**20
    log(f"   memory: process peak RSS {peak:.0f} MB vs {sk_peak:.0f} MB with scikit-learn "
        f"({peak / sk_peak:.2f}x); rise over {rss0:.0f} MB: {peak - rss0:.0f} MB vs "
        f"{sk_peak - rss0:.0f} MB ({(peak - rss0) / max(sk_peak - rss0, 1e-9):.1f}x); "
        f"(data + model) {data_mb + mb:.1f} MB vs {data_mb + sk_mb:.1f} MB "
        f"({(data_mb + mb) / (data_mb + sk_mb):.1f}x)")
    log("   verifying (retrain from scratch, compare content hashes) ...")
    v = m.verify()
    log(f"   verify: exact={v.exact} in {v.seconds:.1f} s")
    speedup = train_s / (lat_ms.mean() / 1e3)
    return {
        "line": (
            f"RESULT d_rmax={d_rmax} train_s={train_s:.2f} "
            f"delete_p50_ms={np.median(lat_ms):.2f} delete_mean_ms={lat_ms.mean():.2f} "
            f"batch100_s={batch_s:.2f} retrain_speedup={speedup:.0f} acc={acc:.4f} "
            f"peak_rss_mb={peak:.0f} exact={'true' if v.exact else 'false'}"
        ),
        "exact": bool(v.exact),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4,000 rows, 20 trees, 30 deletions")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        out = run(args.child, args.quick)
        print("CHILD " + json.dumps(out), flush=True)
        return 0
    log(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
        f"each setting runs in its own process")
    lines, ok = [], True
    for d in (0, 3):
        cmd = [sys.executable, __file__, "--child", str(d)] + (["--quick"] if args.quick else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        res = None
        for line in proc.stdout:
            if line.startswith("CHILD "):
                res = json.loads(line[6:])
            else:
                print(line, end="", flush=True)
        if proc.wait() != 0 or res is None:
            print(f"setting d_rmax={d} failed (exit {proc.returncode})", flush=True)
            return 1
        lines.append(res["line"])
        ok &= res["exact"]
    for r in lines:
        print(r, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
