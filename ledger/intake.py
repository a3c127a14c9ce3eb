"""Intake: what becomes of each incoming message, checked against the store in one batch.

A message is parsed (`parse_message`), then :class:`BatchIntake` resolves each
request against what the store holds -- duplicates, unknown or already-deleted records,
subjects expanded to their records, Kafka offsets already taken -- and writes the
requests, records and events of the batch in the caller's transaction.
See docs/ledger.md (Intake)."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

from ledger.appender import ChainAppender
from ledger.chain import canonical_json, record_fingerprint
from ledger.db import among, insert_rows
from ledger.error_text import first_line
from ledger.models import DatasetSchema
from ledger.sealed_payloads import PayloadSealer
from ledger.tables import LOOKUP_CHUNK, OFFSETS, RECORDS, REQUEST_RECORDS, REQUESTS, SEALED
from ledger.validation import InvalidRequest, RequestMessage, parse_request

log = logging.getLogger("obliviate.ledger")


@dataclass(frozen=True)
class IncomingMessage:
    """A raw request as it arrived, with where it came from (a Kafka value may be null)."""

    value: bytes | str | dict[str, Any] | None
    source: Literal["kafka", "http", "cli"] = "http"
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    topic_id: str | None = None  # the log's (Kafka's topic id), recorded with the offset

    def source_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"kind": self.source}
        if self.topic is not None:
            info.update(topic=self.topic, partition=self.partition, offset=self.offset)
        return info


@dataclass(frozen=True)
class IntakeResult:
    """What happened to one incoming message."""

    status: Literal["accepted", "duplicate", "rejected", "redelivered"]
    request_id: str | None
    reason: str | None = None
    record_ids: tuple[str, ...] = ()
    seq: int | None = None
    op: str | None = None

    @property
    def http_status(self) -> int:
        return {"accepted": 202, "duplicate": 200, "rejected": 422, "redelivered": 200}[self.status]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["record_ids"] = list(self.record_ids)
        return d


RejectHook = Callable[[list[tuple[IncomingMessage, IntakeResult]]], None]


class BatchIntake:
    """The database half of validating one batch: duplicates, unknown ids, expansion."""

    def __init__(self, hmac_key: bytes, conn: Connection,
                 parsed: Sequence[RequestMessage | InvalidRequest], now: datetime,
                 now_s: str, *, sealer: PayloadSealer) -> None:
        """An addition's data is sealed under a key of its own (`sealer`), put in the key
        store before the batch's transaction commits."""
        self.key, self.now, self.now_s = hmac_key, now, now_s
        self.conn, self.sealer = conn, sealer
        self.appender = ChainAppender(conn)
        self.request_rows: list[dict[str, Any]] = []
        self.request_record_rows: list[dict[str, Any]] = []
        self.record_rows: list[dict[str, Any]] = []
        self.payload_rows: list[dict[str, Any]] = []
        self.duplicates: list[str] = []
        self.offsets: dict[tuple[str, int], int] = {}
        self.next_offset: dict[tuple[str, int], int] = {}
        self.topic_ids: dict[tuple[str, int], str] = {}
        valid = [p for p in parsed if isinstance(p, RequestMessage)]
        ids = list({p.request_id for p in valid})
        self.seen: set[str] = set()
        for i in range(0, len(ids), LOOKUP_CHUNK):
            self.seen.update(conn.execute(select(REQUESTS.c.request_id).where(
                among(conn, REQUESTS.c.request_id, ids[i:i + LOOKUP_CHUNK]))).scalars())
        # record id -> (subject, state) for every record the batch names or expands to
        self.records: dict[str, tuple[str | None, str]] = {}
        rec_ids = list({r for p in valid for r in (p.record_ids or ())})
        subjects = list({p.subject_id for p in valid if p.op == "delete" and p.subject_id})
        cols = (RECORDS.c.record_id, RECORDS.c.subject_id, RECORDS.c.state)
        for i in range(0, len(rec_ids), LOOKUP_CHUNK):
            for r in conn.execute(select(*cols).where(
                    among(conn, RECORDS.c.record_id, rec_ids[i:i + LOOKUP_CHUNK]))):
                self.records[r.record_id] = (r.subject_id, r.state)
        self.by_subject: dict[str, list[str]] = {}
        for i in range(0, len(subjects), LOOKUP_CHUNK):
            for r in conn.execute(select(*cols).where(
                    among(conn, RECORDS.c.subject_id, subjects[i:i + LOOKUP_CHUNK]))):
                self.records[r.record_id] = (r.subject_id, r.state)
                self.by_subject.setdefault(r.subject_id, []).append(r.record_id)
        self._load_offsets(conn)

    def _load_offsets(self, conn: Connection) -> None:
        for r in conn.execute(select(OFFSETS)):
            self.offsets[(r.topic, r.partition)] = r.next_offset

    def handle(self, msg: IncomingMessage, p: RequestMessage | InvalidRequest) -> IntakeResult:
        if msg.topic is not None:
            key = (msg.topic, int(msg.partition or 0))
            if msg.offset is not None and msg.offset < self.offsets.get(key, 0):
                return IntakeResult("redelivered", getattr(p, "request_id", None))
            if msg.offset is not None:
                self.next_offset[key] = max(self.next_offset.get(key, 0), msg.offset + 1)
                if msg.topic_id is not None:
                    self.topic_ids[key] = msg.topic_id
        if isinstance(p, InvalidRequest):
            return self._reject(msg, p.request_id, p.reason, None)
        if p.request_id in self.seen:
            self.duplicates.append(p.request_id)
            if msg.topic is not None:  # it moves the partition's next offset, which
                # `verify` holds to the offsets the events record
                self.appender.append("duplicate", p.request_id,
                                     {"source": msg.source_info()}, self.now_s)
            return IntakeResult("duplicate", p.request_id, "request_id already recorded",
                                op=p.op)
        try:
            record_ids, expanded = self._resolve(p)
        except InvalidRequest as exc:
            return self._reject(msg, p.request_id, exc.reason, p.op)
        self.seen.add(p.request_id)
        payload: dict[str, Any] = {
            "op": p.op, "subject_id": p.subject_id, "record_ids": list(record_ids),
            "expanded_from_subject": expanded, "requested_at": p.requested_at,
            "source": msg.source_info(),
        }
        if p.op == "add":
            hashes = {}
            for r in p.records:
                fp = record_fingerprint(self.key, r.record_id, p.subject_id,
                                        r.features, r.label)
                hashes[r.record_id] = fp
                self.record_rows.append({
                    "record_id": r.record_id, "subject_id": p.subject_id, "record_hash": fp,
                    "state": "pending", "added_by": p.request_id})
                self.payload_rows.append(self.sealer.seal(self.conn, r.record_id,
                                                          r.features, r.label))
                self.records[r.record_id] = (p.subject_id, "pending")
            payload["record_hashes"] = hashes
        seq = self.appender.append("received", p.request_id, payload, self.now_s)
        self.request_rows.append({
            "request_id": p.request_id, "op": p.op, "subject_id": p.subject_id,
            "record_ids": list(record_ids), "expanded_from_subject": expanded,
            "requested_at": p.requested_at, "source": msg.source, "source_topic": msg.topic,
            "source_partition": msg.partition, "source_offset": msg.offset,
            "received_at": self.now, "received_seq": seq, "status": "received",
            "duplicate_count": 0})
        self.request_record_rows += request_record_rows(p.request_id, record_ids, seq)
        return IntakeResult("accepted", p.request_id, None, tuple(record_ids), seq, p.op)

    def _resolve(self, p: RequestMessage) -> tuple[tuple[str, ...], bool]:
        """The records a request names, checked against the store; subjects expand here."""
        if p.op == "add":
            clash = [r for r in p.record_ids or () if r in self.records]
            if clash:
                raise InvalidRequest(f"record(s) already exist: {few(clash)}")
            return tuple(p.record_ids or ()), False
        if p.record_ids is None:
            ids = sorted(r for r in self.by_subject.get(p.subject_id or "", [])
                         if self.records[r][1] != "purged")
            if not ids:
                known = p.subject_id in self.by_subject
                raise InvalidRequest(f"subject {p.subject_id!r} has no records left to delete"
                                     if known else f"unknown subject {p.subject_id!r}")
            return tuple(ids), True
        unknown = [r for r in p.record_ids if r not in self.records]
        if unknown:
            raise InvalidRequest(f"unknown record(s): {few(unknown)}")
        gone = [r for r in p.record_ids if self.records[r][1] == "purged"]
        if gone:
            raise InvalidRequest(f"record(s) already deleted: {few(gone)}")
        if p.subject_id is not None:
            foreign = [r for r in p.record_ids if self.records[r][0] != p.subject_id]
            if foreign:
                raise InvalidRequest(f"record(s) not owned by subject {p.subject_id!r}: "
                                     f"{few(foreign)}")
        return p.record_ids, False

    def _reject(self, msg: IncomingMessage, request_id: str | None, reason: str,
                op: str | None) -> IntakeResult:
        raw = message_bytes(msg.value)
        # The raw message stays out of the immutable log (it may hold personal data):
        # its digest is enough to match it with the dead-letter copy.
        seq = self.appender.append("rejected", request_id, {
            "reason": reason, "source": msg.source_info(),
            "message_sha256": hashlib.sha256(raw).hexdigest(), "message_bytes": len(raw),
        }, self.now_s)
        return IntakeResult("rejected", request_id, reason, (), seq, op)

    def write(self, conn: Connection) -> None:
        insert_rows(conn, RECORDS, self.record_rows)
        insert_rows(conn, SEALED, self.payload_rows)
        insert_rows(conn, REQUESTS, self.request_rows)
        insert_rows(conn, REQUEST_RECORDS, self.request_record_rows)
        self.appender.flush(conn)
        for rid, n in Counter(self.duplicates).items():
            conn.execute(update(REQUESTS).where(REQUESTS.c.request_id == rid)
                         .values(duplicate_count=REQUESTS.c.duplicate_count + n))
        for (topic, partition), nxt in self.next_offset.items():
            values = {"next_offset": nxt}
            if (topic, partition) in self.topic_ids:
                values["topic_id"] = self.topic_ids[(topic, partition)]
            if (topic, partition) in self.offsets:
                conn.execute(update(OFFSETS).where(OFFSETS.c.topic == topic,
                                                   OFFSETS.c.partition == partition)
                             .values(**values))
            else:
                conn.execute(insert(OFFSETS), {"topic": topic, "partition": partition,
                                               **values})


def request_record_rows(request_id: str, record_ids: Iterable[str],
                        received_seq: int) -> list[dict[str, Any]]:
    """The `request_records` rows of a request: each record id it names, once, so that
    a subject's requests are found by index rather than by reading every request."""
    return [{"record_id": r, "received_seq": received_seq, "request_id": request_id}
            for r in dict.fromkeys(record_ids)]


def backfill_request_records(conn: Connection, batch: int = 10_000) -> int:
    """Write the `request_records` rows of the requests already stored (migration 0009),
    `batch` requests at a time in the order of their ids; returns how many rows."""
    last, n = 0, 0
    cols = (REQUESTS.c.id, REQUESTS.c.request_id, REQUESTS.c.record_ids,
            REQUESTS.c.received_seq)
    while rows := conn.execute(select(*cols).where(REQUESTS.c.id > last)
                               .order_by(REQUESTS.c.id).limit(batch)).all():
        links = [row for r in rows
                 for row in request_record_rows(r.request_id, r.record_ids, r.received_seq)]
        insert_rows(conn, REQUEST_RECORDS, links)
        last, n = rows[-1].id, n + len(links)
    return n


def message_bytes(value: bytes | str | dict[str, Any] | None) -> bytes:
    """The bytes a rejected message's digest is taken over (a null value: none)."""
    if value is None:
        return b""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, dict):
        try:
            value = canonical_json(value)
        except (ValueError, TypeError, RecursionError):  # NaN, a huge int, a set...
            value = object.__repr__(value)
    return str(value).encode("utf-8", "surrogatepass")


def parse_message(value: Any, schema: DatasetSchema | None) -> RequestMessage | InvalidRequest:
    try:
        return parse_request(value, schema)
    except InvalidRequest as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - a validator bug must not stop intake
        log.exception("validation failed on a message; rejecting it")
        return InvalidRequest(f"could not be validated: {first_line(exc)}")


class Unstorable(Exception):
    """The database refused a batch for a reason of a message's making."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def caused_by_input(exc: BaseException, dbapi: Any) -> bool:
    """Whether storing failed on what a message holds, not on the database being down.

    `dbapi` is the driver module: rows go in by COPY on PostgreSQL, whose errors come
    straight from psycopg rather than wrapped by SQLAlchemy.
    """
    if isinstance(exc, DBAPIError):  # OperationalError, InterfaceError...: the database
        return isinstance(exc, DataError | IntegrityError)
    if dbapi is not None and isinstance(exc, dbapi.Error):
        return isinstance(exc, dbapi.DataError | dbapi.IntegrityError)
    return isinstance(exc, StatementError | ValueError | TypeError | ArithmeticError
                      | RecursionError)


def few(ids: Sequence[str], n: int = 5) -> str:
    """The first few ids of a list, for an error message."""
    shown = ", ".join(repr(i) for i in ids[:n])
    return shown + (f" and {len(ids) - n} more" if len(ids) > n else "")
