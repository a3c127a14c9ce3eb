"""Ledger at scale: proof times, full and incremental `verify`, at 10^5..10^7 events.

    python tests/bench/bench_ledger_scale.py [--quick] [--sizes 100000,1000000]
        [--proof-sizes 10000000] [--records N] [--backend sqlite|postgres]

For each size, a fresh ledger (signing key, a head every 1,000 events) gets N training
records (`--records`, default as many as events, capped at 10^6) and then synthetic
`bench_note` events appended through `ChainAppender` (the path every append takes:
hash chain and stored subtrees in one transaction of 1,000 events, a signed head
taken in it). Measured: an inclusion and a consistency proof (median and max over 200
random pairs, through `EventLog` as `ledger show` and `/v1/ledger/consistency` serve
them), the same proof rebuilt from every leaf as before issue 29 (sizes up to 10^6), a
full `verify` (wall and this process's CPU time: the machine is shared), and
`verify_since` after 100, then 1,000, then 10,000 more events (each from the head the
one before kept). `--proof-sizes` builds events only (no records, no verify).
`--quick`: 10^4 and 10^5 events, under a minute.
Targets (issue 29): proofs <= 5 ms at 10^7 events, full verify <= 60 s at 10^6,
incremental verify <= 5 s.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from sqlalchemy import select

from ledger import merkle
from ledger.appender import ChainAppender
from ledger.chain import event_leaf, iso, utc_now
from ledger.db import writing
from ledger.store import Ledger
from ledger.tables import EVENTS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
from tests.pg_schemas import new_schema  # noqa: E402

POSTGRES_URL = os.environ.get("OBLIVIATE_TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/test")
KEY = bytes(range(32))
SIGNING_KEY = bytes(range(100, 132))
TARGETS = {"inclusion_ms": 5.0, "consistency_ms": 5.0, "verify_full_s": 60.0,
           "verify_incremental_s": 5.0, "verify_since_100_s": 5.0,
           "verify_since_10000_s": 5.0}
PER_TRANSACTION = 1000
# incremental verifies, each from the head the one before kept: (events appended, result key)
INCREMENTS = ((100, "verify_since_100_s"), (1000, "verify_incremental_s"),
              (10_000, "verify_since_10000_s"))


def database_url(backend: str, tmp: str) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp}/ledger-{uuid.uuid4().hex[:8]}.db"
    return new_schema(POSTGRES_URL, "bench_")


def append_notes(ledger: Ledger, n: int) -> None:
    """`n` synthetic events, 1,000 per transaction, each transaction taking its head."""
    now = iso(utc_now())
    done = 0
    while done < n:
        with writing(ledger.engine) as conn:
            appender = ChainAppender(conn)
            for _ in range(min(PER_TRANSACTION, n - done)):
                appender.append("bench_note", None, {"i": appender.seq + 1}, now)
            appender.flush(conn)
            ledger.heads.take_if_due(conn, appender.seq)
        done += min(PER_TRANSACTION, n - done)


def load_records(ledger: Ledger, n: int) -> None:
    rng = np.random.default_rng(0)
    for lo in range(0, n, 200_000):
        ids = range(lo, min(n, lo + 200_000))
        ledger.records.load([f"r{i:07d}" for i in ids], [f"s{i // 3:07d}" for i in ids],
                            rng.random((len(ids), 8)), np.arange(len(ids)) % 2, name="bench")


def timed_ms(call, pairs: list[tuple[int, int]]) -> tuple[float, float]:
    times = []
    for a, b in pairs:
        t0 = time.perf_counter()
        call(a, b)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), max(times)


def proof_times(ledger: Ledger, size: int, rebuild: bool) -> dict[str, str]:
    rng = random.Random(size)
    pairs = [tuple(sorted((rng.randint(1, size), rng.randint(1, size)))) for _ in range(200)]
    inc_med, inc_max = timed_ms(lambda a, b: ledger.events.inclusion_proofs([a], b), pairs)
    con_med, con_max = timed_ms(lambda a, b: ledger.events.consistency(a, b), pairs)
    out = {"inclusion_ms": f"{inc_med:.2f}", "inclusion_max_ms": f"{inc_max:.2f}",
           "consistency_ms": f"{con_med:.2f}", "consistency_max_ms": f"{con_max:.2f}"}
    if rebuild:  # what a proof cost before the stored subtrees: every leaf read and hashed
        t0 = time.perf_counter()
        with ledger.engine.connect() as conn:
            leaves = [event_leaf(h) for h in conn.execute(
                select(EVENTS.c.hash).order_by(EVENTS.c.seq)
                .execution_options(yield_per=20_000)).scalars()]
        merkle.inclusion_proof(leaves, size // 3)
        out["rebuild_ms"] = f"{(time.perf_counter() - t0) * 1000:.0f}"
    return out


def run_size(url: str, size: int, records: int, verify: bool) -> dict[str, str]:
    ledger = Ledger(url, KEY, checkpoint_every=PER_TRANSACTION, signing_key=SIGNING_KEY,
                    head_interval_s=1e9)
    t0 = time.perf_counter()
    if records:
        load_records(ledger, records)
    append_notes(ledger, size - ledger.events.last_seq())
    built = time.perf_counter() - t0
    print(f"{size} events, {records} records built in {built:.0f} s", flush=True)
    result = {"events": str(size), "records": str(records), "build_s": f"{built:.0f}",
              **proof_times(ledger, size, rebuild=size <= 1_000_000)}
    if verify:
        t0, cpu0 = time.perf_counter(), time.process_time()
        full = ledger.verify()
        result["verify_full_s"] = f"{time.perf_counter() - t0:.1f}"
        result["verify_full_cpu_s"] = f"{time.process_time() - cpu0:.1f}"  # on a shared machine
        assert full.ok and full.verified_head is not None, full.problems[:3]
        head = full.verified_head
        for new, key in INCREMENTS:
            append_notes(ledger, new)
            t0 = time.perf_counter()
            since = ledger.verifier.verify_since(head)
            result[key] = f"{time.perf_counter() - t0:.2f}"
            assert since.ok and since.verified_head is not None, since.problems[:3]
            head = since.verified_head
    ledger.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10^4 and 10^5 events")
    ap.add_argument("--sizes", default=None, help="event counts with verify (comma-separated)")
    ap.add_argument("--proof-sizes", default="", help="event counts for proofs only")
    ap.add_argument("--records", type=int, default=None, help="training records per ledger")
    ap.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    args = ap.parse_args()
    sizes = [int(s) for s in (args.sizes or ("10000,100000" if args.quick
                                             else "100000,1000000")).split(",") if s]
    missed = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        runs = [(s, True) for s in sizes] + [(int(s), False)
                                             for s in args.proof_sizes.split(",") if s]
        for size, verify in runs:
            records = 0 if not verify else min(size, 10**6) if args.records is None \
                else args.records
            r = run_size(database_url(args.backend, tmp), size, records, verify)
            print("RESULT backend=" + args.backend + " "
                  + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
            missed += [f"{k} {r[k]} > {t} at {size} events" for k, t in TARGETS.items()
                       if k in r and float(r[k]) > t]
    for m in missed:
        print(f"TARGET missed: {m}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
