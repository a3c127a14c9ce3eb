"""The end-to-end measurement bench_e2e.py and bench_scale.py's e2e stage share: deletions
produced to Kafka at a steady rate against the real processes, a watcher of the served
version, a client asking for guarded answers all along, each process tree's peak RSS,
then what the ledger's events and the worker's log say (latency produced -> served,
lost, duplicated, where a worker pass's time goes).
See docs/benchmarks.md (bench_e2e: deletion latency end to end)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ledger.producer import paced, produce
from ledger.store import Ledger
from service.demo.processes import LocalSidecar

SETTLED = ("applied", "verified", "failed")
PUBLISHED = re.compile(r"published v\d+ \(update; saved in ([\d.]+) s, committed in ([\d.]+) s")


def watch_versions(base: str, stop: threading.Event, first_served: dict[int, float]) -> None:
    """Poll /v1/models every 20 ms; note when each version is first served."""
    with httpx.Client(base_url=base, timeout=5.0) as http:
        while not stop.is_set():
            try:
                cur = http.get("/v1/models").json()["serving"]["version"]
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                cur = None
            if cur:
                first_served.setdefault(int(cur.lstrip("v")), time.time())
            stop.wait(0.02)


def guard_counts(base: str) -> tuple[float, float]:
    """(certain, noised) answers so far, from the service's metrics."""
    text = httpx.get(f"{base}/metrics", timeout=120).text  # a loaded machine is slow
    out = {"certain": 0.0, "noised": 0.0}
    for line in text.splitlines():
        if line.startswith("obliviate_guard_queries_total{"):
            for k in out:
                if f'outcome="{k}"' in line:
                    out[k] += float(line.rsplit(" ", 1)[1])
    return out["certain"], out["noised"]


def ask(base: str, rows: Sequence[Any], scaled: bool, stop: threading.Event,
        answers: Counter[str]) -> None:
    """Predictions all along: batches of 20 of `rows` (lists pre-scaled when `scaled`,
    else raw rows, objects keyed by column name included); `answers` tallies the HTTP
    statuses (a stream of 4xx would leave the certified shares empty)."""
    rng = np.random.default_rng(1)
    with httpx.Client(base_url=base, timeout=30.0) as http:
        while not stop.is_set():
            batch = [rows[i] for i in rng.integers(len(rows), size=20)]
            try:
                r = http.post("/v1/predict", json={"instances": batch, "scaled": scaled})
                answers[str(r.status_code)] += 1
            except httpx.HTTPError as exc:
                answers[type(exc).__name__] += 1
            stop.wait(0.05)


def wait_for_line(path: Path, text: str, timeout_s: float) -> float:
    """Seconds until `text` appears in the log at `path` (at most `timeout_s`): e.g. the
    worker's "started", once it has loaded the version and compiled its kernels."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if path.exists() and text in path.read_text(errors="replace"):
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def wait_for_guard(registry: Any, timeout_s: float, bounds: bool = False) -> float:
    """Seconds until the current version owes no guard refit (at most `timeout_s`): a
    version `model train` published before its guard answers every query noised, which
    would make the idle phase measure the wait, not the guard. `bounds`: until its bounds
    are complete too (SISA's shard bounds arrive one guard job at a time)."""
    from jobs.orchestration.served_model import guard_owed

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        current = registry.current()
        if current is not None and not guard_owed(current.manifest) and (
                not bounds or (current.manifest["guard"].get("bound") or {}).get("complete")):
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The share of answers certain between two guard_counts."""
    certain, noised = after[0] - before[0], after[1] - before[1]
    return certain / max(certain + noised, 1.0)


def tree_hwm_mb(pid: int) -> float:
    """VmHWM (peak RSS) of `pid` and its descendants, summed, in MB (0 once it is gone)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
    return total


class PeakRSS:
    """Samples each named process tree's peak RSS every second while they run (BentoML
    and the guard job have child processes: each tree counts as its process's)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.peak_mb = pids, dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            for name, pid in self.pids.items():
                self.peak_mb[name] = max(self.peak_mb[name], tree_hwm_mb(pid))
            if self._stop.wait(1.0):
                return

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Stream:
    """What one stream left: produce and first-served times, the guard's counters."""

    produced: dict[str, float] = field(default_factory=dict)  # request id -> time sent
    first_served: dict[int, float] = field(default_factory=dict)  # version -> time
    idle: tuple[float, float] = (0.0, 0.0)  # guard_counts before the idle phase
    start: tuple[float, float] = (0.0, 0.0)  # ... when the stream starts
    end: tuple[float, float] = (0.0, 0.0)  # ... when the last deletion is produced
    ready_s: float = 0.0  # what `ready` waited
    answers: Counter[str] = field(default_factory=Counter)  # /v1/predict: status -> count

    @property
    def certified_idle(self) -> float:
        return share(self.idle, self.start)

    @property
    def certified_stream(self) -> float:
        return share(self.start, self.end)


def run_stream(sidecar: LocalSidecar, ledger: Ledger, current_seq: Callable[[], int],
               bootstrap: str, topic: str, messages: list[dict[str, Any]], rate: float,
               rows: Sequence[Any], scaled: bool, idle_s: float = 20.0,
               ready: Callable[[], float] = lambda: 0.0, drain_s: float = 120.0) -> Stream:
    """Ask for answers idle for `idle_s` (after `ready()`), then produce `messages` at
    `rate` per second, and wait (at most `drain_s` after the last) until every request is
    settled and the service serves the version that applied the last of them."""
    out, stop, asking = Stream(), threading.Event(), threading.Event()
    base = sidecar.base_url
    watcher = threading.Thread(target=watch_versions, args=(base, stop, out.first_served))
    client = threading.Thread(target=ask, args=(base, rows, scaled, asking, out.answers))
    watcher.start()
    client.start()
    try:
        out.ready_s = ready()
        out.idle = guard_counts(base)
        time.sleep(idle_s)
        out.start = guard_counts(base)

        def on_sent(k: int) -> None:
            out.produced[messages[k - 1]["request_id"]] = time.time()

        produce(bootstrap, topic, paced(messages, rate), on_sent)
        out.end = guard_counts(base)
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and not sidecar.dead():
            counts = ledger.lifecycle.status_counts()
            if sum(counts.get(k, 0) for k in SETTLED) >= len(messages):
                break
            time.sleep(0.2)
        end = time.monotonic() + 60
        while time.monotonic() < end and max(out.first_served, default=0) < current_seq():
            time.sleep(0.1)
    finally:
        asking.set()
        client.join()
        stop.set()
        watcher.join()
    return out


def _timestamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["created_at"]).timestamp()


def analyse(events: Iterable[dict[str, Any]], stream: Stream, tag: str,
            worker_log: Path | None = None) -> dict[str, Any]:
    """Latencies, lost (never recorded), unsettled (recorded, not applied) and duplicated
    requests and the worker's passes, from the ledger's events; prints the p50 of each
    stage and of each part of a pass."""
    applied: dict[str, list[int]] = {}
    at: dict[tuple[str, str], float] = {}
    passes: dict[str, list[float]] = {}  # version -> [requests, update s, guard s, time]
    swaps = 0
    for e in events:
        if e["kind"] == "applied":
            swaps += sum(bool(d.get("swap")) for d in
                         e["payload"].get("retrained", {}).get("detail", []))
            applied.setdefault(e["request_id"], []).append(int(e["model_version"][1:]))
            p = passes.setdefault(e["model_version"], [0, e["payload"].get("update_seconds", 0),
                                                       e["payload"].get("guard_seconds", 0),
                                                       _timestamp(e)])
            p[0] += 1
        if e["kind"] in ("received", "applied") and e["request_id"]:
            at.setdefault((e["kind"], e["request_id"]), _timestamp(e))
    latencies, stages = [], []
    for rid, t_produced in stream.produced.items():
        first = applied.get(rid, [float("inf")])[0]
        served = [t for seq, t in stream.first_served.items() if seq >= first]
        if served:
            latencies.append(min(served) - t_produced)
            stages.append((at[("received", rid)] - t_produced,
                           at[("applied", rid)] - at[("received", rid)],
                           min(served) - at[("applied", rid)]))
    if stages:
        med = np.median(np.array(stages), axis=0)
        print(f"{tag} p50 by stage: produced->recorded {med[0]:.3f} s, recorded->applied "
              f"{med[1]:.3f} s, applied->served {med[2]:.3f} s", flush=True)
    # a request recorded but not yet served when the bench stopped counts as served
    # never (inf): percentiles over the settled alone would flatter a run that ends
    # with a backlog
    waiting = sum(1 for rid in stream.produced if ("received", rid) in at) - len(latencies)
    every = latencies + [float("inf")] * waiting
    q = (np.quantile(every, [0.5, 0.95], method="inverted_cdf") if every
         else [float("nan")] * 2)
    return {"p50_s": float(q[0]), "p95_s": float(q[1]),
            # lost: never recorded by the ledger; unsettled: recorded, not applied by the
            # end of the drain window (still in the worker's hands, not lost)
            "lost": sum(1 for rid in stream.produced if ("received", rid) not in at),
            "unsettled": sum(1 for rid in stream.produced
                             if ("received", rid) in at and rid not in applied),
            "duplicated": sum(1 for v in applied.values() if len(v) > 1),
            "measured": len(latencies), "swaps": swaps,
            **pass_profile(list(passes.values()), tag, worker_log)}


def pass_profile(passes: list[list[float]], tag: str, worker_log: Path | None) -> dict[str, Any]:
    """The p50 worker pass: requests, the learner's update, the guard's update, saving
    and committing the version (from the worker's log), and the time between two
    publications (the whole pass, or the wait for requests when the worker keeps up)."""
    if not passes:
        return {"passes": 0}
    arr = np.array(sorted(passes, key=lambda p: p[3]))
    saved = [tuple(map(float, m.groups())) for m in
             PUBLISHED.finditer(worker_log.read_text() if worker_log else "")]
    save, commit = np.median(np.array(saved), axis=0) if saved else (float("nan"),) * 2
    interval = float(np.median(np.diff(arr[:, 3]))) if len(arr) > 1 else float("nan")
    med = np.median(arr[:, :3], axis=0)
    print(f"{tag} {len(arr)} passes; p50 per pass: {med[0]:.0f} requests, update "
          f"{med[1]:.3f} s, guard {med[2]:.3f} s, save {save:.3f} s, commit {commit:.3f} s; "
          f"{interval:.3f} s between publications", flush=True)
    return {"passes": len(arr), "pass_requests": float(med[0]), "update_s": float(med[1]),
            "guard_s": float(med[2]), "save_s": float(save), "commit_s": float(commit),
            "pass_interval_s": interval}
