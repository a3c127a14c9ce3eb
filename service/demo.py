"""`make demo`: the whole sidecar on embedded defaults, start to finish on one machine.

A local broker (tansu), a fresh SQLite ledger seeded with a bundled data set,
a first model version trained and guarded, then the three real processes
(`obliviate serve`, `obliviate worker`, `obliviate consume`). A stream of
deletion and addition requests (with resends and malformed messages mixed in)
goes through Kafka while a client asks the service for predictions. At the
end: the audit trail, the model lineage, deletion latencies, a metrics
summary, an inclusion proof checked the way an auditor would, and a full
`ledger verify`. Everything is stopped cleanly.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from jobs.consistency import verify_registry
from jobs.guard_job import JOB_DIR_PREFIX
from jobs.registry import Registry
from jobs.retention import destroyed_versions
from jobs.worker import Worker
from ledger import datasets, merkle
from ledger.chain import event_leaf
from ledger.config import Settings
from ledger.consumer import ensure_topics
from ledger.forgotten import forgotten, render
from ledger.local_broker import LocalBroker
from ledger.producer import paced, produce, request_stream
from ledger.store import Ledger
from service.processes import LocalSidecar, sidecar_env
from service.residue import TraceScanner

FINAL = ("verified", "failed")
DEMO_GRACE_S = 5.0


def progress(label: str, done: int, total: int, width: int = 30) -> None:
    """A one-line bar; redrawn only when it grows a step, so logs stay short."""
    filled = width * done // max(total, 1)
    if done < total and filled == width * (done - 1) // max(total, 1):
        return
    sys.stderr.write(f"\r{label:<10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def run_demo(workdir: str, dataset: str, n_requests: int, learner: str = "dare",
             rate: float = 50.0) -> int:
    work = Path(workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"== Obliviate demo: data set {dataset!r}, learner {learner!r}, {n_requests} "
          f"requests at {rate:g}/s, state in {work}/")
    with LocalBroker(log_path=work / "tansu.log") as broker:
        s = Settings.from_env(database_url=f"sqlite:///{work / 'ledger.db'}",
                              hmac_key_file=str(work / "hmac.key"),
                              ledger_signing_key_file=str(work / "ledger-signing.key"),
                              admin_token_file=str(work / "admin.token"),
                              kafka_bootstrap=broker.bootstrap, learner=learner)
        # versions that held deleted records are destroyed 5 s after the deletion (the
        # default is 30 s), so the demo's final scan sees them gone
        env = sidecar_env(work, s.database_url, s.kafka_bootstrap, destroy_grace_s=DEMO_GRACE_S)
        # this process trains the first version into the same model store
        os.environ.update({k: v for k, v in env.items() if k.startswith("BENTOML")})
        print(f"broker: tansu at {broker.bootstrap}; ledger: {s.database_url}")
        ensure_topics(s.kafka_bootstrap, list(s.topic_configs()), configs=s.topic_configs())
        ledger = s.open_ledger()
        ds = datasets.load(dataset)
        ledger.load_records(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name)
        print(f"record store: {len(ds.record_ids)} records of {len(set(ds.subject_ids))} "
              "subjects")
        registry = Registry(ledger.engine, s.model_name)
        first = Worker(ledger, registry).bootstrap(learner)
        print(f"model: {first} trained and guarded ({learner})")
        sidecar = LocalSidecar(work, env).start()
        try:
            print(f"service: {sidecar.base_url} (audit page {sidecar.base_url}/audit, "
                  f"admin token in {s.admin_token_file})")
            ok, stream = _stream(ledger, s, ds, n_requests, rate, sidecar)
            current = registry.current()
            ok = _await_served(sidecar.base_url, current.version if current else None) and ok
            _report(ledger, s, sidecar)
            ok = _forgotten_report(ledger, registry, ds, stream, work) and ok
        finally:
            codes = sidecar.stop()
        print("\n== stopped: " + ", ".join(f"{k} exit {v}" for k, v in codes.items()))
        result = ledger.verify()
        problems = [*result.problems, *verify_registry(ledger, registry)]
    print(f"== ledger verify: {'OK' if not problems else 'FAILED'} -- {result.events} events, "
          f"{result.heads} signed heads, {result.records} records, the model registry")
    for p in problems[:10]:
        print(f"  {p}")
    return 0 if ok and not problems and not any(codes.values()) else 1


def _stream(ledger: Ledger, s: Settings, ds: datasets.Dataset, n: int, rate: float,
            sidecar: LocalSidecar) -> tuple[bool, list[Any]]:
    """Send the requests through Kafka while a client keeps asking for predictions."""
    stream = list(request_stream(ds.record_ids, ds.subject_ids, ds.X.shape[1],
                                 sorted(set(ds.y.tolist())), n, random_state=7))
    stop = threading.Event()
    answers: Counter[str] = Counter()
    client = threading.Thread(target=_predict_loop,
                              args=(sidecar.base_url, ds.X, stop, answers))
    client.start()
    try:
        produce(s.kafka_bootstrap, s.requests_topic, paced(stream, rate),
                on_sent=lambda k: progress("sent", k, len(stream)))
        t0 = time.monotonic()
        done = total = 0
        while time.monotonic() - t0 < 300:
            dead = sidecar.dead()
            if dead:
                print(f"\n{dead} stopped unexpectedly:\n{sidecar.procs[dead].log_tail()}")
                return False, stream
            counts = ledger.status_counts()
            total = sum(counts.values())
            done = sum(counts.get(k, 0) for k in FINAL)
            if ledger.consumed(s.requests_topic) >= len(stream) and done == total:
                break
            progress("applied", done, max(total, 1))
            time.sleep(0.25)
        progress("applied", done, max(total, 1))
    finally:
        stop.set()
        client.join()
    print(f"predictions during the stream: {sum(answers.values())} "
          f"({', '.join(f'{k}={v}' for k, v in sorted(answers.items()))})")
    return done == total and answers.get("error", 0) == 0, stream


def _await_served(base: str, version: str | None, timeout_s: float = 30.0) -> bool:
    """Wait until the service answers with the current version, so the report shows it."""
    deadline = time.monotonic() + timeout_s
    served = None
    while time.monotonic() < deadline:
        try:
            served = httpx.get(f"{base}/v1/models", timeout=5).json()["serving"]
        except (httpx.HTTPError, KeyError, ValueError):
            served = None
        if served and served.get("version") == version:
            break
        time.sleep(0.2)
    served = served or {}
    print(f"service now serves {served.get('version', '-')} (current {version}), "
          f"guard {served.get('mode', '-')}")
    return served.get("version") == version


def _predict_loop(base: str, X: np.ndarray, stop: threading.Event,
                  answers: Counter[str]) -> None:
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=base, timeout=10.0) as http:
        while not stop.is_set():
            rows = X[rng.integers(len(X), size=8)].tolist()
            try:
                r = http.post("/v1/predict", json={"instances": rows})
                answers[f"guard {r.json()['guard']}" if r.status_code == 200 else "error"] += 1
            except httpx.HTTPError:
                answers["error"] += 1
            stop.wait(0.05)


def _report(ledger: Ledger, s: Settings, sidecar: LocalSidecar) -> None:
    events = list(ledger.export())
    print_audit(ledger, events)
    print("\n== model lineage (newest first)")
    for v in Registry(ledger.engine, s.model_name).lineage(8):
        m, ts = v.manifest, v.manifest["training_set"]
        print(f"  {v.version}  parent={v.parent or '-':8} {m['change']['op']:6} "
              f"guard={'sound' if m['guard']['ready'] else 'noise-all':9} "
              f"records={ts['count']:4}  root={ts['merkle_root'][:12]}")
    lat = deletion_latencies(events)
    if lat:
        q = np.percentile(lat, [50, 95, 100])
        print(f"\n== deletion latency (received -> applied in a published version), "
              f"{len(lat)} deletions: p50 {q[0]:.2f} s, p95 {q[1]:.2f} s, max {q[2]:.2f} s")
    print("\n== metrics summary")
    for url in (f"{sidecar.base_url}/metrics",
                f"http://127.0.0.1:{sidecar.worker_port}/metrics"):
        try:
            text = httpx.get(url, timeout=10).text
        except httpx.HTTPError as exc:
            print(f"  {url}: {exc}")
            continue
        for line in text.splitlines():
            if line.startswith(("obliviate_guard_queries_total", "obliviate_guard_mode",
                                "obliviate_requests_pending", "obliviate_model_version",
                                "obliviate_served_model_version", "obliviate_model_swaps_total",
                                "obliviate_guard_epsilon_spent_total",
                                "obliviate_deletion_latency_seconds_count",
                                "obliviate_requests_applied_total")):
                print(f"  {line}")


def _forgotten_report(ledger: Ledger, registry: Registry, ds: datasets.Dataset,
                      stream: list[Any], work: Path) -> bool:
    """Wait out the grace period, then scan every file the demo's sidecar wrote for the
    records it purged; print what was destroyed and one deletion's `ledger forgotten`."""
    deadline = time.monotonic() + DEMO_GRACE_S + 30
    while time.monotonic() < deadline and any(
            v.superseded_by_deletion and not v.destroyed_at for v in registry.lineage(1000)):
        time.sleep(0.5)
    features = {rid: x for rid, x in zip(ds.record_ids, ds.X, strict=True)}
    for m in stream:
        if isinstance(m, dict) and m.get("op") == "add":
            features.update({r["record_id"]: np.asarray(r["features"], dtype=np.float64)
                             for r in m["payload"]["records"]})
    states = ledger.record_states()
    gone = {r: features[r] for r, state in states.items() if state == "purged"}
    kept = np.array([features[r] for r, state in states.items() if state != "purged"])
    scanner = TraceScanner(gone, kept=kept, ids=False)
    files = [p for p in work.rglob("*") if p.is_file()]
    found = (scanner.scan([*files, *Path(tempfile.gettempdir()).glob(f"{JOB_DIR_PREFIX}*")])
             + TraceScanner(gone, kept=kept).scan_model_store(registry))
    destroyed = [v for v, _ in destroyed_versions(registry)]
    print(f"\n== forget means gone: {len(gone)} purged records looked for in "
          f"{len(files)} files ({sum(p.stat().st_size for p in files) / 2**20:.1f} MiB: "
          "ledger database and WAL, model store raw and unsealed, logs, guard temp dirs)")
    if found:
        print(f"  TRACES FOUND ({len(found)}):")
        for f in found[:10]:
            print(f"  {f.record_id}: {f.trace} in {f.path}")
    else:
        print("  no artifact holds a purged record (values as float32/float64 bytes and "
              "text; ids in the model store)")
    kept_versions = registry.stored_versions()
    print(f"  destroyed versions ({len(destroyed)}): {_ranges(destroyed)}; kept in the "
          f"model store: {', '.join(kept_versions)}")
    subject_deletions = [e["request_id"] for e in ledger.export() if e["kind"] == "received"
                         and e["payload"].get("expanded_from_subject")]
    verified = [r for r in subject_deletions
                if ledger.history(r)["request"]["status"] == "verified"]
    if verified:
        print(f"\n== obliviate ledger forgotten {verified[-1]}")
        for line in render(forgotten(ledger, verified[-1])):
            print(f"  {line}")
    return not found


def _ranges(versions: list[str]) -> str:
    if len(versions) > 6:
        return f"{versions[0]} .. {versions[-1]}"
    return ", ".join(versions) or "none"


def deletion_latencies(events: list[dict[str, Any]]) -> list[float]:
    """Seconds from `received` to `applied` per deletion, from the ledger's own times."""
    received: dict[str, datetime] = {}
    out = []
    for e in events:
        if e["kind"] == "received" and e["payload"].get("op") == "delete":
            received[e["request_id"]] = datetime.fromisoformat(e["created_at"])
        elif e["kind"] == "applied" and e["request_id"] in received:
            t = datetime.fromisoformat(e["created_at"])
            out.append((t - received[e["request_id"]]).total_seconds())
    return out


def print_audit(ledger: Ledger, events: list[dict[str, Any]]) -> None:
    kinds = Counter(e["kind"] for e in events)
    print("\n== events by kind: " + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())))
    print("\n== audit trail (last 12 events)")
    print(f"{'seq':>5}  {'kind':<14} {'request':<20} {'version':<8} detail")
    for e in events[-12:]:
        p = e["payload"]
        if e["kind"] == "received":
            what = f"{p['op']} {len(p['record_ids'])} record(s)"
            if p.get("expanded_from_subject"):
                what += f" of subject {p['subject_id']}"
        elif e["kind"] in ("rejected", "failed"):
            what = p["reason"]
        elif e["kind"] == "applied":
            what = f"guarantee={p.get('guarantee')} purged={len(p.get('purged_record_hashes', {}))}"
        elif e["kind"] == "verified":
            what = f"exact={p.get('exactness', {}).get('exact')} guard={p['guard']['rule']}"
        else:
            what = ", ".join(f"{k}={v}" for k, v in list(p.items())[:3])
        print(f"{e['seq']:>5}  {e['kind']:<14} {str(e['request_id'] or '-'):<20} "
              f"{e['model_version'] or '-':<8} {what[:60]}")
    sample = next((e for e in reversed(events) if e["kind"] == "verified"), None)
    if sample is None:
        return
    history = ledger.history(sample["request_id"])
    head = history["tree_head"]
    print(f"\n== ledger show {sample['request_id']}: status {history['request']['status']}")
    for ev in history["events"]:
        ok = merkle.verify_inclusion(event_leaf(ev["hash"]), ev["seq"] - 1, head["tree_size"],
                                     [bytes.fromhex(h) for h in ev["inclusion_proof"]],
                                     bytes.fromhex(head["root_hash"]))
        print(f"  {ev['created_at']}  {ev['kind']:<9} {ev['model_version'] or '-':<8} "
              f"inclusion proof ({len(ev['inclusion_proof'])} hashes) to root "
              f"{head['root_hash'][:16]}...: {'VALID' if ok else 'INVALID'}")
