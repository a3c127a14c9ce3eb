"""Serving throughput and latency with and without the guard, over HTTP through BentoML.

    python tests/bench/bench_serving.py [--quick] [--learner dare|sisa] [--clients 8]

One ledger (breast cancer, 569 x 30) and one trained, guarded version; two
`obliviate serve` processes answer with that same version, one guarded
(OBLIVIATE_GUARD=on) and one plain (OBLIVIATE_GUARD=off, raw labels: the
baseline, not private). Closed-loop clients (threads, one HTTP connection
each) send single-row predictions of data-set rows for a fixed time; the two
servers are measured in alternating rounds in the same run, so drift of the
shared machine hits both alike. Last line:

    RESULT guarded_rps=... plain_rps=... ratio=... p99_ms=... p50_ms=... plain_p99_ms=...

Target: ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _load(base: str, rows: list[list[float]], seconds: float, clients: int
          ) -> tuple[int, list[float], int]:
    """(answers, latencies in seconds, errors) of `clients` closed-loop clients."""
    stop = time.monotonic() + seconds
    lat: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        with httpx.Client(base_url=base, timeout=30.0) as http:
            while time.monotonic() < stop:
                row = rows[int(rng.integers(len(rows)))]
                t0 = time.perf_counter()
                r = http.post("/v1/predict", json={"instances": [row]})
                lat[i].append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [x for xs in lat for x in xs]
    return len(flat), flat, sum(errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2.5 s per server")
    ap.add_argument("--learner", default="dare")
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    rounds, seconds = (2, 2.5) if args.quick else (4, 10.0)

    from jobs.orchestration.job_settings import JobSettings
    from jobs.orchestration.registry import Registry
    from jobs.orchestration.worker import Worker
    from ledger import datasets
    from ledger.config import LedgerSettings
    from service.demo.processes import ManagedProcess, free_port, sidecar_env

    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    s = LedgerSettings.from_env(database_url=f"sqlite:///{work / 'ledger.db'}",
                                hmac_key_file=str(work / "hmac.key"))
    env = sidecar_env(work, s.database_url)
    os.environ.update({k: v for k, v in env.items() if k.startswith("BENTOML")})
    ledger = s.open_ledger()
    ds = datasets.load("breast_cancer")
    ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name)
    registry = Registry(ledger.engine, JobSettings.from_env().model_name)
    version = Worker(ledger, registry).bootstrap(args.learner)
    print(f"{args.learner} {version} trained and guarded; state in {work}", flush=True)

    servers = {}
    for mode in ("guarded", "plain"):
        port = free_port()
        menv = {**env, "OBLIVIATE_GUARD": "on" if mode == "guarded" else "off",
                "PROMETHEUS_MULTIPROC_DIR": str(work / f"prom-{mode}")}
        (work / f"prom-{mode}").mkdir()
        servers[mode] = (f"http://127.0.0.1:{port}",
                         ManagedProcess(["serve", "--port", str(port)], menv,
                                        work / f"{mode}.log"))
    try:
        for base, proc in servers.values():
            proc.wait_http(f"{base}/readyz")
        rows = ds.X.tolist()
        results: dict[str, list] = {"guarded": [0, [], 0, 0.0], "plain": [0, [], 0, 0.0]}
        for mode in servers:  # warm-up: first requests pay for lazy imports
            _load(servers[mode][0], rows, 1.0, args.clients)
        for r in range(rounds):
            for mode in (("guarded", "plain") if r % 2 == 0 else ("plain", "guarded")):
                n, lat, err = _load(servers[mode][0], rows, seconds, args.clients)
                acc = results[mode]
                acc[0] += n
                acc[1] += lat
                acc[2] += err
                acc[3] += seconds
                print(f"round {r + 1} {mode:8} {n / seconds:8.1f} req/s  "
                      f"p50 {np.percentile(lat, 50) * 1e3:6.2f} ms  "
                      f"p99 {np.percentile(lat, 99) * 1e3:6.2f} ms  errors {err}", flush=True)
    finally:
        for _, proc in servers.values():
            proc.stop()
    g, p = results["guarded"], results["plain"]
    g_rps, p_rps = g[0] / g[3], p[0] / p[3]
    if g[2] or p[2]:
        print(f"errors: guarded {g[2]}, plain {p[2]}")
    print(f"RESULT guarded_rps={g_rps:.1f} plain_rps={p_rps:.1f} ratio={g_rps / p_rps:.3f} "
          f"p99_ms={np.percentile(g[1], 99) * 1e3:.2f} p50_ms={np.percentile(g[1], 50) * 1e3:.2f} "
          f"plain_p99_ms={np.percentile(p[1], 99) * 1e3:.2f}")
    return 0 if not (g[2] or p[2]) else 1


if __name__ == "__main__":
    sys.exit(main())
