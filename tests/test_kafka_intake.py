"""Kafka intake against a real tansu broker: exactly-once effect, dead letters, crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient
from prometheus_client import REGISTRY
from sqlalchemy import text

from ledger.consumer import RequestConsumer, topic_id
from ledger.local_broker import LocalBroker
from ledger.producer import produce, request_stream
from ledger.store import Ledger
from tests.conftest import HMAC_KEY, seed

# a real tansu broker, and consumers killed as processes
pytestmark = pytest.mark.processes

N_RECORDS = 3000


def make_ledger(tmp_path) -> Ledger:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}", HMAC_KEY, checkpoint_every=50)
    seed(led, n=N_RECORDS)
    return led


def stream(n: int, seed_: int = 1) -> list:
    ids = [f"r{i:03d}" for i in range(N_RECORDS)]
    subjects = [f"s{i // 3:02d}" for i in range(N_RECORDS)]
    messages = list(request_stream(ids, subjects, 4, [0, 1, 2], n, random_state=seed_))
    assert len(messages) == n
    return messages


def expected_counts(messages: list) -> Counter:
    """Oracle: first sight of a dict is accepted, a repeat is a duplicate, bytes are rejected."""
    seen: set[str] = set()
    out: Counter = Counter()
    for m in messages:
        if isinstance(m, bytes):
            out["rejected"] += 1
        elif m["request_id"] in seen:
            out["duplicate"] += 1
        else:
            seen.add(m["request_id"])
            out["accepted"] += 1
    return out


def consume_until(consumer: RequestConsumer, n: int, timeout_s: float = 60) -> None:
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while consumer.stats.messages < n and time.monotonic() < deadline:
        time.sleep(0.05)
    consumer.stop()
    thread.join(timeout=30)
    assert not thread.is_alive(), "consumer did not stop"


def dead_letters(broker: LocalBroker, topic: str, n: int) -> list:
    c = KafkaConsumer(topic, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                      consumer_timeout_ms=3000, enable_auto_commit=False)
    out = []
    for rec in c:
        out.append(rec)
        if len(out) >= n:
            break
    c.close()
    return out


def event_counts(ledger: Ledger) -> Counter:
    return Counter(e["kind"] for e in ledger.events.export())


def test_stream_is_recorded_once_and_rejects_are_dead_lettered(broker, topics, tmp_path) -> None:
    topic, dead = topics
    ledger = make_ledger(tmp_path)
    messages = stream(200)
    expected = expected_counts(messages)
    produce(broker.bootstrap, topic, messages)
    consumer = RequestConsumer(ledger, broker.bootstrap, topic, dead, group_id=topic,
                               batch_size=64)
    consume_until(consumer, len(messages))
    assert consumer.stats.counts == dict(expected)
    kinds = event_counts(ledger)
    assert kinds["received"] == expected["accepted"]
    assert kinds["rejected"] == expected["rejected"]
    letters = dead_letters(broker, dead, expected["rejected"])
    assert len(letters) == expected["rejected"]
    for rec in letters:
        headers = dict(rec.headers)
        assert headers["reason"] and headers["source"].startswith(topic.encode())
    assert ledger.verify().ok


def _malformed() -> st.SearchStrategy[bytes]:
    """Messages that are invalid by construction, of every kind the validator knows."""
    junk = st.binary(max_size=64).map(lambda b: b"\x00" + b)
    no_id = st.dictionaries(st.sampled_from(["op", "record_ids", "subject_id"]),
                            st.text(max_size=5), max_size=3).map(json.dumps)
    bad_op = st.text(max_size=8).filter(lambda s: s not in ("add", "delete")).map(
        lambda op: json.dumps({"request_id": "x", "op": op, "record_ids": ["r001"]}))
    unknown = st.text(min_size=1, max_size=8).filter(lambda s: not s.startswith("r")).map(
        lambda r: json.dumps({"request_id": f"u-{r}", "op": "delete", "record_ids": [r]}))
    bad_add = st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=8).filter(
        lambda f: len(f) != 4).map(lambda f: json.dumps({
            "request_id": "a", "op": "add", "subject_id": "s",
            "payload": {"records": [{"record_id": "n", "features": f, "label": 0}]}}))
    texts = st.one_of(no_id, bad_op, unknown, bad_add).map(str.encode)
    return st.one_of(junk, texts)


def test_thousands_of_fuzzed_messages_are_dead_lettered(broker, topics, tmp_path) -> None:
    collected: list[bytes] = []

    @settings(max_examples=2000, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(_malformed())
    def collect(m: bytes) -> None:
        collected.append(m)

    collect()
    topic, dead = topics
    ledger = make_ledger(tmp_path)
    valid = {"request_id": "after-the-storm", "op": "delete", "record_ids": ["r001"]}
    produce(broker.bootstrap, topic, [*collected, valid])
    consumer = RequestConsumer(ledger, broker.bootstrap, topic, dead, group_id=topic)
    consume_until(consumer, len(collected) + 1, timeout_s=120)
    assert consumer.stats.counts == {"rejected": len(collected), "accepted": 1}
    assert event_counts(ledger)["rejected"] == len(collected)
    assert len(dead_letters(broker, dead, len(collected))) == len(collected)
    assert ledger.history("after-the-storm")["request"]["status"] == "received"


def _consumer_process(db: str, broker: LocalBroker, topic: str) -> subprocess.Popen:
    env = {**os.environ, "OBLIVIATE_DATABASE_URL": db, "OBLIVIATE_HMAC_KEY_HEX": HMAC_KEY.hex(),
           "OBLIVIATE_KAFKA_BOOTSTRAP": broker.bootstrap, "OBLIVIATE_REQUESTS_TOPIC": topic,
           "OBLIVIATE_DEAD_LETTER_TOPIC": topic + ".dead"}
    return subprocess.Popen([sys.executable, "-m", "service.cli", "consume", "--group", topic,
                             "--batch-size", "25"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _received(ledger: Ledger) -> int:
    with ledger.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM events WHERE kind IN "
                                 "('received', 'rejected')")).scalar()


def test_sigkill_mid_stream_then_restart_loses_and_repeats_nothing(broker, topics,
                                                                   tmp_path) -> None:
    topic, _ = topics
    ledger = make_ledger(tmp_path)
    messages = stream(2500, seed_=3)
    expected = expected_counts(messages)
    total = expected["accepted"] + expected["rejected"]
    # the second part is produced only after the kill, so the kill lands mid-stream even
    # when a busy machine lets the consumer run far ahead of this process's polling
    produce(broker.bootstrap, topic, messages[:1500])

    first = _consumer_process(ledger.url, broker, topic)
    deadline = time.monotonic() + 120
    while _received(ledger) < 200 and time.monotonic() < deadline:
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    at_kill = _received(ledger)
    assert 0 < at_kill < total, "the kill should land mid-stream"
    produce(broker.bootstrap, topic, messages[1500:])

    second = _consumer_process(ledger.url, broker, topic)
    deadline = time.monotonic() + 90
    while _received(ledger) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    second.send_signal(signal.SIGTERM)
    out, _ = second.communicate(timeout=30)
    assert second.returncode == 0, out  # graceful stop

    per_request = Counter(e["request_id"] for e in ledger.events.export()
                          if e["kind"] == "received")
    accepted_ids = {m["request_id"] for m in messages if isinstance(m, dict)}
    assert set(per_request) == accepted_ids, "a request was lost"
    assert max(per_request.values()) == 1, "a request was recorded twice"
    assert event_counts(ledger)["rejected"] == expected["rejected"]
    with ledger.engine.connect() as conn:
        next_offset = conn.execute(text("SELECT next_offset FROM source_offsets")).scalar()
    assert next_offset == len(messages)
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    committed = admin.list_group_offsets(topic)
    admin.close()
    assert [o.offset for o in committed[topic].values()] == [len(messages)]
    assert ledger.verify().ok


def test_consumer_survives_a_broker_that_goes_away(tmp_path) -> None:
    ledger = make_ledger(tmp_path)
    with LocalBroker() as own:
        from ledger.consumer import ensure_topics
        ensure_topics(own.bootstrap, ["req", "req.dead"])
        produce(own.bootstrap, "req", stream(50))
        consumer = RequestConsumer(ledger, own.bootstrap, "req", "req.dead", group_id="g")
        errors: list[BaseException] = []

        def run() -> None:
            try:
                consumer.run()
            except BaseException as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while consumer.stats.messages < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        own.stop()
        time.sleep(3)
        assert thread.is_alive() and not errors, errors
        consumer.stop()
        thread.join(timeout=30)
        assert not thread.is_alive() and not errors, errors
    assert consumer.stats.messages == 50
    assert ledger.verify().ok



def test_the_kafka_client_keeps_the_topic_ids_the_reset_watch_reads(broker, topics) -> None:
    """LogResetWatch reads topic ids off kafka-python's client (nowhere public): this
    fails, rather than the watch going half-blind, on a kafka-python that moved them."""
    c = KafkaConsumer(topics[0], bootstrap_servers=broker.bootstrap,
                      enable_auto_commit=False, consumer_timeout_ms=500)
    try:
        c.poll(timeout_ms=1000)
        assert topic_id(c, topics[0]) not in (None, "")
    finally:
        c.close()


def _requests(n_before: int) -> tuple[list, list]:
    """Distinct valid requests, split in those sent before the broker's crash and after."""
    firsts: dict = {}
    for m in stream(160, seed_=5):
        if isinstance(m, dict):
            firsts.setdefault(m["request_id"], m)
    ordered = list(firsts.values())
    return ordered[:n_before], ordered[n_before:]


def _run_until(consumer: RequestConsumer, n: int, timeout_s: float = 30) -> threading.Thread:
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    wait_for_messages(consumer, n, timeout_s)
    return thread


def wait_for_messages(consumer: RequestConsumer, n: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while consumer.stats.messages < n and time.monotonic() < deadline:
        time.sleep(0.05)


def _each_once(ledger: Ledger, requests: list) -> None:
    received = Counter(e["request_id"] for e in ledger.events.export()
                       if e["kind"] == "received")
    ids = {m["request_id"] for m in requests}
    assert set(received) == ids, f"lost: {sorted(ids - set(received))}"
    assert max(received.values()) == 1, "a request was recorded twice"
    assert event_counts(ledger)["source_reset"] == 1
    assert ledger.verify().ok


def test_broker_killed_under_a_running_consumer_loses_and_doubles_nothing(tmp_path) -> None:
    """tansu's in-memory log starts again at offset 0 after a crash, below the consumer's
    position and the ledger's recorded offset: what is produced after it is still taken."""
    from ledger.consumer import ensure_topics

    ledger = make_ledger(tmp_path)
    before, after = _requests(60)
    resets = REGISTRY.get_sample_value("obliviate_consumer_log_resets_total") or 0
    own = LocalBroker()
    try:
        ensure_topics(own.start().bootstrap, ["req", "req.dead"])
        produce(own.bootstrap, "req", before)
        consumer = RequestConsumer(ledger, own.bootstrap, "req", "req.dead", group_id="g")
        thread = _run_until(consumer, len(before))
        assert consumer.stats.messages == len(before)
        own.kill()
        ensure_topics(own.start().bootstrap, ["req", "req.dead"], timeout_s=15)  # same port
        produce(own.bootstrap, "req", after[:20])  # below the old end: offsets 0..19
        produce(own.bootstrap, "req", after[20:])  # then past it
        wait_for_messages(consumer, len(before) + len(after))
        consumer.stop()
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        own.stop()
    # what was fetched from the new log before its new topic id was seen is read again:
    # the ledger knows those requests and answers `duplicate` (on a loaded machine only)
    assert consumer.stats.counts["accepted"] == len(before) + len(after)
    assert set(consumer.stats.counts) <= {"accepted", "duplicate"}
    _each_once(ledger, before + after)
    assert REGISTRY.get_sample_value("obliviate_consumer_log_resets_total") == resets + 1


def test_consumer_started_after_the_new_log_grew_past_the_old_end_reads_it_all(
        tmp_path) -> None:
    """The broker lost its log while no consumer ran, and the new log has grown past the
    offset the ledger recorded: its end says nothing, the topic id recorded with the
    offsets does; the new log is read from its beginning, not from the old offset."""
    from ledger.consumer import ensure_topics

    ledger = make_ledger(tmp_path)
    before, after = _requests(40)
    assert len(after) > len(before) + 10
    own = LocalBroker()
    try:
        ensure_topics(own.start().bootstrap, ["req", "req.dead"])
        produce(own.bootstrap, "req", before)
        consume_until(RequestConsumer(ledger, own.bootstrap, "req", "req.dead",
                                      group_id="g"), len(before))
        old_id = ledger.intake.topic_ids("req")
        assert old_id and old_id[0]
        own.kill()
        ensure_topics(own.start().bootstrap, ["req", "req.dead"], timeout_s=15)
        produce(own.bootstrap, "req", after)  # past offset 40 before anyone reads it
        consumer = RequestConsumer(ledger, own.bootstrap, "req", "req.dead", group_id="g")
        consume_until(consumer, len(after))
    finally:
        own.stop()
    assert consumer.stats.counts == {"accepted": len(after)}
    _each_once(ledger, before + after)
    assert ledger.intake.topic_ids("req")[0] != old_id[0]  # the new log's, recorded
    assert ledger.intake.next_offsets("req") == {0: len(after)}


def test_consumer_started_on_a_restarted_broker_reads_its_new_log(tmp_path) -> None:
    """The broker lost its log while no consumer ran: a new consumer finds the log's end
    below the ledger's recorded offset (no topic id to compare) and reads it all."""
    from ledger.consumer import ensure_topics

    ledger = make_ledger(tmp_path)
    before, after = _requests(60)
    own = LocalBroker()
    try:
        ensure_topics(own.start().bootstrap, ["req", "req.dead"])
        produce(own.bootstrap, "req", before)
        consumer = RequestConsumer(ledger, own.bootstrap, "req", "req.dead", group_id="g")
        consume_until(consumer, len(before))
        own.kill()
        ensure_topics(own.start().bootstrap, ["req", "req.dead"], timeout_s=15)
        produce(own.bootstrap, "req", after[:30])
        consumer = RequestConsumer(ledger, own.bootstrap, "req", "req.dead", group_id="g")
        consume_until(consumer, len(after[:30]))
    finally:
        own.stop()
    assert consumer.stats.counts == {"accepted": 30}
    _each_once(ledger, before + after[:30])
