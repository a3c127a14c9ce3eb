"""Sending requests to the requests topic, and the mixed stream the demo and tests use.

Messages are keyed by subject so that, with several partitions, one person's
requests stay in order on one partition.
See docs/operations.md (Kafka)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from kafka import KafkaProducer

Message = dict[str, Any] | bytes


def encode(message: Message) -> bytes:
    return message if isinstance(message, bytes) else json.dumps(message).encode()


def produce(bootstrap: str, topic: str, messages: Iterable[Message],
            on_sent: Callable[[int], None] | None = None) -> int:
    """Send messages in order and wait until the broker has them all; returns the count."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=10,
                             batch_size=256 * 1024, client_id="obliviate-producer")
    n = 0
    try:
        for m in messages:
            key = m.get("subject_id") if isinstance(m, dict) else None
            producer.send(topic, value=encode(m), key=None if key is None else str(key).encode())
            n += 1
            if on_sent is not None:
                on_sent(n)
        producer.flush(timeout=60)
    finally:
        producer.close(timeout=10)
    return n


def paced(messages: Iterable[Message], per_second: float) -> Iterator[Message]:
    """Yield messages at a steady rate (a production system's stream, not a burst)."""
    t0 = time.monotonic()
    for i, m in enumerate(messages):
        delay = t0 + i / per_second - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield m


_MALFORMED: list[bytes] = [
    b"{not json",
    b'{"op": "delete", "record_ids": ["r1"]}',
    b'{"request_id": "bad-op", "op": "forget", "record_ids": ["r1"]}',
    b'["a", "list"]',
    b'{"request_id": "", "op": "delete", "record_ids": ["r1"]}',
]


def request_stream(record_ids: list[str], subject_ids: list[str], n_features: int,
                   classes: list[int], n: int, random_state: int = 0,
                   add_fraction: float = 0.1, subject_fraction: float = 0.1,
                   duplicate_fraction: float = 0.02, invalid_fraction: float = 0.03,
                   prefix: str = "req",
                   feature_ranges: Sequence[tuple[float, float]] | None = None
                   ) -> Iterator[Message]:
    """A realistic mix: record and subject deletions, additions, resends and garbage.

    Each record is deleted at most once, so every well-formed, non-duplicate
    deletion in the stream is valid against the record store it was drawn from.
    Additions carry raw features drawn inside `feature_ranges` (each feature's (min,
    max) in the ledger's input transform), as a client would send them; without
    ranges, features in [0, 1] marked ``"scaled": true``.
    """
    rng = np.random.default_rng(random_state)
    lo = hi = None
    if feature_ranges is not None:
        lo, hi = (np.array(b, dtype=np.float64) for b in zip(*feature_ranges, strict=True))
    order = list(rng.permutation(len(record_ids)))
    deleted_subjects: set[str] = set()
    deleted_records: set[str] = set()
    by_subject: dict[str, list[str]] = {}
    for r, s in zip(record_ids, subject_ids, strict=True):
        by_subject.setdefault(s, []).append(r)
    sent: list[dict[str, Any]] = []
    for i in range(n):
        u = rng.random()
        if sent and u < duplicate_fraction:
            yield sent[int(rng.integers(len(sent)))]
            continue
        u -= duplicate_fraction
        if u < invalid_fraction:
            yield _MALFORMED[int(rng.integers(len(_MALFORMED)))]
            continue
        u -= invalid_fraction
        rid = f"{prefix}-{random_state}-{i:06d}"
        if u < add_fraction:
            unit = rng.random(n_features)
            payload: dict[str, Any] = {"records": [{
                "record_id": f"rec-{rid}", "label": int(rng.choice(classes)),
                "features": (unit.round(6) if lo is None else
                             (lo + unit * (hi - lo)).round(6)).tolist()}]}
            if lo is None:
                payload["scaled"] = True
            msg: dict[str, Any] = {"request_id": rid, "op": "add",
                                   "subject_id": f"new-{rid}", "payload": payload}
        else:
            while order and (record_ids[order[-1]] in deleted_records
                             or subject_ids[order[-1]] in deleted_subjects):
                order.pop()
            if not order:
                return
            j = order.pop()
            if u - add_fraction < subject_fraction:
                subject = subject_ids[j]
                deleted_subjects.add(subject)
                deleted_records.update(by_subject[subject])
                msg = {"request_id": rid, "op": "delete", "subject_id": subject}
            else:
                deleted_records.add(record_ids[j])
                msg = {"request_id": rid, "op": "delete", "record_ids": [record_ids[j]]}
        sent.append(msg)
        yield msg
