"""Kafka intake: requests topic -> ledger, with dead letters for what cannot be accepted.

Delivery is at-least-once and the effect exactly-once: a batch is recorded in
one database transaction together with each partition's next offset, the
dead-letter copies are flushed before that transaction commits, and only then
is offset+1 committed to Kafka. A message seen again after a crash is
recognised by its offset (or its request_id) and has no second effect.

Group joins: tansu holds a JoinGroup for about half the session timeout
(kafka-python's default of 45 s made joins take ~23 s). The default here is
6 s, the smallest a stock Kafka broker accepts, so a join takes ~3 s; a dead
consumer's partitions are also handed on sooner.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from ledger import metrics
from ledger.store import IncomingMessage, IntakeResult, Ledger

log = logging.getLogger("obliviate.consumer")


def ensure_topics(bootstrap: str, topics: list[str], partitions: int = 1,
                  configs: dict[str, dict[str, str]] | None = None) -> None:
    """Create the topics if they do not exist yet (with `configs[topic]` when given; an
    existing topic keeps its own settings)."""
    configs = configs or {}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="obliviate-admin")
    try:
        existing = set(admin.list_topics())
        new = [NewTopic(t, partitions, 1, topic_configs=configs.get(t, {}))
               for t in topics if t not in existing]
        if new:
            with contextlib.suppress(TopicAlreadyExistsError):  # a racing creator won
                admin.create_topics(new)
    finally:
        admin.close()


@dataclass
class ConsumerStats:
    batches: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, results: list[IntakeResult]) -> None:
        self.batches += 1
        for r in results:
            self.counts[r.status] = self.counts.get(r.status, 0) + 1

    @property
    def messages(self) -> int:
        return sum(self.counts.values())


class RequestConsumer:
    """Consumes the requests topic into the ledger until stopped (or idle)."""

    def __init__(self, ledger: Ledger, bootstrap: str, topic: str, dead_letter_topic: str,
                 group_id: str = "obliviate-ledger", batch_size: int = 500,
                 poll_timeout_ms: int = 200, session_timeout_ms: int = 6000,
                 heartbeat_interval_ms: int = 1000, retry_backoff_s: float = 1.0,
                 fetch_max_wait_ms: int = 50) -> None:
        self.ledger = ledger
        self.bootstrap = bootstrap
        self.topic = topic
        self.dead_letter_topic = dead_letter_topic
        self.group_id = group_id
        self.batch_size = batch_size
        self.poll_timeout_ms = poll_timeout_ms
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.retry_backoff_s = retry_backoff_s
        # tansu answered fetches late with kafka-python's 500 ms: at 50/s a request waited
        # 0.13 s at the median from produce to ledger, 0.03 s with 50 ms (bench_e2e.py)
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.stats = ConsumerStats()
        self._stop = threading.Event()
        self._recorded: dict[TopicPartition, OffsetAndMetadata] = {}

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand, commit it and return."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def run(self, idle_timeout_s: float | None = None,
            on_batch: Callable[[list[IntakeResult]], None] | None = None) -> ConsumerStats:
        """Consume until `stop()`, a signal, or `idle_timeout_s` without messages."""
        consumer = KafkaConsumer(
            self.topic, bootstrap_servers=self.bootstrap, group_id=self.group_id,
            enable_auto_commit=False, auto_offset_reset="earliest",
            max_poll_records=self.batch_size, session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            fetch_max_wait_ms=self.fetch_max_wait_ms, client_id="obliviate-consumer")
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5,
                                 client_id="obliviate-dead-letters")
        last_message = time.monotonic()
        try:
            while not self._stop.is_set():
                polled = consumer.poll(timeout_ms=self.poll_timeout_ms,
                                       max_records=self.batch_size)
                if not polled:
                    if idle_timeout_s is not None and \
                            time.monotonic() - last_message > idle_timeout_s:
                        break
                    continue
                last_message = time.monotonic()
                results = self._process(consumer, producer, polled)
                if results is not None:
                    self.stats.add(results)
                    if on_batch is not None:
                        on_batch(results)
        finally:
            try:  # commit exactly what the ledger recorded, never the mere read position
                if self._recorded:
                    consumer.commit(dict(self._recorded), timeout_ms=5000)
            except KafkaError as exc:
                log.warning("final offset commit failed (%s); the ledger holds the batches", exc)
            consumer.close(autocommit=False)
            producer.close(timeout=5)
        return self.stats

    def _process(self, consumer: KafkaConsumer, producer: KafkaProducer,
                 polled: dict[TopicPartition, list[Any]]) -> list[IntakeResult] | None:
        msgs = [IncomingMessage(rec.value, "kafka", rec.topic, rec.partition, rec.offset)
                for recs in polled.values() for rec in recs]

        def dead_letter(pairs: list[tuple[IncomingMessage, IntakeResult]]) -> None:
            for m, r in pairs:
                producer.send(self.dead_letter_topic, value=m.value, headers=[
                    ("reason", (r.reason or "").encode()),
                    ("source", f"{m.topic}/{m.partition}/{m.offset}".encode()),
                    ("ledger_seq", str(r.seq).encode())])
            producer.flush(timeout=30)
            metrics.DEAD_LETTERS.inc(len(pairs))

        try:
            results = self.ledger.receive_batch(msgs, before_commit=dead_letter)
        except KafkaError as exc:  # dead letters not flushed: nothing was recorded
            log.warning("dead-letter topic unavailable (%s); retrying the batch", exc)
            self._rewind(consumer, polled)
            time.sleep(self.retry_backoff_s)
            return None
        # The ledger already holds the batch and its offsets, so the Kafka commit need
        # not block the next poll: if it is lost, the redelivery is recognised by offset.
        recorded = {tp: OffsetAndMetadata(recs[-1].offset + 1, "", -1)
                    for tp, recs in polled.items()}
        self._recorded.update(recorded)
        consumer.commit_async(recorded, callback=_log_commit_failure)
        return results

    @staticmethod
    def _rewind(consumer: KafkaConsumer, polled: dict[TopicPartition, list[Any]]) -> None:
        for tp, recs in polled.items():
            consumer.seek(tp, recs[0].offset)


def _log_commit_failure(offsets: dict[TopicPartition, OffsetAndMetadata],
                        response: object) -> None:
    if isinstance(response, Exception):
        log.warning("offset commit failed (%s); the ledger holds the batch", response)
