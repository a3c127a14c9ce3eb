"""Kafka intake: requests topic -> ledger, with dead letters for what cannot be accepted.

Delivery is at-least-once and the effect exactly-once: a batch is recorded in one
transaction with each partition's next offset, dead letters flushed before it commits, and
only then is offset+1 committed to Kafka. No message stops the consumer. The 6 s session
timeout keeps group joins on tansu short. A log that starts again is read from its start.
See docs/ledger.md (Intake)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    TopicAlreadyExistsError,
)
from kafka.producer.future import FutureRecordMetadata
from kafka.structs import OffsetAndMetadata

from ledger import intake_metrics as metrics
from ledger.intake import IncomingMessage, IntakeResult, message_bytes
from ledger.store import Ledger

log = logging.getLogger("obliviate.consumer")

# The largest record the dead-letter producer sends: kafka-python's max_request_size
# default, and within a stock broker's message.max.bytes (1 MiB + 12 bytes).
DEAD_LETTER_MAX_BYTES = 1_048_576
# If the broker refuses a copy as too large all the same (a topic with a lower
# max.message.bytes), it is sent again cut to these sizes in turn.
_SMALLER_LETTERS = (65_536, 0)
# Room for what a record adds to its value and headers: the batch header (61 bytes),
# the record's and each header's length varints, with plenty to spare.
_RECORD_OVERHEAD = 512
_MAX_REASON_BYTES = 4096
_FLUSH_TIMEOUT_S = 30.0
LetterKey = tuple[str | None, int | None, int | None]
# how long the first contact with the broker may take before the command gives up
# (kafka-python waits 30 s, then raises a traceback's worth of KafkaTimeoutError)
BOOTSTRAP_TIMEOUT_S = 5.0


class BrokerUnreachable(ConnectionError):
    """No Kafka broker answered at the bootstrap address: the message names it and the
    setting that gives it."""


def ensure_topics(bootstrap: str, topics: list[str], partitions: int = 1,
                  configs: dict[str, dict[str, str]] | None = None,
                  timeout_s: float = BOOTSTRAP_TIMEOUT_S) -> None:
    """Create the topics if they do not exist yet (with `configs[topic]` when given; an
    existing topic keeps its own settings). BrokerUnreachable after `timeout_s` without
    an answer: this is every command's first contact with the broker."""
    configs = configs or {}
    kafka_log = logging.getLogger("kafka")
    level = kafka_log.level
    kafka_log.setLevel(logging.CRITICAL)  # its retries are said below, in one line
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="obliviate-admin",
                                 bootstrap_timeout_ms=int(timeout_s * 1000))
    except KafkaError as exc:
        raise BrokerUnreachable(
            f"cannot reach a Kafka broker at {bootstrap} (no answer in {timeout_s:g} s: "
            f"{type(exc).__name__}); check --bootstrap or OBLIVIATE_KAFKA_BOOTSTRAP and that "
            "the broker is running") from None
    finally:
        kafka_log.setLevel(level)
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


class LogResetWatch:
    """Notices a partition whose log started again below what the ledger recorded from it.

    tansu's in-memory log is empty after a restart, and tansu answers a fetch past its end
    with no records rather than OFFSET_OUT_OF_RANGE, so auto_offset_reset never fires: a
    topic id other than the one the ledger recorded the partition's offset under (the
    topic was made again), or a high watermark below the recorded next offset, says so
    instead. Both come with fetches and metadata: checking costs nothing. The recorded
    ids also catch a log that restarted while no consumer ran and has grown past the old
    end since.
    """

    def __init__(self, topic: str, next_offsets: dict[int, int],
                 topic_ids: dict[int, str]) -> None:
        self.topic = topic
        self.next_offsets = dict(next_offsets)  # partition -> next offset recorded
        self.topic_ids = dict(topic_ids)  # partition -> the topic id it was recorded under
        self.now_id: str | None = None  # the topic id in the consumer's metadata

    def recorded(self, partition: int, next_offset: int) -> None:
        """A batch was recorded from the log the last check saw (its id went with it)."""
        self.next_offsets[partition] = next_offset
        if self.now_id is not None:
            self.topic_ids[partition] = self.now_id

    def refresh(self, next_offsets: dict[int, int], topic_ids: dict[int, str]) -> None:
        """The ledger's offsets as they are now: another consumer of the group may have
        recorded a partition, or read its log again, since this one last held it."""
        self.next_offsets = dict(next_offsets)
        self.topic_ids = dict(topic_ids)

    def read_again(self, starts: dict[TopicPartition, int]) -> None:
        """The restarted partitions are read again from `starts`: the new log is the one
        to watch now."""
        for tp, start in starts.items():
            self.recorded(tp.partition, start)

    def restarted(self, consumer: KafkaConsumer) -> dict[TopicPartition, str]:
        """The assigned partitions whose log started again, each with why it is thought so."""
        assigned = [tp for tp in consumer.assignment() if tp.topic == self.topic]
        self.now_id = topic_id(consumer, self.topic) or self.now_id
        out = {}
        for tp in assigned:
            was = self.topic_ids.get(tp.partition)
            if was is None and self.now_id is not None and tp.partition in self.next_offsets:
                was = self.topic_ids[tp.partition] = self.now_id  # a ledger before ids
            if was is not None and self.now_id is not None and was != self.now_id:
                out[tp] = f"topic id changed from {was} to {self.now_id}"
                continue
            end, recorded = consumer.highwater(tp), self.next_offsets.get(tp.partition, 0)
            if end is not None and end < recorded:
                out[tp] = f"log ends at offset {end}, below the recorded {recorded}"
        return out


def topic_id(consumer: KafkaConsumer, topic: str) -> str | None:
    """The topic id of `topic` in the consumer's metadata, or None where this kafka-python
    does not keep one: it keeps them on its client, nowhere public (its 3.x series, pinned
    in pyproject.toml and checked by a test); without it the end-offset check remains."""
    cluster = getattr(getattr(consumer, "_client", None), "cluster", None)
    lookup = getattr(cluster, "topic_id", None)
    found = lookup(topic) if callable(lookup) else None
    return None if found is None else str(found)


class RequestConsumer:
    """Consumes the requests topic into the ledger until stopped (or idle)."""

    def __init__(self, ledger: Ledger, bootstrap: str, topic: str, dead_letter_topic: str,
                 group_id: str = "obliviate-ledger", batch_size: int = 500,
                 poll_timeout_ms: int = 200, session_timeout_ms: int = 6000,
                 heartbeat_interval_ms: int = 1000, retry_backoff_s: float = 1.0,
                 fetch_max_wait_ms: int = 50,
                 dead_letter_max_bytes: int = DEAD_LETTER_MAX_BYTES) -> None:
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
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self.stats = ConsumerStats()
        # dead letters sent for messages the ledger has not recorded yet (a retried batch
        # reuses them instead of sending duplicates)
        self._letters: dict[LetterKey, FutureRecordMetadata] = {}
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
                                 max_request_size=self.dead_letter_max_bytes,
                                 client_id="obliviate-dead-letters")
        watch = LogResetWatch(self.topic, self.ledger.intake.next_offsets(self.topic),
                              self.ledger.intake.topic_ids(self.topic))
        last_message = time.monotonic()
        try:
            while not self._stop.is_set():
                self.ledger.heads.maybe_sign()  # an idle tail gets its signed head too
                polled = consumer.poll(timeout_ms=self.poll_timeout_ms,
                                       max_records=self.batch_size)
                restarted = watch.restarted(consumer)
                if restarted:  # confirmed against the ledger, not this consumer's memory
                    watch.refresh(self.ledger.intake.next_offsets(self.topic),
                                  self.ledger.intake.topic_ids(self.topic))
                    restarted = watch.restarted(consumer)
                if restarted:  # what was polled may lie past a gap: read it all again
                    self._rewind(consumer, polled)  # the other partitions' records too
                    self._read_again(consumer, watch, restarted)
                    continue
                if not polled:
                    if idle_timeout_s is not None and \
                            time.monotonic() - last_message > idle_timeout_s:
                        break
                    continue
                last_message = time.monotonic()
                results = self._process(consumer, producer, polled, watch.now_id)
                if results is not None:
                    for tp, recs in polled.items():
                        watch.recorded(tp.partition, recs[-1].offset + 1)
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

    def _read_again(self, consumer: KafkaConsumer, watch: LogResetWatch,
                    restarted: dict[TopicPartition, str]) -> None:
        """Seek each restarted partition to its new beginning and lower the ledger's
        offset to it (a `source_reset` event): intake knows a request read twice by its id."""
        try:
            starts = consumer.beginning_offsets(list(restarted), timeout_ms=5000)
        except KafkaError as exc:  # the broker is not back yet: the next poll tries again
            log.warning("cannot read the restarted log's beginning (%s); retrying", exc)
            time.sleep(self.retry_backoff_s)
            return
        for tp, start in starts.items():
            self.ledger.intake.restart_source(tp.topic, tp.partition, start, restarted[tp],
                                              watch.now_id)
            log.warning("%s/%d started again (%s): reading it from offset %d", tp.topic,
                        tp.partition, restarted[tp], start)
            metrics.LOG_RESETS.inc()
            consumer.seek(tp, start)
            self._recorded[tp] = OffsetAndMetadata(start, "", -1)
        watch.read_again(starts)

    def _process(self, consumer: KafkaConsumer, producer: KafkaProducer,
                 polled: dict[TopicPartition, list[Any]], log_id: str | None
                 ) -> list[IntakeResult] | None:
        """Record a polled batch (from the log whose topic id is `log_id`, the one the
        reset check just saw) in one ledger transaction, dead-letter what it rejected and
        commit the offsets; None when the ledger could not take it (retried)."""
        msgs = [IncomingMessage(rec.value, "kafka", rec.topic, rec.partition, rec.offset,
                                log_id)
                for recs in polled.values() for rec in recs]

        def dead_letter(pairs: list[tuple[IncomingMessage, IntakeResult]]) -> None:
            self._dead_letter(producer, pairs)
            metrics.DEAD_LETTERS.inc(len(pairs))

        try:
            results = self.ledger.intake.receive_batch(msgs, before_commit=dead_letter)
        except KafkaError as exc:  # dead letters not flushed: nothing was recorded
            log.warning("dead-letter topic unavailable (%s); retrying the batch", exc)
            self._rewind(consumer, polled)
            time.sleep(self.retry_backoff_s)
            return None
        for m in msgs:  # recorded now: a redelivery is skipped by offset, not dead-lettered
            self._letters.pop((m.topic, m.partition, m.offset), None)
        # The ledger already holds the batch and its offsets, so the Kafka commit need
        # not block the next poll: if it is lost, the redelivery is recognised by offset.
        recorded = {tp: OffsetAndMetadata(recs[-1].offset + 1, "", -1)
                    for tp, recs in polled.items()}
        self._recorded.update(recorded)
        consumer.commit_async(recorded, callback=_log_commit_failure)
        return results

    def _dead_letter(self, producer: KafkaProducer,
                     pairs: list[tuple[IncomingMessage, IntakeResult]]) -> None:
        """Deliver a copy of each rejected message, or raise a KafkaError.

        A copy delivered (or still in flight) from an earlier try of the same batch is
        not sent again; one the broker refuses as too large is sent again shorter.
        """
        todo = pairs
        for cap in (self.dead_letter_max_bytes, *_SMALLER_LETTERS):
            for m, r in todo:
                key = (m.topic, m.partition, m.offset)
                future = self._letters.get(key)
                if future is None or future.failed():  # a failed send delivered nothing
                    self._letters[key] = self._send_letter(producer, m, r, cap)
            producer.flush(timeout=_FLUSH_TIMEOUT_S)
            todo = [(m, r) for m, r in todo if _too_large(self._letters[(m.topic, m.partition,
                                                                         m.offset)])]
            if not todo:
                break
        for m, _ in pairs:
            future = self._letters[(m.topic, m.partition, m.offset)]
            if not future.is_done:
                raise KafkaTimeoutError(f"dead letters not acknowledged in {_FLUSH_TIMEOUT_S} s")
            if future.failed():
                raise future.exception

    def _send_letter(self, producer: KafkaProducer, m: IncomingMessage, r: IntakeResult,
                     cap: int) -> FutureRecordMetadata:
        """Send the copy of `m`, cut to a prefix if the whole would make a record over `cap`."""
        value = message_bytes(m.value)
        reason = (r.reason or "").encode("utf-8", "replace")
        if len(reason) > _MAX_REASON_BYTES:
            reason = reason[:_MAX_REASON_BYTES].decode("utf-8", "ignore").encode()
        headers = [("reason", reason),
                   ("source", f"{m.topic}/{m.partition}/{m.offset}".encode()),
                   ("ledger_seq", str(r.seq).encode()),
                   ("obliviate-sha256", hashlib.sha256(value).hexdigest().encode())]
        if m.value is None:
            headers.append(("obliviate-null", b"the message's value was null"))
        room = cap - _RECORD_OVERHEAD - sum(len(k) + len(v) for k, v in headers) - 64
        if len(value) > room:
            headers.append(("obliviate-truncated", str(len(value)).encode()))
            value = value[:max(room, 0)]
            log.warning("dead letter of %s/%s/%s cut from %s to %d bytes", m.topic, m.partition,
                        m.offset, headers[-1][1].decode(), len(value))
        try:
            return producer.send(self.dead_letter_topic, value=value, headers=headers)
        except MessageSizeTooLargeError:  # the estimate above fell short: headers only
            if not value:
                raise
            return self._send_letter(producer, m, r, 0)

    @staticmethod
    def _rewind(consumer: KafkaConsumer, polled: dict[TopicPartition, list[Any]]) -> None:
        for tp, recs in polled.items():
            consumer.seek(tp, recs[0].offset)


def _too_large(future: FutureRecordMetadata) -> bool:
    return future.failed() and isinstance(future.exception,
                                          MessageSizeTooLargeError | RecordListTooLargeError)


def _log_commit_failure(offsets: dict[TopicPartition, OffsetAndMetadata],
                        response: object) -> None:
    if isinstance(response, Exception):
        log.warning("offset commit failed (%s); the ledger holds the batch", response)
