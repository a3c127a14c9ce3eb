"""The client side of `make test-deploy`, run inside the sidecar's image on the host network.

Streams deletions and additions through the broker at a steady rate while asking both
service replicas for predictions, then waits until every request it sent is verified and
prints one JSON summary: sent, lost, doubled, resent, and the answers that were unsound.
Resending what the ledger never received is the producer's at-least-once contract.
See docs/operations.md (Testing the deployment).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from datetime import UTC, datetime
from typing import Any

import httpx
from kafka import KafkaProducer
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from ledger.config import LedgerSettings
from ledger.producer import encode, request_stream

# a replica swaps to a new version within its poll (0.1 s) plus the load; an answer from a
# version superseded by a deletion longer ago than this is unsound
SWAP_ALLOWANCE_S = 5.0


def _producer(bootstrap: str) -> KafkaProducer:
    """A producer, retried while the broker is down (it is, during one of the faults)."""
    while True:
        try:
            return KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                                 retries=5, request_timeout_ms=5000, max_block_ms=5000)
        except Exception:  # noqa: BLE001 - NoBrokersAvailable and friends: wait, retry
            time.sleep(0.5)


class Sender:
    """Sends messages at least once: a send the broker did not acknowledge is sent again."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.producer = _producer(bootstrap)
        self.acked: dict[str, dict[str, Any]] = {}
        self.resent = 0

    def send(self, msg: dict[str, Any]) -> None:
        while True:
            try:
                self.producer.send(self.topic, value=encode(msg),
                                   key=str(msg.get("subject_id", "")).encode()).get(timeout=10)
                self.acked[msg["request_id"]] = msg
                return
            except Exception:  # noqa: BLE001 - broker gone: a new connection, then again
                self.resent += 1
                with contextlib.suppress(Exception):
                    self.producer.close(timeout=1)
                time.sleep(0.5)
                self.producer = _producer(self.bootstrap)


def ask(urls: list[str], row: list[float], stop: threading.Event,
        answers: list[dict[str, Any]]) -> None:
    """Predictions, alternating replicas, every 0.2 s, until stopped."""
    with httpx.Client(timeout=10) as client:
        i = 0
        while not stop.is_set():
            url = urls[i % len(urls)]
            i += 1
            t0 = time.time()
            try:
                r = client.post(f"{url}/v1/predict", json={"instances": [row], "scaled": True})
                body = r.json() if r.headers.get("content-type", "").startswith(
                    "application/json") else {}
                answers.append({"url": url, "t0": t0, "t1": time.time(), "status": r.status_code,
                                "version": body.get("model_version"), "guard": body.get("guard")})
            except httpx.HTTPError as exc:
                answers.append({"url": url, "t0": t0, "t1": time.time(), "status": 0,
                                "error": type(exc).__name__})
            time.sleep(0.2)


def unsound(conn: Any, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Answers from a version never published, published after the answer, or superseded
    by a deletion more than SWAP_ALLOWANCE_S before the question; or unguarded."""
    rows = conn.execute(text(
        "SELECT v.version, v.created_at, s.created_at FROM model_versions v "
        "LEFT JOIN model_versions s ON s.name = v.name "
        "AND s.version = v.superseded_by_deletion")).all()
    versions = {v: (c.timestamp(), s.timestamp() if s else None) for v, c, s in rows}
    bad = []
    for a in answers:
        if a["status"] != 200:
            continue
        pub = versions.get(a["version"])
        if (pub is None or pub[0] > a["t1"] or a["guard"] == "off"
                or (pub[1] is not None and pub[1] < a["t0"] - SWAP_ALLOWANCE_S)):
            bad.append(a)
    return bad


def settle(conn_factory: Any, acked: dict[str, dict[str, Any]], sender: Sender,
           timeout_s: float) -> dict[str, Any]:
    """Wait until every acknowledged request is verified; resend what the ledger never got
    (a broker that lost it) after 20 s. Counts what is still missing or doubled."""
    deadline = time.monotonic() + timeout_s
    resend_at = time.monotonic() + 20
    ids = list(acked)
    while True:
        try:
            with conn_factory() as conn:
                status = dict(conn.execute(text(
                    "SELECT request_id, status FROM requests WHERE request_id = ANY(:ids)"),
                    {"ids": ids}).all())
                applied = conn.execute(text(
                    "SELECT request_id, count(*) FROM events WHERE request_id = ANY(:ids) "
                    "AND kind IN ('received', 'applied') GROUP BY request_id, kind "
                    "HAVING count(*) > 1"), {"ids": ids}).all()
        except OperationalError:  # the database restarting (one of the faults): again
            time.sleep(1)
            continue
        missing = [i for i in ids if i not in status]
        waiting = [i for i in ids if status.get(i) not in ("verified", "failed")]
        if not waiting or time.monotonic() > deadline:
            break
        if missing and time.monotonic() > resend_at:
            for i in missing:
                sender.send(acked[i])
            resend_at = time.monotonic() + 20
        time.sleep(1)
    return {"acked": len(ids), "lost": len(missing), "unfinished": len(waiting),
            "failed": sum(1 for s in status.values() if s == "failed"),
            "doubled": len(applied)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prefix", required=True)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--rate", type=float, default=4)
    p.add_argument("--services", default="http://127.0.0.1:13000,http://127.0.0.1:13001")
    p.add_argument("--settle", type=float, default=240)
    args = p.parse_args()
    s = LedgerSettings.from_env()
    ledger = s.open_ledger(False)
    schema = ledger.records.schema()
    live = ledger.records.live()
    stream = request_stream(list(live.record_ids), list(live.subject_ids), schema.n_features,
                            schema.classes, 100_000, random_state=abs(hash(args.prefix)) % 997,
                            add_fraction=0.3, duplicate_fraction=0.0, invalid_fraction=0.0,
                            prefix=args.prefix,
                            feature_ranges=None if schema.input_transform.columns else list(
                                zip(schema.input_transform.mins, schema.input_transform.maxs,
                                    strict=True)))
    answers: list[dict[str, Any]] = []
    stop = threading.Event()
    asker = threading.Thread(target=ask, args=(args.services.split(","),
                                               [float(v) for v in live.X[0]], stop, answers))
    asker.start()
    sender = Sender(s.kafka_bootstrap, s.requests_topic)
    print("streaming", flush=True)  # the check injects its fault after this line
    t0 = time.monotonic()
    for i, msg in enumerate(stream):
        delay = t0 + i / args.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if time.monotonic() - t0 > args.seconds:
            break
        sender.send(msg)
    sent_s = time.monotonic() - t0
    summary = settle(ledger.engine.connect, dict(sender.acked), sender, args.settle)
    stop.set()
    asker.join()
    with ledger.engine.connect() as conn:
        bad = unsound(conn, answers)
    summary.update(prefix=args.prefix, sent_s=round(sent_s, 1), resent=sender.resent,
                   settled_s=round(time.monotonic() - t0 - sent_s, 1),
                   answers=len(answers), answers_ok=sum(a["status"] == 200 for a in answers),
                   answers_unsound=len(bad), unsound_examples=bad[:3],
                   at=datetime.now(UTC).isoformat())
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
