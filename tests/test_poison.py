"""Poison: nothing a producer or an HTTP client sends stops intake or earns a 5xx.

- Kafka, the red team's cases (a real tansu broker, the consumer in-process and as
  `obliviate consume`): a null value, integers of 4,301 and 401 digits, NaN and
  Infinity, JSON nested 100,000 deep, non-UTF-8, strings longer than their column
  (the 86-character `requested_at` on SQLite and PostgreSQL), a huge `op`, and a
  1,048,441-byte message whose dead-letter copy would not fit the broker's limit.
  Each is rejected with a reason, dead-lettered exactly once (cut to a prefix, with
  headers saying so, where it would not fit) and the next good message is recorded.
- A batch the database refuses for one message's sake is recorded message by
  message; a dead-letter outage mid-batch sends no dead letter twice.
- Hypothesis fuzzes the Kafka path (one consumer run over ~80 generated messages)
  and both HTTP endpoints through their ASGI apps (/v1/predict: the real BentoML
  service in-process): no crash, no stall, no 5xx, one error shape.
- Body limits: 413 on a declared or streamed body over the limit, before the body
  is read (raw ASGI, TestClient and a real uvicorn socket).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from kafka.future import Future
from sqlalchemy import text
from starlette.testclient import TestClient

from ledger import validation
from ledger.consumer import DEAD_LETTER_MAX_BYTES, RequestConsumer, ensure_topics
from ledger.intake import IncomingMessage, IntakeResult
from ledger.local_broker import LocalBroker, free_port
from ledger.store import Ledger
from service.http_api import AppContext, build_app
from service.middleware import MAX_BODY_BYTES, BodyLimit
from tests.conftest import HMAC_KEY, forget_bentoml_metrics, seed
from tests.waiting import wait_for

TOKEN = "poison-test-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
N_RECORDS = 300  # r000..r299, subjects s00.. with 3 records each, 4 features, labels 0-2
LONG_TS = "2026-11-22T10:00:00." + "1" * 60 + "+00:00"  # valid ISO 8601, 86 characters
BIG_MESSAGE = 1_048_441  # fits the producer; its dead-letter copy with headers did not


def _add_text(features: str = "0.1, 0.2, 0.3, 0.4", label: str = "0",
              rid: str = "poison-add") -> bytes:
    return (f'{{"request_id": "{rid}", "op": "add", "subject_id": "s-new", "payload": '
            f'{{"records": [{{"record_id": "n-{rid}", "features": [{features}], '
            f'"label": {label}}}]}}}}').encode()


# name -> (the message's value, a part of its rejection's reason)
POISON: dict[str, tuple[bytes | None, str]] = {
    "null-value": (None, "no value (null)"),
    "int-4301-digits": (b'{"request_id": ' + b"1" * 4301 + b', "op": "delete", '
                        b'"record_ids": ["r001"]}', "an integer of 4301 digits"),
    "feature-401-digits": (_add_text("1" * 401 + ", 0, 0, 0"), "an integer of 401 digits"),
    "nan-feature": (_add_text("NaN, 0, 0, 0"), "features[0] must be a finite number"),
    "infinity-feature": (_add_text("0, Infinity, 0, 0"), "features[1] must be a finite"),
    "infinity-label": (_add_text(label="-Infinity"), "label -inf is not one of"),
    "nested-100000": (b'{"request_id": "deep", "op": "delete", "record_ids": '
                      + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    "not-utf8": (b'{"request_id": "\xff\xfe", "op": "delete"}', "not UTF-8"),
    "long-request-id": (json.dumps({"request_id": "q" * 129, "op": "delete",
                                    "record_ids": ["r001"]}).encode(), "must be 1-128"),
    "long-subject-id": (json.dumps({"request_id": "long-subject", "op": "delete",
                                    "subject_id": "s" * 300}).encode(), "must be 1-128"),
    "long-record-id": (json.dumps({"request_id": "long-record", "op": "delete",
                                   "record_ids": ["r" * 129]}).encode(), "must be 1-128"),
    "long-new-record-id": (_add_text(rid="r" * 129), "must be 1-128"),
    "nul-in-id": (json.dumps({"request_id": "a\u0000b", "op": "delete",
                              "record_ids": ["r001"]}).encode(), "must be 1-128 printable"),
    "long-requested-at": (json.dumps({"request_id": "long-ts", "op": "delete",
                                      "record_ids": ["r001"], "requested_at": LONG_TS}
                                     ).encode(), "'requested_at' has 86 characters"),
    "huge-op": (json.dumps({"request_id": "huge-op", "op": "x" * 500_000,
                            "record_ids": ["r001"]}).encode(), "unknown op 'xxxx"),
    "oversized-dead-letter": (b"{" + b"x" * (BIG_MESSAGE - 1), "malformed JSON"),
}


# --------------------------------------------------------------------------- helpers

def make_ledger(url: str) -> Ledger:
    led = Ledger(url, HMAC_KEY, checkpoint_every=50)
    seed(led, n=N_RECORDS)
    return led


def good(tag: str, record: int) -> bytes:
    return json.dumps({"request_id": f"good-{tag}", "op": "delete",
                       "record_ids": [f"r{record:03d}"]}).encode()


def new_topics(broker: LocalBroker) -> tuple[str, str]:
    name = f"poison-{uuid.uuid4().hex[:8]}"
    ensure_topics(broker.bootstrap, [name, name + ".dead"])
    return name, name + ".dead"


def produce_raw(broker: LocalBroker, topic: str, values: list[bytes | None]) -> None:
    """In order, as they are: a None is a null value (with a key, as Kafka requires)."""
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", linger_ms=5)
    try:
        for v in values:
            producer.send(topic, value=v, key=b"null" if v is None else None)
        producer.flush(timeout=60)
    finally:
        producer.close(timeout=10)


def consume(ledger: Ledger, broker: LocalBroker, topic: str, dead: str, n: int,
            batch_size: int = 4, timeout_s: float = 90) -> RequestConsumer:
    """Run the consumer in-process until it has handled `n` messages; it must neither
    raise nor stall."""
    consumer = RequestConsumer(ledger, broker.bootstrap, topic, dead, group_id=topic,
                               batch_size=batch_size, retry_backoff_s=0.1)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while consumer.stats.messages < n and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    consumer.stop()
    thread.join(timeout=30)
    if errors:
        raise AssertionError(f"the consumer died: {errors[0]!r}") from errors[0]
    assert not thread.is_alive(), "the consumer did not stop"
    assert consumer.stats.messages == n, f"stalled: {consumer.stats.counts} of {n} messages"
    return consumer


def dead_letters(broker: LocalBroker, dead: str, expected: int,
                 timeout_s: float = 30) -> list[Any]:
    """Every record of the dead-letter topic: until `expected` are in, then a second more
    (so that one too many would show)."""
    c = KafkaConsumer(dead, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                      enable_auto_commit=False, max_partition_fetch_bytes=4 * 1_048_576,
                      fetch_max_bytes=8 * 1_048_576)
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    settle: float | None = None
    try:
        while time.monotonic() < deadline and (settle is None or time.monotonic() < settle):
            for recs in c.poll(timeout_ms=200).values():
                out.extend(recs)
            if len(out) >= expected and settle is None:
                settle = time.monotonic() + 1.0
    finally:
        c.close()
    return out


def events(ledger: Ledger) -> list[dict[str, Any]]:
    with ledger.engine.connect() as conn:
        rows = conn.execute(text("SELECT seq, request_id, kind, payload FROM events "
                                 "ORDER BY seq")).all()
    return [{"seq": r.seq, "request_id": r.request_id, "kind": r.kind,
             "payload": json.loads(r.payload)} for r in rows]


def intake_by_offset(ledger: Ledger, topic: str) -> dict[int, list[dict[str, Any]]]:
    """Kafka offset -> the received/rejected events recorded for it."""
    out: dict[int, list[dict[str, Any]]] = {}
    for e in events(ledger):
        src = e["payload"].get("source") or {}
        if e["kind"] in ("received", "rejected") and src.get("topic") == topic:
            out.setdefault(src["offset"], []).append(e)
    return out


def status_of(ledger: Ledger, request_id: str) -> str | None:
    with ledger.engine.connect() as conn:
        return conn.execute(text("SELECT status FROM requests WHERE request_id = :r"),
                            {"r": request_id}).scalar()


def letters_by_offset(letters: list[Any], topic: str) -> Counter:
    offsets: Counter = Counter()
    for rec in letters:
        source = dict(rec.headers)["source"].decode()
        assert source.startswith(f"{topic}/"), source
        offsets[int(source.rsplit("/", 1)[1])] += 1
    return offsets


# --------------------------------------------------------------------------- Kafka: cases

@pytest.fixture(scope="module")
def poisoned(broker: LocalBroker, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One consumer run over every case, each followed by a good message; batches of 4,
    so poison shares its batch with good messages."""
    topic, dead = new_topics(broker)
    ledger = make_ledger(f"sqlite:///{tmp_path_factory.mktemp('poison') / 'ledger.db'}")
    values: list[bytes | None] = []
    for i, (name, (value, _)) in enumerate(POISON.items()):
        values += [value, good(name, 100 + i)]
    produce_raw(broker, topic, values)
    consumer = consume(ledger, broker, topic, dead, len(values))
    letters = dead_letters(broker, dead, len(POISON))
    yield {"topic": topic, "ledger": ledger, "consumer": consumer, "letters": letters,
           "events": intake_by_offset(ledger, topic)}
    ledger.close()


@pytest.mark.processes
@pytest.mark.parametrize("name", list(POISON))
def test_poison_is_rejected_dead_lettered_once_and_the_next_message_recorded(
        poisoned: dict[str, Any], name: str) -> None:
    value, reason = POISON[name]
    offset = 2 * list(POISON).index(name)
    topic, ledger = poisoned["topic"], poisoned["ledger"]
    [event] = poisoned["events"][offset]
    assert event["kind"] == "rejected", event
    assert reason in event["payload"]["reason"], event["payload"]["reason"]
    assert len(event["payload"]["reason"]) <= validation.MAX_REASON_CHARS
    raw = value or b""
    assert event["payload"]["message_sha256"] == hashlib.sha256(raw).hexdigest()
    [letter] = [r for r in poisoned["letters"]
                if dict(r.headers)["source"] == f"{topic}/0/{offset}".encode()]
    headers = dict(letter.headers)
    assert reason.encode() in headers["reason"] or reason in headers["reason"].decode()
    assert headers["ledger_seq"] == str(event["seq"]).encode()
    assert headers["obliviate-sha256"] == event["payload"]["message_sha256"].encode()
    if name == "oversized-dead-letter":  # cut to fit, and says so
        assert headers["obliviate-truncated"] == str(BIG_MESSAGE).encode()
        assert 0 < len(letter.value) < BIG_MESSAGE and raw.startswith(letter.value)
        size = len(letter.value) + sum(len(k) + len(v) for k, v in letter.headers)
        assert size < DEAD_LETTER_MAX_BYTES - 256
    else:
        assert "obliviate-truncated" not in headers and letter.value == raw
    if value is None:
        assert headers["obliviate-null"]
    # the next message, a good one, was recorded
    [after] = poisoned["events"][offset + 1]
    assert after["kind"] == "received" and after["request_id"] == f"good-{name}"
    assert status_of(ledger, f"good-{name}") == "received"


@pytest.mark.processes
def test_the_poisoned_run_dead_lettered_each_rejection_exactly_once(
        poisoned: dict[str, Any]) -> None:
    assert poisoned["consumer"].stats.counts == {"rejected": len(POISON),
                                                 "accepted": len(POISON)}
    offsets = letters_by_offset(poisoned["letters"], poisoned["topic"])
    assert offsets == Counter({2 * i: 1 for i in range(len(POISON))})
    assert all(len(evs) == 1 for evs in poisoned["events"].values())


@pytest.mark.processes
def test_requested_at_longer_than_its_column_is_rejected_on_both_backends(
        broker: LocalBroker, db_url: str) -> None:
    """86 characters of valid ISO 8601: PostgreSQL's varchar(64) refused it inside the
    batch's transaction (StringDataRightTruncation) and the consumer died; SQLite took it."""
    ledger = make_ledger(db_url)
    try:
        topic, dead = new_topics(broker)
        produce_raw(broker, topic, [POISON["long-requested-at"][0], good("ts", 1)])
        consume(ledger, broker, topic, dead, 2)
        by_offset = intake_by_offset(ledger, topic)
        [rejected], [after] = by_offset[0], by_offset[1]
        assert rejected["kind"] == "rejected"
        assert "'requested_at' has 86 characters; the limit is 64" in \
            rejected["payload"]["reason"]
        assert after["kind"] == "received" and status_of(ledger, "good-ts") == "received"
        assert status_of(ledger, "long-ts") is None
        assert len(dead_letters(broker, dead, 1)) == 1
    finally:
        ledger.close()


@pytest.mark.processes
def test_obliviate_consume_survives_the_messages_that_killed_it(broker: LocalBroker,
                                                                tmp_path) -> None:
    """The red team's exits: TypeError (null, exit 1), ValueError (4,301 digits, exit 2),
    OverflowError (401 digits, then a crash loop). `obliviate consume` records them all
    and the good message after, and still runs (SIGTERM: exit 0)."""
    ledger = make_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    topic, _ = new_topics(broker)
    produce_raw(broker, topic, [POISON["null-value"][0], POISON["int-4301-digits"][0],
                                POISON["feature-401-digits"][0], good("cli", 2)])
    env = {**os.environ, "OBLIVIATE_DATABASE_URL": ledger.url,
           "OBLIVIATE_HMAC_KEY_HEX": HMAC_KEY.hex(),
           "OBLIVIATE_KAFKA_BOOTSTRAP": broker.bootstrap, "OBLIVIATE_REQUESTS_TOPIC": topic,
           "OBLIVIATE_DEAD_LETTER_TOPIC": topic + ".dead",
           "OBLIVIATE_CONSUMER_METRICS_PORT": "0"}
    log = tmp_path / "consume.log"
    with log.open("w") as err:  # a file: a full pipe would block the consumer
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "consume", "--group",
                                 topic, "--batch-size", "2"], env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    deadline = time.monotonic() + 90
    while status_of(ledger, "good-cli") is None and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # still running: it did not die on the poison
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, stdout[-2000:] + log.read_text()[-3000:]
    counts = json.loads(stdout.strip().splitlines()[-1])
    assert counts.get("rejected") == 3 and counts.get("accepted") == 1, log.read_text()[-3000:]
    assert status_of(ledger, "good-cli") == "received"
    kinds = Counter(e["kind"] for evs in intake_by_offset(ledger, topic).values() for e in evs)
    assert kinds == {"rejected": 3, "received": 1}
    ledger.close()


def test_every_text_column_intake_writes_holds_what_validation_lets_through() -> None:
    """Each length-limited column of the tables intake writes, and the longest value
    intake can put there: validated ids and times, or values the ledger makes itself."""
    from ledger.chain import iso, utc_now
    from ledger.models import REQUEST_STATUSES
    from ledger.tables import EVENTS, OFFSETS, PAYLOADS, RECORDS, REQUEST_RECORDS, REQUESTS

    ident, kafka_topic = validation.MAX_ID_LENGTH, 249  # Kafka refuses longer topic names
    longest = {
        ("requests", "request_id"): ident, ("requests", "subject_id"): ident,
        ("requests", "requested_at"): validation.MAX_TIMESTAMP_LENGTH,
        ("requests", "op"): max(map(len, validation.OPS)),
        ("requests", "source"): max(map(len, ("kafka", "http", "cli"))),
        ("requests", "source_topic"): kafka_topic,
        ("requests", "status"): max(map(len, REQUEST_STATUSES)),
        ("requests", "claimed_by"): 0,  # not written by intake
        ("events", "request_id"): ident, ("events", "kind"): len("received"),
        ("events", "model_version"): 0, ("events", "created_at"): len(iso(utc_now())),
        ("events", "prev_hash"): 64, ("events", "hash"): 64,
        ("training_records", "record_id"): ident, ("training_records", "subject_id"): ident,
        ("training_records", "record_hash"): 64, ("training_records", "state"): len("pending"),
        ("training_records", "added_by"): ident, ("training_records", "purged_by"): 0,
        ("record_payloads", "record_id"): ident, ("source_offsets", "topic"): kafka_topic,
        ("request_records", "record_id"): ident, ("request_records", "request_id"): ident,
        ("source_offsets", "topic_id"): len("01a221b3-6c10-7260-92f0-d077722d6d0a"),  # a UUID
    }
    limited = {(t.name, c.name): c.type.length for t in (REQUESTS, EVENTS, RECORDS, PAYLOADS,
                                                          OFFSETS, REQUEST_RECORDS)
               for c in t.c if getattr(c.type, "length", None)}
    assert set(limited) == set(longest), "a column was added: say what intake writes there"
    too_long = {k: (longest[k], n) for k, n in limited.items() if longest[k] > n}
    assert not too_long, too_long


# --------------------------------------------------------------------------- storing fails

@pytest.mark.processes
def test_a_batch_the_database_refuses_is_recorded_message_by_message(
        broker: LocalBroker, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What validation let through and the database refuses (PostgreSQL: a real DataError
    for a too-long requested_at, with validation's limit lifted; SQLite, which has no
    lengths: an error injected while storing one record) rejects that message only,
    once: the batch is not retried forever, its other messages are recorded."""
    ledger = make_ledger(db_url)
    try:
        if ledger.engine.dialect.name == "postgresql":
            monkeypatch.setattr(validation, "MAX_TIMESTAMP_LENGTH", 10_000)
            poison = POISON["long-requested-at"][0]
            reason = "could not be stored: StringDataRightTruncation: value too long"
        else:
            import ledger.intake as intake

            real = intake.record_fingerprint

            def fingerprint(key: bytes, record_id: str, *args: Any) -> str:
                if record_id == "n-refused":
                    raise ValueError("refused by the test")
                return real(key, record_id, *args)

            monkeypatch.setattr(intake, "record_fingerprint", fingerprint)
            poison = _add_text(rid="refused")
            reason = "could not be stored: ValueError: refused by the test"
        topic, dead = new_topics(broker)
        produce_raw(broker, topic, [good("before", 3), poison, good("after", 4)])
        consumer = consume(ledger, broker, topic, dead, 3, batch_size=10)
        assert consumer.stats.counts == {"accepted": 2, "rejected": 1}
        by_offset = intake_by_offset(ledger, topic)
        assert [e["kind"] for o in (0, 1, 2) for e in by_offset[o]] == \
            ["received", "rejected", "received"]
        assert reason in by_offset[1][0]["payload"]["reason"]
        assert "CONTEXT" not in by_offset[1][0]["payload"]["reason"]  # no quoted values
        letters = dead_letters(broker, dead, 1)
        assert letters_by_offset(letters, topic) == {1: 1}
        with ledger.engine.connect() as conn:
            nxt = conn.execute(text("SELECT next_offset FROM source_offsets")).scalar()
        assert nxt == 3
        assert ledger.verify().ok
    finally:
        ledger.close()


@pytest.mark.processes
def test_a_dead_letter_outage_mid_batch_sends_no_dead_letter_twice(
        broker: LocalBroker, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second dead letter of a batch fails (the broker went away after the first was
    sent): the batch is retried, and the first is not sent again."""
    ledger = make_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    real = RequestConsumer._send_letter
    calls = [0]

    def flaky(self: RequestConsumer, *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise KafkaTimeoutError("the test's outage")
        return real(self, *args)

    monkeypatch.setattr(RequestConsumer, "_send_letter", flaky)
    topic, dead = new_topics(broker)
    produce_raw(broker, topic, [b"{one", b"{two", good("outage", 5)])
    consumer = consume(ledger, broker, topic, dead, 3, batch_size=10)
    assert calls[0] == 3  # one, two (failed), two again: not one again
    assert consumer.stats.counts == {"rejected": 2, "accepted": 1}
    assert letters_by_offset(dead_letters(broker, dead, 2), topic) == {0: 1, 1: 1}
    assert [len(v) for v in intake_by_offset(ledger, topic).values()] == [1, 1, 1]
    ledger.close()


class _FakeProducer:
    """Refuses (as a broker with a lower max.message.bytes would) values over `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sent: list[tuple[bytes, dict[str, bytes]]] = []

    def send(self, topic: str, value: bytes, headers: list[tuple[str, bytes]]) -> Future:
        self.sent.append((value, dict(headers)))
        future = Future()
        return future.failure(MessageSizeTooLargeError()) if len(value) > self.limit \
            else future.success(None)

    def flush(self, timeout: float | None = None) -> None:
        pass


def test_a_dead_letter_the_broker_refuses_as_too_large_is_sent_shorter(tmp_path) -> None:
    consumer = RequestConsumer(None, "unused:9092", "t", "t.dead")  # type: ignore[arg-type]
    producer = _FakeProducer(limit=100_000)
    value = b"x" * 500_000
    msg = IncomingMessage(value, "kafka", "t", 0, 7)
    consumer._dead_letter(producer, [(msg, IntakeResult("rejected", None, "why", (), 9))])
    [(first, _), (second, headers)] = producer.sent
    assert len(first) == len(value)  # fits our limit: sent whole, refused by the broker
    assert 0 < len(second) <= 65_536 and value.startswith(second)
    assert headers["obliviate-truncated"] == b"500000"
    assert headers["obliviate-sha256"] == hashlib.sha256(value).hexdigest().encode()


# --------------------------------------------------------------------------- Kafka: fuzz

_RAW = "\x00raw{}\x00"  # stands for raw JSON text in a document until it is encoded
_POISON_TEXT = st.one_of(
    st.integers(129, 6000).map(lambda n: "9" * n),
    st.integers(129, 6000).map(lambda n: "-" + "1" * n),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-0", "null", "true", "[]",
                     "{}", '""', "0.5", "12"]),
    st.integers(1, 3000).map(lambda d: "[" * d + "]" * d),
    st.integers(100, 5000).map(lambda n: json.dumps("x" * n)),
    st.text(max_size=20).map(json.dumps),
    st.floats().map(json.dumps),
)
_PATHS = [("request_id",), ("op",), ("subject_id",), ("record_ids",), ("record_ids", 0),
          ("requested_at",), ("payload",), ("payload", "records"),
          ("payload", "records", 0), ("payload", "records", 0, "record_id"),
          ("payload", "records", 0, "features"), ("payload", "records", 0, "features", 2),
          ("payload", "records", 0, "label"), ("extra",)]


def _valid(i: int, kind: str) -> dict[str, Any]:
    """The i-th message of a run, valid against a fresh seeded ledger whatever came before:
    it deletes a record of its own, or adds new ones."""
    doc: dict[str, Any] = {"request_id": f"fz-{i}", "requested_at": "2026-11-22T10:00:00+00:00"}
    if kind == "add":
        doc.update(op="add", subject_id=f"new-{i}", payload={"records": [
            {"record_id": f"n-{i}", "features": [0.1, 0.2, 0.3, 0.4], "label": i % 3}]})
    else:
        doc.update(op="delete", record_ids=[f"r{i:03d}"])
    return doc


def _encode(doc: Any, raws: list[str]) -> bytes:
    out = json.dumps(doc)
    for k, raw in enumerate(raws):
        out = out.replace(json.dumps(_RAW.format(k)), raw)
    return out.encode()


def _mutate(doc: dict[str, Any], path: tuple[Any, ...], raw: str) -> bytes:
    """`doc` with the value at `path` replaced by raw JSON text (made where missing)."""
    node: Any = doc
    for step in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(step, {})
        elif isinstance(node, list) and isinstance(step, int) and step < len(node):
            node = node[step]
        else:
            break
    else:
        if isinstance(node, dict) or (isinstance(node, list) and path[-1] < len(node)):
            node[path[-1]] = _RAW.format(0)
    return _encode(doc, [raw])


@st.composite
def recipes(draw: st.DrawFn) -> tuple[str, Any]:
    """What the i-th message will be: valid, a field mutated, or poison as a whole."""
    what = draw(st.sampled_from(["valid", "mutated", "mutated", "whole"]))
    if what == "valid":
        return what, draw(st.sampled_from(["delete", "add"]))
    if what == "mutated":
        return what, (draw(st.sampled_from(["delete", "add"])), draw(st.sampled_from(_PATHS)),
                      draw(_POISON_TEXT))
    return what, draw(st.one_of(
        st.none(), st.binary(max_size=40).map(lambda b: b"\xff" + b),
        st.sampled_from([b"", b"[]", b"null", b"NaN", b'"x"', b"{", b"[" * 100_000,
                         b'{"request_id": "a"' + b" " * 200_000]),
        _POISON_TEXT.map(str.encode)))


def build(i: int, recipe: tuple[str, Any]) -> bytes | None:
    what, arg = recipe
    if what == "valid":
        return json.dumps(_valid(i, arg)).encode()
    if what == "mutated":
        kind, path, raw = arg
        return _mutate(_valid(i, kind), path, raw)
    return arg


@pytest.mark.processes
def test_fuzzed_kafka_stream_is_recorded_or_rejected_exactly_once(broker: LocalBroker,
                                                                   tmp_path) -> None:
    drawn: list[tuple[str, Any]] = []

    @settings(max_examples=80, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(recipes())
    def collect(recipe: tuple[str, Any]) -> None:
        drawn.append(recipe)

    collect()
    values = [build(i, r) for i, r in enumerate(drawn)]
    ledger = make_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    topic, dead = new_topics(broker)
    produce_raw(broker, topic, values)
    consumer = consume(ledger, broker, topic, dead, len(values), batch_size=16)
    counts = consumer.stats.counts
    by_offset = intake_by_offset(ledger, topic)
    for i, (recipe, value) in enumerate(zip(drawn, values, strict=True)):
        evs = by_offset.get(i, [])
        assert len(evs) <= 1, (i, recipe, evs)
        if recipe[0] == "valid":  # untouched messages are recorded
            assert [e["kind"] for e in evs] == ["received"], (i, value[:200], evs)
        elif evs and evs[0]["kind"] == "rejected":
            assert evs[0]["payload"]["reason"]
    recorded = sum(len(v) for v in by_offset.values())
    assert recorded + counts.get("duplicate", 0) == len(values), counts
    assert recorded == counts.get("accepted", 0) + counts.get("rejected", 0)
    rejected_offsets = {o for o, evs in by_offset.items() if evs[0]["kind"] == "rejected"}
    letters = dead_letters(broker, dead, len(rejected_offsets))
    assert letters_by_offset(letters, topic) == Counter(dict.fromkeys(rejected_offsets, 1))
    assert ledger.verify().ok
    ledger.close()


# --------------------------------------------------------------------------- HTTP

def _assert_error_shape(r: Any) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), str), r.text[:500]


@pytest.fixture(scope="module")
def intake_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    ledger = make_ledger(f"sqlite:///{tmp_path_factory.mktemp('http') / 'ledger.db'}")
    with TestClient(build_app(AppContext(ledger=ledger, admin_token=TOKEN))) as client:
        yield client
    ledger.close()


@pytest.mark.parametrize("name", ["int-4301-digits", "feature-401-digits", "nan-feature",
                                  "nested-100000", "not-utf8", "long-requested-at",
                                  "huge-op"])
def test_intake_endpoint_rejects_poison_with_a_reason(intake_app: TestClient,
                                                      name: str) -> None:
    value, reason = POISON[name]
    r = intake_app.post("/v1/requests", content=value, headers=AUTH)
    assert r.status_code == 422, r.text[:300]
    assert reason in r.json()["reason"] and r.json()["error"] == r.json()["reason"]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 10**6), recipes())
def test_fuzzed_intake_endpoint_never_answers_5xx(intake_app: TestClient, i: int,
                                                  recipe: tuple[str, Any]) -> None:
    value = build(10_000 + i, recipe)
    r = intake_app.post("/v1/requests", content=value or b"", headers=AUTH)
    _assert_error_shape(r)
    assert r.status_code in (200, 202, 400, 422), r.text[:300]


N_FEATURES = 30


@pytest.fixture(scope="module")
def predict_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The BentoML service in-process (its ASGI app, middleware included) over a ledger
    with breast_cancer and a small DaRE forest, under a model name of its own."""
    from jobs.orchestration.job_settings import JobSettings
    from jobs.orchestration.registry import Registry
    from jobs.orchestration.worker import Worker, WorkerConfig
    from ledger import datasets
    from ledger.config import LedgerSettings

    work = tmp_path_factory.mktemp("predict")
    env = {"OBLIVIATE_DATABASE_URL": f"sqlite:///{work / 'ledger.db'}",
           "OBLIVIATE_HMAC_KEY_FILE": str(work / "hmac.key"),
           "OBLIVIATE_ADMIN_TOKEN": TOKEN,
           "OBLIVIATE_MODEL_NAME": f"poison{uuid.uuid4().hex[:8]}"}
    bentoml_log = logging.getLogger("bentoml")
    level = bentoml_log.level
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        ledger = LedgerSettings.from_env().open_ledger()
        ds = datasets.load("breast_cancer", records_per_subject=3)
        ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name)
        registry = Registry(ledger.engine, JobSettings.from_env().model_name)
        Worker(ledger, registry, WorkerConfig()).bootstrap(
            "dare", {"n_estimators": 3, "max_depth": 3})
        from service.service import Obliviate

        bentoml_log.setLevel(logging.CRITICAL)  # it logs a traceback for every 4xx
        try:
            with TestClient(Obliviate.to_asgi()) as client:
                yield client
        finally:
            bentoml_log.setLevel(level)
            ledger.close()
            forget_bentoml_metrics()


def _predict(client: TestClient, body: bytes) -> Any:
    return client.post("/v1/predict", content=body,
                       headers={"Content-Type": "application/json"})


def _row(*first: str) -> str:
    return "[" + ", ".join([*first, *["0.5"] * (N_FEATURES - len(first))]) + "]"


@pytest.mark.parametrize(("row", "scaled", "expected"), [
    (_row("1" * 401), True, "row 0, feature 0: an integer of about 401 digits is outside [0, 1]"),
    (_row("0.5", "-" + "1" * 300), True,
     "row 0, feature 1: an integer of about 300 digits is outside"),
    # raw features may be any finite number (then clipped); one float() cannot hold is not
    (_row("1" * 401), False, "row 0, feature 0: an integer of about 401 digits is not finite"),
    (_row("1" * 5000), False, "Invalid JSON: number out of range"),
    (_row("NaN"), False, "row 0, feature 0: nan is not finite"),
    (_row('"' + "x" * 10_000 + '"'), False, "row 0, feature 0: 'xxxxxxxx"),
    ("[" * 100_000 + "]" * 100_000, False, "Invalid JSON: recursion limit exceeded"),
])
def test_predict_refuses_poison_with_400_and_one_error_shape(predict_app: TestClient, row: str,
                                                             scaled: bool, expected: str) -> None:
    flag = ', "scaled": true' if scaled else ""
    r = _predict(predict_app, f'{{"instances": [{row}]{flag}}}'.encode())
    assert r.status_code == 400, r.text[:300]
    body = r.json()
    assert set(body) == {"error"} and expected in body["error"], body
    assert len(body["error"]) < 300


def test_predict_still_answers_a_good_row(predict_app: TestClient) -> None:
    r = _predict(predict_app, f'{{"instances": [{_row()}, {_row("0", "1")}]}}'.encode())
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["labels"]) == 2


_FEATURE_TEXT = st.one_of(st.floats(0, 1).map(json.dumps), st.sampled_from(["0", "1"]),
                          _POISON_TEXT)


@st.composite
def predict_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["rows", "rows", "row", "other"]))
    if kind == "other":
        return draw(st.one_of(
            st.binary(max_size=60), _POISON_TEXT.map(lambda t: f'{{"instances": {t}}}'),
            _POISON_TEXT.map(str.encode),
            st.sampled_from([b"", b"{}", b'{"instances": []}', b'{"rows": [[0.5]]}'])
        ).map(lambda b: b if isinstance(b, bytes) else b.encode()))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        width = draw(st.sampled_from([N_FEATURES, N_FEATURES, N_FEATURES - 1, 0, 1]))
        cells = ["0.5"] * width
        for _ in range(draw(st.integers(0, 2)) if width else 0):
            cells[draw(st.integers(0, width - 1))] = draw(_FEATURE_TEXT)
        rows.append("[" + ", ".join(cells) + "]")
    inner = rows[0] if kind == "row" else "[" + ", ".join(rows) + "]"
    return f'{{"instances": {inner}}}'.encode()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(predict_bodies())
def test_fuzzed_predict_endpoint_never_answers_5xx(predict_app: TestClient,
                                                   body: bytes) -> None:
    r = _predict(predict_app, body)
    _assert_error_shape(r)
    assert r.status_code in (200, 400), r.text[:300]


# --------------------------------------------------------------------------- body limits

def _asgi_call(app: Any, headers: list[tuple[bytes, bytes]], chunks: Iterator[bytes],
               path: str = "/v1/requests") -> tuple[list[dict[str, Any]], int]:
    """Call an ASGI app with a body that `chunks` streams; (messages sent, chunks read)."""
    sent: list[dict[str, Any]] = []
    read = [0]

    async def receive() -> dict[str, Any]:
        read[0] += 1
        chunk = next(chunks, None)
        if chunk is None:
            raise AssertionError("the body was read past what the test would send")
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers,
             "query_string": b"", "root_path": ""}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    return sent, read[0]


async def _never_called(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app behind the limit was called")


def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    def body() -> Iterator[bytes]:
        yield b"{"
        raise AssertionError("a byte of the body was read")

    sent, read = _asgi_call(BodyLimit(_never_called),
                            [(b"content-length", str(100 * 1_048_576).encode())], body())
    assert read == 0 and sent[0]["status"] == 413
    assert json.loads(sent[1]["body"]) == {
        "error": f"request body of {100 * 1_048_576} bytes is over the limit of "
                 f"{MAX_BODY_BYTES} bytes for /v1/requests"}


def test_a_streamed_body_is_refused_at_the_chunk_that_goes_over() -> None:
    chunk = 64 * 1024
    endless = iter(lambda: b" " * chunk, None)  # a body that never ends
    sent, read = _asgi_call(BodyLimit(_never_called, limits={"/v1/predict": 10 * chunk}),
                            [], endless, path="/v1/predict")
    assert sent[0]["status"] == 413 and read == 11
    assert "over the limit of 655360 bytes for /v1/predict" in json.loads(sent[1]["body"])["error"]


def test_a_body_within_the_limit_reaches_the_app_whole() -> None:
    got: list[bytes] = []
    sent: list[dict[str, Any]] = []
    parts = iter([b"a" * 1000] * 3)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            m = await receive()
            got.append(m["body"])
            if not m["more_body"]:
                break
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        part = next(parts, b"")
        return {"type": "http.request", "body": part, "more_body": part != b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/x", "headers": [],
             "query_string": b"", "root_path": ""}
    asyncio.run(BodyLimit(app, default=3000)(scope, receive, send))
    assert sent[0]["status"] == 204 and got == [b"a" * 3000]


def test_both_endpoints_answer_413_over_their_limits(intake_app: TestClient,
                                                     predict_app: TestClient) -> None:
    from service.service import PREDICT_MAX_BODY_BYTES

    def stream(total: int) -> Iterator[bytes]:
        for _ in range(total // 65_536 + 1):
            yield b" " * 65_536

    for client, path, limit, headers in (
            (intake_app, "/v1/requests", MAX_BODY_BYTES, AUTH),
            (predict_app, "/v1/predict", PREDICT_MAX_BODY_BYTES,
             {"Content-Type": "application/json"}),
            (predict_app, "/v1/requests", MAX_BODY_BYTES, AUTH)):  # mounted under BentoML
        declared = client.post(path, content=b"{}", headers={
            **headers, "Content-Length": str(100 * 1_048_576)})
        assert declared.status_code == 413, declared.text[:300]
        assert f"over the limit of {limit} bytes" in declared.json()["error"]
        streamed = client.post(path, content=stream(limit + 1), headers=headers)
        assert streamed.status_code == 413, streamed.text[:300]
        assert set(streamed.json()) == {"error"}
    # at the limit: read and answered on its merits (not JSON, so a rejection)
    at_limit = intake_app.post("/v1/requests", content=b" " * MAX_BODY_BYTES, headers=AUTH)
    assert at_limit.status_code == 422 and "malformed JSON" in at_limit.json()["reason"]


def test_a_real_server_answers_413_before_the_body_arrives(tmp_path) -> None:
    """Over a socket: headers declaring 100 MB and 10 bytes of body get 413 at once."""
    import uvicorn

    ledger = make_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(AppContext(ledger=ledger,
                                                                admin_token=TOKEN)),
                                           host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 10, "the server to start", interval_s=0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"POST /v1/requests HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{TOKEN}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {100 * 1_048_576}\r\n\r\n".encode() + b"0123456789")
            t0 = time.monotonic()
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                part = s.recv(65_536)
                if not part:
                    break
                answer += part
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert time.monotonic() - t0 < 3
        assert b'"error"' in answer
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        ledger.close()
