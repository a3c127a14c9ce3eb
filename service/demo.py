"""`make demo`: the main job on embedded defaults, start to finish on one machine.

A local broker, a fresh SQLite ledger seeded with a bundled data set, a stream
of deletion and addition requests (with resends and malformed messages mixed
in) consumed into the ledger, then the audit trail, an inclusion proof checked
the way an auditor would, and a full `ledger verify`.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from ledger import datasets, merkle
from ledger.chain import event_leaf
from ledger.config import Settings
from ledger.consumer import RequestConsumer, ensure_topics
from ledger.local_broker import LocalBroker
from ledger.producer import produce, request_stream


def progress(label: str, done: int, total: int, width: int = 30) -> None:
    """A one-line bar; redrawn only when it grows a step, so logs stay short."""
    filled = width * done // max(total, 1)
    if done < total and filled == width * (done - 1) // max(total, 1):
        return
    sys.stderr.write(f"\r{label:<10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_demo(workdir: str, dataset: str, n_requests: int) -> int:
    work = Path(workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"== Obliviate demo: data set {dataset!r}, {n_requests} requests, state in {work}/")
    with LocalBroker(log_path=work / "tansu.log") as broker:
        s = Settings.from_env(database_url=f"sqlite:///{work / 'ledger.db'}",
                              hmac_key_file=str(work / "hmac.key"),
                              kafka_bootstrap=broker.bootstrap)
        print(f"broker: tansu at {broker.bootstrap}; ledger: {s.database_url}")
        ensure_topics(s.kafka_bootstrap, [s.requests_topic, s.dead_letter_topic])
        ledger = s.open_ledger()
        ds = datasets.load(dataset)
        ledger.load_records(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name)
        print(f"record store: {len(ds.record_ids)} records of {len(set(ds.subject_ids))} subjects")

        stream = list(request_stream(ds.record_ids, ds.subject_ids, ds.X.shape[1],
                                     sorted(set(ds.y.tolist())), n_requests, random_state=7))
        consumer = RequestConsumer(ledger, s.kafka_bootstrap, s.requests_topic,
                                   s.dead_letter_topic, group_id="obliviate-demo")
        seen = [0]

        def on_batch(results: list) -> None:
            seen[0] += len(results)
            progress("recorded", seen[0], len(stream))

        t0 = time.monotonic()
        thread = threading.Thread(target=consumer.run, kwargs={"on_batch": on_batch})
        thread.start()
        produce(s.kafka_bootstrap, s.requests_topic, stream,
                on_sent=lambda n: progress("sent", n, len(stream)))
        while seen[0] < len(stream) and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        consumer.stop()
        thread.join()
        print(f"consumed {seen[0]} messages in {time.monotonic() - t0:.1f} s "
              f"(including the consumer-group join)")
        print_audit(ledger, consumer.stats.counts)
        result = ledger.verify()
    print(f"\n== ledger verify: {'OK' if result.ok else 'FAILED'} -- {result.events} events, "
          f"{result.checkpoints} checkpoints, {result.records} records")
    for p in result.problems[:10]:
        print(f"  {p}")
    return 0 if result.ok and seen[0] == len(stream) else 1


def print_audit(ledger, counts: dict[str, int]) -> None:  # noqa: ANN001 - Ledger
    print("\n== intake: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    events = list(ledger.export())
    kinds = Counter(e["kind"] for e in events)
    print("== events by kind: " + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())))
    print("\n== audit trail (last 12 events)")
    print(f"{'seq':>5}  {'kind':<9} {'request':<20} detail")
    for e in events[-12:]:
        p = e["payload"]
        if e["kind"] == "received":
            what = f"{p['op']} {len(p['record_ids'])} record(s)"
            if p.get("expanded_from_subject"):
                what += f" of subject {p['subject_id']}"
        elif e["kind"] == "rejected":
            what = p["reason"]
        else:
            what = ", ".join(f"{k}={v}" for k, v in list(p.items())[:3])
        print(f"{e['seq']:>5}  {e['kind']:<9} {str(e['request_id'] or '-'):<20} {what[:70]}")
    sample = next((e for e in reversed(events) if e["kind"] == "received"), None)
    if sample is None:
        return
    history = ledger.history(sample["request_id"])
    head = history["tree_head"]
    ev = history["events"][0]
    ok = merkle.verify_inclusion(event_leaf(ev["hash"]), ev["seq"] - 1, head["tree_size"],
                                 [bytes.fromhex(h) for h in ev["inclusion_proof"]],
                                 bytes.fromhex(head["root_hash"]))
    print(f"\n== ledger show {sample['request_id']}: status {history['request']['status']}, "
          f"event {ev['seq']} proven in tree of {head['tree_size']} events "
          f"(root {head['root_hash'][:16]}...) with {len(ev['inclusion_proof'])} hashes: "
          f"{'VALID' if ok else 'INVALID'}")
