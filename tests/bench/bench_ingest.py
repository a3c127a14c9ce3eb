"""Ingest benchmark: ledger intake rate vs raw kafka-python consume+parse, same topic, same run.

    python tests/bench/bench_ingest.py [--quick] [--n N] [--backends sqlite,postgres]

Produces N requests (the demo's mix: deletions by record and by subject,
additions, resends, malformed messages) to a tansu topic, then reads the topic
twice per backend: once with a bare consumer that only parses the JSON (the
baseline), once through the ledger's consumer, which validates, expands, hash-
chains and commits every batch. Both rates exclude the consumer-group join.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from kafka import KafkaConsumer

from ledger.consumer import RequestConsumer, ensure_topics
from ledger.local_broker import LocalBroker
from ledger.producer import produce, request_stream
from ledger.store import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
from tests.pg_schemas import new_schema  # noqa: E402

POSTGRES_URL = os.environ.get("OBLIVIATE_TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/test")
KEY = bytes(range(32))
N_FEATURES = 10


def raw_rate(bootstrap: str, topic: str, n: int) -> float:
    """Messages per second for consume + json.loads, from the first message to the n-th."""
    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=f"raw-{uuid.uuid4().hex}",
                      auto_offset_reset="earliest", enable_auto_commit=False,
                      max_poll_records=500, session_timeout_ms=6000, heartbeat_interval_ms=1000)
    seen, t0 = 0, None
    while seen < n:
        for recs in c.poll(timeout_ms=200, max_records=500).values():
            if t0 is None:
                t0 = time.perf_counter()
            for r in recs:
                with contextlib.suppress(ValueError):
                    json.loads(r.value)
            seen += len(recs)
    dt = time.perf_counter() - t0
    c.close()
    return n / dt


def ledger_rate(ledger: Ledger, bootstrap: str, topic: str, n: int) -> float:
    consumer = RequestConsumer(ledger, bootstrap, topic, topic + ".dead",
                               group_id=f"ledger-{uuid.uuid4().hex}", batch_size=500)
    started: list[float] = []
    receive = ledger.intake.receive_batch

    def timed_receive(*args, **kwargs):
        if not started:
            started.append(time.perf_counter())
        return receive(*args, **kwargs)

    ledger.intake.receive_batch = timed_receive  # type: ignore[method-assign]

    def on_batch(_results) -> None:
        if consumer.stats.messages >= n:
            consumer.stop()

    consumer.run(on_batch=on_batch)
    dt = time.perf_counter() - started[0]
    assert consumer.stats.messages == n, consumer.stats
    return n / dt


def fresh_postgres_schema() -> str | None:
    try:
        return new_schema(POSTGRES_URL, "bench_", connect_timeout=3)
    except Exception as exc:  # noqa: BLE001
        print(f"postgres: skipped, no server answers at {POSTGRES_URL} ({exc.__class__.__name__})")
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5,000 requests instead of 50,000")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--backends", default="sqlite,postgres")
    args = ap.parse_args()
    n = args.n or (5_000 if args.quick else 50_000)
    n_records = int(n * 1.4)
    rng = np.random.default_rng(0)
    record_ids = [f"r{i:07d}" for i in range(n_records)]
    subject_ids = [f"s{i // 3:07d}" for i in range(n_records)]
    X = rng.random((n_records, N_FEATURES))
    y = rng.integers(0, 2, n_records)
    messages = list(request_stream(record_ids, subject_ids, N_FEATURES, [0, 1], n,
                                   random_state=1))
    assert len(messages) == n
    results = []
    with LocalBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        topic = f"bench-{uuid.uuid4().hex[:8]}"
        ensure_topics(broker.bootstrap, [topic, topic + ".dead"])
        t0 = time.perf_counter()
        produce(broker.bootstrap, topic, messages)
        print(f"produced {n} requests in {time.perf_counter() - t0:.1f} s", flush=True)
        for backend in args.backends.split(","):
            url = (f"sqlite:///{tmp}/ledger.db" if backend == "sqlite"
                   else fresh_postgres_schema())
            if url is None:
                continue
            ledger = Ledger(url, KEY, checkpoint_every=1000)
            t0 = time.perf_counter()
            ledger.records.load(record_ids, subject_ids, X, y, name="bench")
            print(f"{backend}: seeded {n_records} records in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            raw = raw_rate(broker.bootstrap, topic, n)
            print(f"{backend}: raw consume+parse {raw:,.0f} msg/s", flush=True)
            ingest = ledger_rate(ledger, broker.bootstrap, topic, n)
            print(f"{backend}: ledger ingest {ingest:,.0f} msg/s", flush=True)
            t0 = time.perf_counter()
            ok = ledger.verify().ok
            print(f"{backend}: ledger verify {'OK' if ok else 'FAILED'} in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            ledger.close()
            if not ok:
                return 1
            results.append((backend, ingest, raw))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process: {peak_mb:.0f} MB")
    for backend, ingest, raw in results:
        print(f"RESULT backend={backend} ingest_per_s={ingest:.0f} raw_per_s={raw:.0f} "
              f"ratio={ingest / raw:.2f} n={n} peak_rss_mb={peak_mb:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
