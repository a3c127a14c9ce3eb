"""End-to-end deletion latency: produced to Kafka -> served by a version without the record.

    python tests/bench/bench_e2e.py [--quick] [--learners dare,sisa,mlp] [--requests N]
                                    [--records N] [--shard-bound S] [--rate R]

Per learner: a local tansu broker, a fresh SQLite ledger holding a synthetic
table (make_classification, 3 classes, 20 features scaled to [0, 1]), the
first version trained, then the real processes (`obliviate serve`, `worker`,
`consume`). N single-record deletions are produced at a steady 50/s. A
watcher polls the service's `/v1/models` every 20 ms and notes when each
version is first served; a deletion's latency runs from its produce time to
the first moment the service answers with the version that applied it (or a
later one). `lost` counts produced requests that never reached `applied`;
`duplicated` counts requests applied more than once.

Guarded answers: a client asks `/v1/predict` for batches of held-out rows all
along, first for 20 s with no stream (idle), then while the deletions stream;
the service's own counters (`obliviate_guard_queries_total`, certain vs
noised) give the share certified in each phase. Target (issue "Guarded
answers at production scale"): certified_stream >= 0.9 x certified_idle and
p50 <= 2 s on a table of at least 16k records.

Bounds (issue "The LUCID bound as a background job"): ``--shard-bound S`` gives the
worker's guard job S seconds per SISA shard, or for the mlp learner's network, to
compute LUCID bounds (0, the default: none; a 16k table's SISA shards of 3,200 records
take minutes each); the idle phase then starts once the current version's guard is
complete (``bound_wait_s``), so ``certified_idle`` is what the bounds certify and
``certified_stream`` what is left of it while deletions keep retraining shards (a shard
counts as fragile, the mlp answers in noise-all mode, until the next guard job).

Baselines in the same process: for SISA, the time to retrain one shard (one
single-record deletion on the same ensemble, which retrains exactly the affected
shard); for mlp, a deletion by LOO swap and one by retraining the network. The mlp
learner serves a deletion by swapping in N_-x when the LOO set of the current records is
at hand (``swaps``: how many were), else by retraining its one network. Last lines:

    RESULT learner=... records=... p50_s=... p95_s=... lost=0 duplicated=0
           certified_stream=... certified_idle=... served=inf|bounds bound_wait_s=...
           [shard_retrain_s=... ratio=...] [swaps=... swap_ms=... retrain_s=...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RATE = 50.0


def _watch_versions(base: str, stop: threading.Event, first_served: dict[int, float]) -> None:
    with httpx.Client(base_url=base, timeout=5.0) as http:
        while not stop.is_set():
            try:
                cur = http.get("/v1/models").json()["serving"]["version"]
            except (httpx.HTTPError, KeyError, TypeError):
                cur = None
            if cur:
                first_served.setdefault(int(cur.lstrip("v")), time.time())
            stop.wait(0.02)


def _guard_counts(base: str) -> tuple[float, float]:
    """(certain, noised) answers so far, from the service's metrics."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {"certain": 0.0, "noised": 0.0}
    for line in text.splitlines():
        if line.startswith("obliviate_guard_queries_total{"):
            for k in out:
                if f'outcome="{k}"' in line:
                    out[k] += float(line.rsplit(" ", 1)[1])
    return out["certain"], out["noised"]


def _ask(base: str, X: np.ndarray, stop: threading.Event) -> None:
    """Predictions all along: batches of 20 held-out rows (pre-scaled)."""
    rng = np.random.default_rng(1)
    with httpx.Client(base_url=base, timeout=30.0) as http:
        while not stop.is_set():
            rows = X[rng.integers(len(X), size=20)].tolist()
            with contextlib.suppress(httpx.HTTPError):
                http.post("/v1/predict", json={"instances": rows, "scaled": True})
            stop.wait(0.05)


def _share(before: tuple[float, float], after: tuple[float, float]) -> float:
    certain, noised = after[0] - before[0], after[1] - before[1]
    return certain / max(certain + noised, 1.0)


def _shard_retrain_seconds(ds, params: dict) -> float:  # noqa: ANN001 - datasets.Dataset
    """One single-record deletion on the same ensemble: it retrains one shard."""
    from jobs.orchestration.served_model import ServedModel

    model = ServedModel.train("sisa", np.array(ds.record_ids, dtype=object), ds.X, ds.y,
                              params)
    times = []
    for rid in ds.record_ids[:3]:
        t0 = time.perf_counter()
        model.learner.delete(np.array([rid], dtype=object))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _await_complete_guard(registry, timeout_s: float) -> float:  # noqa: ANN001 - Registry
    """Seconds until the current version's guard is complete (bounds in), at most
    `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        cur = registry.current()
        if cur is not None and (cur.manifest["guard"].get("bound") or {}).get("complete"):
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def run(learner: str, n_requests: int, n_records: int, shard_bound_s: float = 0.0,
        rate: float = RATE) -> dict[str, float | int]:
    from jobs.orchestration.registry import Registry
    from jobs.orchestration.worker import Worker
    from ledger import datasets
    from ledger.config import LedgerSettings
    from ledger.consumer import ensure_topics
    from ledger.local_broker import LocalBroker
    from ledger.producer import paced, produce
    from service.demo.processes import LocalSidecar, sidecar_env

    work = Path(tempfile.mkdtemp(prefix=f"bench-e2e-{learner}-"))
    with LocalBroker(log_path=work / "tansu.log") as broker:
        s = LedgerSettings.from_env(database_url=f"sqlite:///{work / 'ledger.db'}",
                                    hmac_key_file=str(work / "hmac.key"),
                                    kafka_bootstrap=broker.bootstrap)
        model_name = f"e2e-{learner}"
        env = sidecar_env(work, s.database_url, s.kafka_bootstrap, model_name=model_name)
        # BentoML reads its home once per process: every run here shares main()'s store
        env["BENTOML_HOME"] = os.environ["BENTOML_HOME"]
        env["OBLIVIATE_MODEL_STORE"] = os.environ["OBLIVIATE_MODEL_STORE"]  # this one's too
        ensure_topics(s.kafka_bootstrap, list(s.topic_configs()), configs=s.topic_configs())
        ledger = s.open_ledger()
        ds = datasets.load("synthetic", n_samples=n_records)
        ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name)
        t0 = time.perf_counter()
        Worker(ledger, Registry(ledger.engine, model_name)).bootstrap(learner)
        print(f"[{learner}] {n_records} records, first version trained in "
              f"{time.perf_counter() - t0:.1f} s; state in {work}", flush=True)
        rng = np.random.default_rng(0)
        victims = rng.choice(len(ds.record_ids), size=n_requests, replace=False)
        messages = [{"request_id": f"e2e-{i:05d}", "op": "delete",
                     "record_ids": [ds.record_ids[j]]} for i, j in enumerate(victims)]
        produced: dict[str, float] = {}

        def on_sent(k: int) -> None:
            produced[messages[k - 1]["request_id"]] = time.time()

        first_served: dict[int, float] = {}
        stop = threading.Event()
        held_out = datasets.load("synthetic", n_samples=n_records + 2000).X[n_records:]
        # bounds are off by default: a 16k table's SISA shards of 3,200 records take
        # minutes each in the guard job, which would share the two cores with the stream
        with LocalSidecar(work, env, worker_args=["--shard-bound", str(shard_bound_s)]
                          ) as sidecar:
            watcher = threading.Thread(target=_watch_versions,
                                       args=(sidecar.base_url, stop, first_served))
            watcher.start()
            asking = threading.Event()
            client = threading.Thread(target=_ask, args=(sidecar.base_url, held_out, asking))
            client.start()
            try:
                bound_wait = (_await_complete_guard(Registry(ledger.engine, model_name),
                                                    1800.0) if shard_bound_s > 0 else 0.0)
                if shard_bound_s > 0:
                    print(f"[{learner}] guard complete (bounds in) after {bound_wait:.0f} s",
                          flush=True)
                idle0 = _guard_counts(sidecar.base_url)
                time.sleep(20)
                idle1 = _guard_counts(sidecar.base_url)
                produce(s.kafka_bootstrap, s.requests_topic, paced(messages, rate), on_sent)
                stream1 = _guard_counts(sidecar.base_url)
                deadline = time.monotonic() + 120 + n_requests / rate
                while time.monotonic() < deadline:
                    counts = ledger.lifecycle.status_counts()
                    if sum(counts.get(k, 0) for k in ("applied", "verified", "failed")) >= \
                            n_requests or sidecar.dead():
                        break
                    time.sleep(0.2)
                # every applied request is measured: wait (bounded) until the service
                # serves the version that applied the last of them
                registry = Registry(ledger.engine, model_name)
                last = registry.current_seq()
                end = time.monotonic() + 60
                while time.monotonic() < end and max(first_served, default=0) < last:
                    time.sleep(0.1)
            finally:
                asking.set()
                client.join()
                stop.set()
                watcher.join()
        applied: dict[str, list[int]] = {}
        at: dict[tuple[str, str], float] = {}
        passes: dict[str, tuple[int, float, float]] = {}  # version -> (requests, update, guard)
        swaps = 0
        for e in ledger.events.export():
            if e["kind"] == "applied":
                swaps += sum(bool(d.get("swap")) for d in
                             e["payload"].get("retrained", {}).get("detail", []))
            if e["kind"] == "applied" and e["model_version"]:
                n, u, g = passes.get(e["model_version"], (0, 0.0, 0.0))
                passes[e["model_version"]] = (n + 1, e["payload"].get("update_seconds", u),
                                              e["payload"].get("guard_seconds", g))
            if e["kind"] in ("received", "applied") and e["request_id"]:
                at.setdefault((e["kind"], e["request_id"]),
                              datetime.fromisoformat(e["created_at"]).timestamp())
            if e["kind"] == "applied":
                applied.setdefault(e["request_id"], []).append(int(e["model_version"][1:]))
    latencies, stages = [], []
    for rid, t_produced in produced.items():
        versions = applied.get(rid)
        if not versions:
            continue
        served = [t for seq, t in first_served.items() if seq >= versions[0]]
        if served:
            latencies.append(min(served) - t_produced)
            stages.append((at[("received", rid)] - t_produced,
                           at[("applied", rid)] - at[("received", rid)],
                           min(served) - at[("applied", rid)]))
    if stages:
        med = np.median(np.array(stages), axis=0)
        print(f"[{learner}] p50 by stage: produced->recorded {med[0]:.3f} s, "
              f"recorded->applied {med[1]:.3f} s, applied->served {med[2]:.3f} s", flush=True)
    if passes:
        med = np.median(np.array(list(passes.values())), axis=0)
        print(f"[{learner}] {len(passes)} passes; p50 per pass: {med[0]:.0f} requests, "
              f"update {med[1]:.3f} s, guard {med[2]:.3f} s", flush=True)
    lost = sum(1 for rid in produced if rid not in applied)
    duplicated = sum(1 for v in applied.values() if len(v) > 1)
    q = np.percentile(latencies, [50, 95]) if latencies else [float("nan")] * 2
    return {"p50_s": float(q[0]), "p95_s": float(q[1]), "lost": lost,
            "duplicated": duplicated, "measured": len(latencies),
            "certified_idle": _share(idle0, idle1), "certified_stream": _share(idle1, stream1),
            "bound_wait_s": bound_wait, "swaps": swaps,
            "t0": datetime.now().isoformat(timespec="seconds")}


def _mlp_baselines(ds, params: dict) -> tuple[float, float]:  # noqa: ANN001 - datasets.Dataset
    """(a deletion by LOO swap, a deletion that retrains the network), seconds."""
    from jobs.orchestration.served_model import ServedModel

    model = ServedModel.train("mlp", np.array(ds.record_ids, dtype=object), ds.X, ds.y,
                              params)
    model.learner.fit_loo()
    swap = model.learner.delete(np.array(ds.record_ids[:1], dtype=object))
    retrain = model.learner.delete(np.array(ds.record_ids[1:2], dtype=object))
    assert swap.retrained["swap"] and not retrain.retrained["swap"]
    return swap.seconds, retrain.seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200 requests per learner")
    ap.add_argument("--learners", default="dare,sisa")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--records", type=int, default=None,
                    help="table size (default 16,000; --quick 2,000)")
    ap.add_argument("--shard-bound", type=float, default=0.0, metavar="S",
                    help="the worker's --shard-bound (default 0: no LUCID bounds)")
    ap.add_argument("--rate", type=float, default=RATE, help="deletions per second")
    args = ap.parse_args()
    n = args.requests or (200 if args.quick else 1000)
    n_records = args.records or (2000 if args.quick else max(16_000, n + 500))
    os.environ["BENTOML_HOME"] = tempfile.mkdtemp(prefix="bench-e2e-bentoml-")
    os.environ["OBLIVIATE_MODEL_STORE"] = tempfile.mkdtemp(prefix="bench-e2e-models-")
    os.environ["BENTOML_DO_NOT_TRACK"] = "true"
    from jobs.orchestration.served_model import DEFAULT_PARAMS
    from ledger import datasets

    lines = []
    for learner in args.learners.split(","):
        res = run(learner, n, n_records, args.shard_bound, args.rate)
        served = "bounds" if args.shard_bound > 0 and learner in ("sisa", "mlp") else "inf"
        line = (f"RESULT learner={learner} records={n_records} p50_s={res['p50_s']:.3f} "
                f"p95_s={res['p95_s']:.3f} lost={res['lost']} duplicated={res['duplicated']} "
                f"certified_stream={res['certified_stream']:.3f} "
                f"certified_idle={res['certified_idle']:.3f} served={served} "
                f"bound_wait_s={res['bound_wait_s']:.0f}")
        ds = datasets.load("synthetic", n_samples=n_records)
        if learner == "sisa":
            shard_s = _shard_retrain_seconds(ds, DEFAULT_PARAMS["sisa"])
            line += f" shard_retrain_s={shard_s:.3f} ratio={res['p50_s'] / shard_s:.2f}"
        if learner == "mlp":
            swap_s, retrain_s = _mlp_baselines(ds, DEFAULT_PARAMS["mlp"])
            line += (f" swaps={res['swaps']} swap_ms={swap_s * 1e3:.2f} "
                     f"retrain_s={retrain_s:.3f}")
        print(f"[{learner}] {res['measured']} latencies measured", flush=True)
        lines.append(line)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
