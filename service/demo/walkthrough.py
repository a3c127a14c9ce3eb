"""`make demo`: the whole sidecar on embedded defaults, start to finish on one machine.

A local broker, a fresh SQLite ledger on a bundled data set, a first version trained and
guarded, the three real processes; deletions and additions (resends and malformed
messages mixed in) through Kafka while a client asks for predictions; then the audit
trail, lineage, latencies, metrics, an inclusion proof and `ledger verify`.
See docs/development.md (What `make demo` does)."""

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

from jobs.orchestration.consistency import verify_registry
from jobs.orchestration.guard_job import JOB_DIR_PREFIX
from jobs.orchestration.job_settings import JobSettings
from jobs.orchestration.registry import Registry
from jobs.orchestration.retention import destroyed_versions
from jobs.orchestration.worker import Worker
from ledger import datasets, merkle
from ledger.chain import event_leaf
from ledger.config import LedgerSettings
from ledger.consumer import ensure_topics
from ledger.forgotten import forgotten, render
from ledger.local_broker import LocalBroker
from ledger.producer import paced, produce, request_stream
from ledger.store import Ledger
from service.demo.processes import LocalSidecar, sidecar_env
from service.demo.residue import TraceScanner
from service.service_settings import ServiceSettings

FINAL = ("verified", "failed")
DEMO_GRACE_S = 5.0
DEMO_MARKER = ".obliviate-demo"  # in a work dir the demo made (and may empty again)


def run_demo(workdir: str, dataset: str, n_requests: int, learner: str = "dare",
             rate: float = 50.0, params: dict[str, Any] | None = None) -> int:
    work = fresh_workdir(Path(workdir))
    print(f"== Obliviate demo: data set {dataset!r}, learner {learner!r}, {n_requests} "
          f"requests at {rate:g}/s, state in {work}/")
    with LocalBroker(log_path=work / "tansu.log") as broker:
        s = LedgerSettings.from_env(database_url=f"sqlite:///{work / 'ledger.db'}",
                                    hmac_key_file=str(work / "hmac.key"),
                                    ledger_signing_key_file=str(work / "ledger-signing.key"),
                                    key_store_dir=str(work / "keys"),
                                    kafka_bootstrap=broker.bootstrap)
        served = ServiceSettings.from_env(admin_token_file=str(work / "admin.token"))
        # versions that held deleted records are destroyed 5 s after the deletion (the
        # default is 30 s), so the demo's final scan sees them gone
        env = sidecar_env(work, s.database_url, s.kafka_bootstrap, destroy_grace_s=DEMO_GRACE_S)
        # this process trains the first version into the same model store
        os.environ.update({k: v for k, v in env.items() if k.startswith("BENTOML")})
        print(f"broker: tansu at {broker.bootstrap}; ledger: {s.database_url}")
        ensure_topics(s.kafka_bootstrap, list(s.topic_configs()), configs=s.topic_configs())
        ledger = s.open_ledger()
        ds = datasets.load(dataset)
        ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name,
                            transform=ds.transform)
        print(f"record store: {len(ds.record_ids)} records of {len(set(ds.subject_ids))} "
              f"subjects, {ds.X.shape[1]} features min-max scaled by ranges stored in the "
              "ledger (clients send raw values)")
        registry = Registry(ledger.engine, JobSettings.from_env().model_name, ledger.keys,
                            store=env["OBLIVIATE_MODEL_STORE"])
        first = Worker(ledger, registry).bootstrap(learner, params)
        print(f"model: {first} trained ({learner}) and guarded"
              + (" in noise-all mode until the worker's guard job has bounded it"
                 if learner == "mlp" else ""))
        sidecar = LocalSidecar(work, env).start()
        try:
            print(f"service: {sidecar.base_url} (audit page {sidecar.base_url}/audit, "
                  f"admin token in {served.admin_token_file})")
            if learner == "mlp":
                _await_first_bound(registry)
            ok, stream = _stream(ledger, s, ds, n_requests, rate, sidecar)
            current = registry.current()
            ok = _await_served(sidecar.base_url, current.version if current else None) and ok
            if learner == "sisa":
                _await_shard_bounds(registry, sidecar.base_url)
            elif learner == "mlp":
                _await_network_bound(ledger, registry, sidecar.base_url)
            _report(ledger, served, sidecar, stream)
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
    states = Counter(ledger.records.states().values())
    current = registry.current()
    print(f"   records vs live records: verify checks all {result.records} records the ledger "
          f"has ever held ({states.get('live', 0)} live + {states.get('purged', 0)} purged + "
          f"{states.get('pending', 0)} pending): a purged record keeps its id and keyed "
          "fingerprint (its data is gone) so that its deletion stays provable. The lineage's "
          f"records = {current.manifest['training_set']['count'] if current else '-'} is "
          "the current version's training set: the live records only")
    return 0 if ok and not problems and not any(codes.values()) else 1


def fresh_workdir(workdir: Path) -> Path:
    """`workdir`, empty and marked as the demo's: a previous demo's is emptied; one that
    holds anything else is refused (ValueError), so nothing the demo did not make is lost."""
    work = workdir.resolve()
    if work.exists() and not work.is_dir():
        raise ValueError(f"--workdir {workdir} is a file, not a directory: pick another")
    if work.is_dir() and any(work.iterdir()):
        if not (work / DEMO_MARKER).is_file():
            raise ValueError(f"--workdir {workdir} is not empty and not a previous demo's "
                             f"(no {DEMO_MARKER} in it): pick another --workdir, or empty it")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / DEMO_MARKER).write_text("made by `obliviate demo`: the next demo empties "
                                    "this directory\n")
    return work


def _stream(ledger: Ledger, s: LedgerSettings, ds: datasets.Dataset, n: int, rate: float,
            sidecar: LocalSidecar) -> tuple[bool, list[Any]]:
    """Send the requests through Kafka while a client keeps asking for predictions, with
    one live line: sent, what intake made of them, applied and verified."""
    t = ds.transform
    stream = list(request_stream(ds.record_ids, ds.subject_ids, ds.X.shape[1],
                                 sorted(set(ds.y.tolist())), n, random_state=7,
                                 feature_ranges=list(zip(t.mins, t.maxs, strict=True))))
    stop = threading.Event()
    answers: Counter[str] = Counter()
    sent = [0]
    client = threading.Thread(target=_predict_loop,
                              args=(sidecar.base_url, ds.raw, stop, answers))
    sender = threading.Thread(target=produce, args=(s.kafka_bootstrap, s.requests_topic,
                                                    paced(stream, rate)),
                              kwargs={"on_sent": lambda k: sent.__setitem__(0, k)})
    client.start()
    sender.start()
    ok = False
    try:
        t0 = time.monotonic()
        line = ""
        while time.monotonic() - t0 < 300:
            dead = sidecar.dead()
            if dead:
                print(f"\n{dead} stopped unexpectedly:\n{sidecar.procs[dead].log_tail()}")
                return False, stream
            counts, intake = ledger.lifecycle.status_counts(), ledger.intake.counts()
            total = sum(counts.values())
            applied = sum(counts.get(k, 0) for k in ("applied", "verified"))
            verified, failed = counts.get("verified", 0), counts.get("failed", 0)
            new = (f"sent {sent[0]:3d}/{len(stream)}  accepted {intake['accepted']:3d}  "
                   f"duplicates {intake['duplicates']:2d}  rejected {intake['rejected']:2d}  "
                   f"| applied {applied:3d}/{total}  verified {verified:3d}/{total}"
                   + (f"  failed {failed}" if failed else ""))
            if new != line:
                sys.stderr.write("\r" + new)
                sys.stderr.flush()
                line = new
            if (not sender.is_alive() and ledger.intake.consumed(s.requests_topic) >= len(stream)
                    and verified + failed == total):
                ok = failed == 0
                break
            time.sleep(0.25)
        sys.stderr.write("\n")
    finally:
        stop.set()
        client.join()
        sender.join()
    outcomes = ", ".join(f"{k}={v}" for k, v in sorted(answers.items()))
    print(f"predictions during the stream (raw features, as a client sends them): "
          f"{sum(answers.values())} calls ({outcomes})")
    return ok and answers.get("error", 0) == 0, stream


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


def _predict_loop(base: str, raw: np.ndarray, stop: threading.Event,
                  answers: Counter[str]) -> None:
    """A client: rows in the features' own units (the service scales them)."""
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=base, timeout=10.0) as http:
        while not stop.is_set():
            rows = raw[rng.integers(len(raw), size=8)].tolist()
            try:
                r = http.post("/v1/predict", json={"instances": rows})
                answers[f"guard {r.json()['guard']}" if r.status_code == 200 else "error"] += 1
            except httpx.HTTPError:
                answers["error"] += 1
            stop.wait(0.05)


def _await_shard_bounds(registry: Registry, base_url: str, timeout_s: float = 300.0) -> None:
    """Show the per-shard bounds arriving: the worker's guard job computes one shard after
    the other once the stream pauses, and publishes them with the version they bound.
    Not a pass/fail step: without them every answer is still sound, only fewer certain."""
    print("\n== per-shard bounds (SISA): the guard job computes each shard's LUCID bound in "
          "the background; until then a shard counts as fragile (bound +inf)")
    t0, seen = time.monotonic(), None
    while time.monotonic() - t0 < timeout_s:
        cur = registry.current()
        bound = cur.manifest["guard"].get("bound") if cur else None
        if bound is None:
            why = cur.manifest["guard"].get("why") if cur else None
            print(f"  the vote rule serves: {why or 'no per-shard bounds (not the LOO schedule)'}")
            return
        done = sum(row["current"] for row in bound["shards"])
        if (cur.version, done) != seen:
            seen = (cur.version, done)
            print(f"  {time.monotonic() - t0:5.1f} s  {cur.version}: {done}/"
                  f"{len(bound['shards'])} shards bounded")
        if bound["complete"] and _await_served(base_url, cur.version):
            for row in bound["shards"]:
                if row.get("skipped"):
                    print(f"    shard {row['shard']}: {row['skipped']}")
                    continue
                beta = ", ".join(f"{b:.3g}" if isinstance(b, float) else str(b)
                                 for b in row["beta"] or [])
                print(f"    shard {row['shard']}: beta [{beta}] in {row.get('seconds', 0):.1f} "
                      f"s ({', '.join(row.get('status', []))}; solvers "
                      f"{', '.join(row.get('solvers', [])) or 'none needed'})")
            return
        time.sleep(1.0)
    print(f"  not complete after {timeout_s:.0f} s (answers stay sound: unbounded shards count "
          "as fragile)")


def _await_first_bound(registry: Registry, timeout_s: float = 300.0) -> None:
    """The mlp learner's first version answers in noise-all mode: the worker's guard job
    trains its LOO set and bounds it in the background. Wait for that before the stream,
    so that the first deletion is a swap and the client's first answers are certified."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        cur = registry.current()
        if cur is not None and (why := cur.manifest["guard"]["bound"].get("skipped")):
            print(f"guard: {why}; the network answers in noise-all mode")
            return
        if cur is not None and cur.manifest["guard"].get("mode") == "sound":
            bound = cur.manifest["guard"]["bound"]
            print(f"guard: LOO set of {cur.manifest['training_set']['count']} records trained "
                  f"in {bound.get('loo_seconds', 0):.1f} s and bounded in "
                  f"{bound.get('seconds', 0):.1f} s by the worker's guard job ({cur.version})")
            return
        time.sleep(0.5)
    print(f"guard: no bound after {timeout_s:.0f} s; the stream starts in noise-all mode")


def _await_network_bound(ledger: Ledger, registry: Registry, base_url: str,
                         timeout_s: float = 300.0) -> None:
    """Show the single network's LOO set and bound arriving after the stream: a deletion
    swapped in N_-x, or retrained the network, and left the version in noise-all mode; the
    guard job trains the LOO set of the records left and bounds it. Not a pass/fail step
    (noise-all is sound)."""
    passes: dict[str, bool] = {}
    for e in ledger.events.export():
        if e["kind"] == "applied" and e["request_id"]:
            detail = e["payload"].get("retrained", {}).get("detail", [])
            passes[e["model_version"]] = any(d.get("swap") for d in detail)
    print(f"\n== LUCID bound (mlp): {sum(passes.values())} of {len(passes)} updates swapped "
          "in N_-x (one deletion with the LOO set at hand), the others retrained the one "
          "network; each left the version in noise-all mode until the guard job has "
          "trained the new LOO set and bounded it")
    t0, seen = time.monotonic(), None
    while time.monotonic() - t0 < timeout_s:
        cur = registry.current()
        bound = cur.manifest["guard"]["bound"] if cur else {}
        state = (cur.version if cur else None, bound.get("loo_set"), bound.get("complete"))
        if state != seen:
            seen = state
            print(f"  {time.monotonic() - t0:5.1f} s  {state[0]}: LOO set "
                  f"{'trained' if state[1] else 'pending'}, bound "
                  f"{'in' if state[2] else 'pending'}")
        if bound.get("skipped"):
            print(f"  {bound['skipped']}")
            return
        if bound.get("complete") and _await_served(base_url, cur.version):
            beta = ", ".join(f"{b:.3g}" for b in bound["beta"])
            print(f"    beta [{beta}]: LOO set {bound.get('loo_seconds', 0):.1f} s, bound "
                  f"{bound.get('seconds', 0):.1f} s ({', '.join(bound.get('status', []))}; "
                  f"solvers {', '.join(bound.get('solvers', [])) or 'none needed'})")
            return
        time.sleep(1.0)
    print(f"  not in after {timeout_s:.0f} s (answers stay sound: noise-all until then)")


def _report(ledger: Ledger, s: ServiceSettings, sidecar: LocalSidecar, stream: list[Any]) -> None:
    events = list(ledger.events.export())
    intake = ledger.intake.counts()
    print(f"\n== intake: {len(stream)} messages sent = {intake['accepted']} accepted "
          f"({intake['deletions']} deletions, {intake['additions']} additions) + "
          f"{intake['duplicates']} resent request ids (duplicates: counted, no second "
          f"effect) + {intake['rejected']} rejected (each a `rejected` event with its "
          "reason; the message itself went to the dead-letter topic)")
    print_audit(ledger, events)
    print("\n== model lineage (newest first; records = the version's training set)")
    for v in Registry(ledger.engine, JobSettings.from_env().model_name, ledger.keys).lineage(8):
        m, ts = v.manifest, v.manifest["training_set"]
        print(f"  {v.version}  parent={v.parent or '-':8} {m['change']['op']:6} "
              f"guard={m['guard'].get('mode', 'sound' if m['guard']['ready'] else 'noise-all'):9} "
              f"records={ts['count']:4}  root={ts['merkle_root'][:12]}")
    lat = deletion_latencies(events)
    if lat:
        q = np.percentile(lat, [50, 95, 100])
        print(f"\n== deletion latency (received -> applied in a published version), "
              f"{len(lat)} deletions: p50 {q[0]:.2f} s, p95 {q[1]:.2f} s, max {q[2]:.2f} s")
    print("\n== metrics summary")
    service_metrics: dict[str, float] = {}
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
            name, _, value = line.partition(" ")
            if url.startswith(sidecar.base_url) and name in (
                    "obliviate_guard_epsilon_spent_total", "obliviate_guard_epsilon_budget",
                    "obliviate_guard_epsilon_per_query"):
                service_metrics[name] = float(value)
    spent = service_metrics.get("obliviate_guard_epsilon_spent_total", 0.0)
    budget = service_metrics.get("obliviate_guard_epsilon_budget", s.epsilon_budget)
    each = service_metrics.get("obliviate_guard_epsilon_per_query", s.epsilon)
    print(f"\n== privacy spent by the guard: epsilon {spent:g} of the budget {budget:g} "
          f"({100 * spent / budget if budget else 0:.1f}%; {spent / each if each else 0:.0f} "
          f"fresh noised answers at epsilon {each:g} each; an alert fires at the budget, "
          "OBLIVIATE_EPSILON_BUDGET)")


def _forgotten_report(ledger: Ledger, registry: Registry, ds: datasets.Dataset,
                      stream: list[Any], work: Path) -> bool:
    """Wait out the grace period, then scan every file the demo's sidecar wrote for the
    records it purged; print what was destroyed and one deletion's `ledger forgotten`."""
    deadline = time.monotonic() + DEMO_GRACE_S + 30
    while time.monotonic() < deadline and any(
            v.superseded_by_deletion and not v.destroyed_at for v in registry.lineage(1000)):
        time.sleep(0.5)
    features = {rid: x for rid, x in zip(ds.record_ids, ds.X, strict=True)}
    for m in stream:  # additions carry raw features; the ledger holds them scaled
        if isinstance(m, dict) and m.get("op") == "add":
            scaled = m["payload"].get("scaled", False)
            features.update({r["record_id"]: np.asarray(
                r["features"] if scaled else ds.transform.scale_row(r["features"]),
                dtype=np.float64) for r in m["payload"]["records"]})
    states = ledger.records.states()
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
    subject_deletions = [e["request_id"] for e in ledger.events.export() if e["kind"] == "received"
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
    # one deletion's whole lifecycle: a subject's, verified, with every event's proof
    verified = {e["request_id"] for e in events if e["kind"] == "verified"}
    subject = [e["request_id"] for e in events if e["kind"] == "received"
               and e["payload"].get("expanded_from_subject") and e["request_id"] in verified]
    record = [e["request_id"] for e in events if e["kind"] == "received"
              and e["payload"].get("op") == "delete" and e["request_id"] in verified]
    sample = (subject or record or [None])[-1]
    if sample is None:
        return
    history = ledger.history(sample)
    head = history["tree_head"]
    print(f"\n== audit trail of one deletion, {sample} (`obliviate ledger show {sample}`): "
          f"every event with its inclusion proof to root {head['root_hash'][:16]}... "
          f"(tree size {head['tree_size']})")
    print(f"  {'seq':>5}  {'kind':<9} {'version':<8} {'proof':<7} what happened")
    for ev in history["events"]:
        ok = merkle.verify_inclusion(event_leaf(ev["hash"]), ev["seq"] - 1, head["tree_size"],
                                     [bytes.fromhex(h) for h in ev["inclusion_proof"]],
                                     bytes.fromhex(head["root_hash"]))
        print(f"  {ev['seq']:>5}  {ev['kind']:<9} {ev['model_version'] or '-':<8} "
              f"{'VALID' if ok else 'INVALID':<7} {_what(ev)}")


def _what(ev: dict[str, Any]) -> str:
    p = ev["payload"]
    if ev["kind"] == "received":
        what = f"{p['op']} of {len(p['record_ids'])} record(s)"
        if p.get("expanded_from_subject"):
            what += f", all of subject {p['subject_id']}"
        return f"{what}, from {p['source'].get('kind')} at {ev['created_at']}"
    if ev["kind"] == "claimed":
        return f"taken by worker {p.get('worker', '?')}"
    if ev["kind"] == "applied":
        guard = (f" with its guard (updated in {p['guard_seconds']:.2f} s)"
                 if "guard_seconds" in p else "")
        return (f"purged {len(p.get('purged_record_hashes', {}))} record(s) (keyed "
                f"fingerprints in this event); version published{guard}, guarantee "
                f"{p.get('guarantee')}")
    if ev["kind"] == "verified":
        exact = p.get("exactness", {}).get("exact")
        guard = p.get("guard", {}).get("rule")
        how = ("published with it" if p.get("in_place") else "refitted after it")
        return (f"retrain from scratch matches the served version bit for bit: {exact}; "
                f"guard {guard} {how}")
    if ev["kind"] in ("rejected", "failed"):
        return str(p.get("reason"))[:80]
    return ", ".join(f"{k}={v}" for k, v in list(p.items())[:3])[:80]
