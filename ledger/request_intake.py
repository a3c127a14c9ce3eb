"""Recording incoming requests: one transaction per batch, one effect per message.

:class:`ledger.intake.BatchIntake` decides what becomes of each message; this component
runs it in a transaction, isolates a message the database refuses, and counts what intake
made of every message (the metrics and the demo read them). See docs/ledger.md (Intake)."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Sequence

from sqlalchemy import Engine, func, select, update

from ledger import intake_metrics as metrics
from ledger.appender import ChainAppender
from ledger.chain import iso, utc_now
from ledger.db import writing
from ledger.error_text import first_line
from ledger.intake import (
    BatchIntake,
    IncomingMessage,
    IntakeResult,
    RejectHook,
    Unstorable,
    caused_by_input,
    message_bytes,
    parse_message,
)
from ledger.record_store import RecordStore
from ledger.sealed_payloads import PayloadSealer
from ledger.tables import EVENTS, OFFSETS, REQUESTS
from ledger.tree_heads import TreeHeads
from ledger.validation import InvalidRequest, RequestMessage

log = logging.getLogger("obliviate.ledger")


class RequestIntake:
    """Validates and records requests from Kafka, HTTP and the command line."""

    def __init__(self, engine: Engine, hmac_key: bytes, sealer: PayloadSealer,
                 records: RecordStore, heads: TreeHeads) -> None:
        self.engine = engine
        self._key = hmac_key
        self._sealer = sealer
        self._records = records
        self._heads = heads

    def receive_batch(self, messages: Sequence[IncomingMessage],
                      before_commit: RejectHook | None = None) -> list[IntakeResult]:
        """Validate and record a batch in ONE transaction; idempotent on request_id.

        Kafka messages below the partition's recorded offset are redeliveries (the
        consumer died after this transaction but before its Kafka commit) and are
        skipped, so every message has exactly one effect. `before_commit` gets the
        rejected messages while the transaction is still open: if it raises (the
        dead-letter topic is down), nothing is recorded and the batch can be retried.

        No input makes this raise: a message that cannot be parsed is rejected, and
        a batch the database refuses for a reason of one message's making (a
        DataError, say, for what validation let through) is recorded again message
        by message, the one it fails on rejected with the error's first line.
        Errors of the database itself (OperationalError) and of `before_commit` do
        propagate, with nothing recorded.
        """
        schema = self._records.schema()
        parsed = [parse_message(m.value, schema) for m in messages]
        results = self._record_batch(messages, parsed, before_commit)
        for (op, status), n in Counter((r.op or "unknown", r.status) for r in results).items():
            metrics.REQUESTS.labels(op=op, status=status).inc(n)
        return results

    def counts(self) -> dict[str, int]:
        """What intake made of every message: accepted requests (by op), resends of an
        accepted request id (duplicates) and rejected messages."""
        with self.engine.connect() as conn:
            ops = dict(conn.execute(select(REQUESTS.c.op, func.count()).group_by(REQUESTS.c.op))
                       .all())
            dups = conn.execute(select(func.coalesce(func.sum(REQUESTS.c.duplicate_count), 0))
                                ).scalar()
            rejected = conn.execute(select(func.count()).select_from(EVENTS)
                                    .where(EVENTS.c.kind == "rejected")).scalar()
        return {"accepted": sum(ops.values()), "deletions": ops.get("delete", 0),
                "additions": ops.get("add", 0), "duplicates": int(dups),
                "rejected": int(rejected)}

    def consumed(self, topic: str) -> int:
        """Kafka messages of `topic` recorded so far (sum of the partitions' next offsets)."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.coalesce(func.sum(OFFSETS.c.next_offset), 0))
                                    .where(OFFSETS.c.topic == topic)).scalar())

    def next_offsets(self, topic: str) -> dict[int, int]:
        """Each partition's next offset to record from `topic`: what a new log must reach."""
        with self.engine.connect() as conn:
            return dict(conn.execute(select(OFFSETS.c.partition, OFFSETS.c.next_offset)
                                     .where(OFFSETS.c.topic == topic)).all())

    def topic_ids(self, topic: str) -> dict[int, str]:
        """Each partition's topic id as recorded with its offset (none before the first
        batch, or from a ledger older than migration 0008)."""
        with self.engine.connect() as conn:
            return dict(conn.execute(select(OFFSETS.c.partition, OFFSETS.c.topic_id)
                                     .where(OFFSETS.c.topic == topic,
                                            OFFSETS.c.topic_id.is_not(None))).all())

    def restart_source(self, topic: str, partition: int, next_offset: int,
                       reason: str, topic_id: str | None = None) -> int | None:
        """The partition's log started again below what was recorded (a broker that lost
        it): lower its next offset to `next_offset`, so the new log's messages are not
        skipped as redeliveries, with a `source_reset` event that `verify` follows; the
        new log's `topic_id` is recorded with it. Returns the event's seq, or None when
        nothing recorded was above `next_offset` (the topic id is recorded all the same)."""
        with writing(self.engine) as conn:
            where = (OFFSETS.c.topic == topic, OFFSETS.c.partition == partition)
            old = conn.execute(select(OFFSETS.c.next_offset).where(*where)).scalar()
            if old is None:
                return None
            ids = {} if topic_id is None else {"topic_id": topic_id}
            if old <= next_offset:
                if ids:
                    conn.execute(update(OFFSETS).where(*where).values(**ids))
                return None
            appender = ChainAppender(conn)
            seq = appender.append("source_reset", None, {
                "source": {"kind": "kafka", "topic": topic, "partition": partition},
                "next_offset": next_offset, "previous_next_offset": old, "reason": reason,
                **ids,
            }, iso(utc_now()))
            appender.flush(conn)
            conn.execute(update(OFFSETS).where(*where).values(next_offset=next_offset, **ids))
            self._heads.take_if_due(conn, seq)
        return seq

    def _record_batch(self, messages: Sequence[IncomingMessage],
                      parsed: list[RequestMessage | InvalidRequest],
                      before_commit: RejectHook | None) -> list[IntakeResult]:
        try:
            return self._write_batch(messages, parsed, before_commit)
        except Unstorable as exc:
            if len(messages) > 1:  # isolate the message: one transaction each
                log.warning("a batch of %d could not be stored (%s); recording it message "
                            "by message", len(messages), exc.reason)
                return [r for m, p in zip(messages, parsed, strict=True)
                        for r in self._record_batch([m], [p], before_commit)]
            if isinstance(parsed[0], InvalidRequest):  # not even its rejection: not input
                raise exc.__cause__ from None  # type: ignore[misc]
            # no request id in a log line (personal data): the digest finds its event
            log.warning("a message (sha256 %s) could not be stored (%s); rejected",
                        hashlib.sha256(message_bytes(messages[0].value)).hexdigest()[:16],
                        exc.reason)
            refused = InvalidRequest(f"could not be stored: {exc.reason}", parsed[0].request_id)
            return self._record_batch(messages, [refused], before_commit)

    def _write_batch(self, messages: Sequence[IncomingMessage],
                     parsed: list[RequestMessage | InvalidRequest],
                     before_commit: RejectHook | None) -> list[IntakeResult]:
        with writing(self.engine) as conn:
            now = utc_now()  # read under the lock, so event times follow seq order
            now_s = iso(now)
            try:
                intake = BatchIntake(self._key, conn, parsed, now, now_s, sealer=self._sealer)
                results = [intake.handle(m, p) for m, p in zip(messages, parsed, strict=True)]
                intake.write(conn)
            except Exception as exc:
                if caused_by_input(exc, self.engine.dialect.dbapi):
                    raise Unstorable(first_line(exc)) from exc
                raise
            self._heads.take_if_due(conn, intake.appender.seq)
            rejected = [(m, r) for m, r in zip(messages, results, strict=True)
                        if r.status == "rejected"]
            if rejected and before_commit is not None:
                before_commit(rejected)
        return results
