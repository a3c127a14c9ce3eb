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
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.e2e_stream import analyse, run_stream, wait_for_guard  # noqa: E402

RATE = 50.0


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


def run(learner: str, n_requests: int, n_records: int, shard_bound_s: float = 0.0,
        rate: float = RATE) -> dict[str, float | int]:
    from jobs.orchestration.registry import Registry
    from jobs.orchestration.worker import Worker
    from ledger import datasets
    from ledger.config import LedgerSettings
    from ledger.consumer import ensure_topics
    from ledger.local_broker import LocalBroker
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
        held_out = datasets.load("synthetic", n_samples=n_records + 2000).X[n_records:]
        registry = Registry(ledger.engine, model_name)

        def bounds_in() -> float:
            if shard_bound_s <= 0:
                return 0.0
            waited = wait_for_guard(registry, 1800.0, bounds=True)
            print(f"[{learner}] guard complete (bounds in) after {waited:.0f} s", flush=True)
            return waited

        # bounds are off by default: a 16k table's SISA shards of 3,200 records take
        # minutes each in the guard job, which would share the two cores with the stream
        with LocalSidecar(work, env, worker_args=["--shard-bound", str(shard_bound_s)]
                          ) as sidecar:
            stream = run_stream(sidecar, ledger, registry.current_seq, s.kafka_bootstrap,
                                s.requests_topic, messages, rate, held_out.tolist(), True,
                                ready=bounds_in, drain_s=120 + n_requests / rate)
        res = analyse(ledger.events.export(), stream, f"[{learner}]", work / "worker.log")
    return {**res, "certified_idle": stream.certified_idle,
            "certified_stream": stream.certified_stream, "bound_wait_s": stream.ready_s,
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
