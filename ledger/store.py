"""The ledger: the source of truth for every deletion and addition request.

Every state change is an event appended to the hash chain in the same
transaction as the change itself, so the log and the working tables can never
disagree after a crash. The request lifecycle is
received -> claimed -> applied -> verified, or rejected / failed with a reason.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import numpy as np
from sqlalchemy import Connection, func, insert, select, update
from sqlmodel import Session

from ledger import merkle, metrics
from ledger.chain import (
    GENESIS_HASH,
    canonical_json,
    event_hash,
    event_leaf,
    iso,
    record_fingerprint,
    utc_now,
)
from ledger.db import among, create_tables, insert_rows, make_engine, writing
from ledger.models import (
    REQUEST_STATUSES,
    Checkpoint,
    DatasetSchema,
    Event,
    Request,
    SourceOffset,
    TrainingRecord,
)
from ledger.validation import InvalidRequest, RequestMessage, parse_request

EVENTS = Event.__table__
REQUESTS = Request.__table__
RECORDS = TrainingRecord.__table__
CHECKPOINTS = Checkpoint.__table__
OFFSETS = SourceOffset.__table__
_CHUNK = 500  # rows per IN (...) lookup, well under every backend's parameter limit


@dataclass(frozen=True)
class IncomingMessage:
    """A raw request as it arrived, with where it came from."""

    value: bytes | str | dict[str, Any]
    source: Literal["kafka", "http", "cli"] = "http"
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None

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


@dataclass
class Problem:
    """One thing `verify` found wrong, named precisely enough to go and look."""

    where: str
    message: str
    seq: int | None = None

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class VerifyResult:
    ok: bool
    events: int
    checkpoints: int
    records: int
    problems: list[Problem] = field(default_factory=list)

    @property
    def first_bad_seq(self) -> int | None:
        seqs = [p.seq for p in self.problems if p.seq is not None]
        return min(seqs) if seqs else None


@dataclass(frozen=True)
class LiveRecords:
    """The training set as the ledger holds it now (records neither pending nor purged)."""

    record_ids: np.ndarray
    subject_ids: np.ndarray
    X: np.ndarray
    y: np.ndarray


RejectHook = Callable[[list[tuple[IncomingMessage, IntakeResult]]], None]


class Ledger:
    """Append-only, hash-chained request ledger over SQLite or PostgreSQL."""

    def __init__(self, url: str, hmac_key: bytes, checkpoint_every: int = 1000) -> None:
        if len(hmac_key) < 16:
            raise ValueError("the HMAC key must be at least 16 bytes")
        self.url = url
        self.engine = make_engine(url)
        create_tables(self.engine)
        self.checkpoint_every = checkpoint_every
        self._key = hmac_key
        self._schema: DatasetSchema | None = None

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ schema and records
    def schema(self) -> DatasetSchema | None:
        """The feature schema; fixed once set, so it is read once per process."""
        if self._schema is None:
            with Session(self.engine) as s:
                row = s.get(DatasetSchema, 1)
                if row is not None:
                    s.expunge(row)
                self._schema = row
        return self._schema

    def load_records(self, record_ids: Sequence[str], subject_ids: Sequence[str | None],
                     X: np.ndarray, y: np.ndarray, name: str = "dataset") -> int:
        """Seed the record store (the initial training set); returns the event's seq."""
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y)
        n = len(record_ids)
        if X.ndim != 2 or len(X) != n or len(y) != n or len(subject_ids) != n:
            raise ValueError("record_ids, subject_ids, X (2-D) and y must have the same length")
        if not np.all(np.isfinite(X)):
            raise ValueError("X contains NaN or infinite values")
        ids = [str(r) for r in record_ids]
        if len(set(ids)) != n:
            raise ValueError("record_ids must be unique")
        classes = sorted(int(c) for c in np.unique(y))
        now = utc_now()
        with writing(self.engine) as conn:
            schema = conn.execute(select(DatasetSchema.__table__)).first()
            if schema is None:
                conn.execute(insert(DatasetSchema.__table__),
                             {"id": 1, "name": name, "n_features": X.shape[1], "classes": classes})
            elif schema.n_features != X.shape[1] or not set(classes) <= set(schema.classes):
                raise ValueError(f"data does not match the ledger's schema {schema.name!r} "
                                 f"({schema.n_features} features, classes {schema.classes})")
            clash = self._existing_records(conn, ids)
            if clash:
                raise ValueError(f"{len(clash)} record id(s) already exist, "
                                 f"e.g. {sorted(clash)[0]}")
            rows = []
            for rid, sid, x, label in zip(ids, subject_ids, X.tolist(), y.tolist(), strict=True):
                sid = None if sid is None else str(sid)
                rows.append({"record_id": rid, "subject_id": sid, "features": x,
                             "label": int(label), "state": "live", "added_at": now,
                             "record_hash": record_fingerprint(self._key, rid, sid, x, int(label))})
            for i in range(0, n, 5000):
                conn.execute(insert(RECORDS), rows[i:i + 5000])
            fingerprints = sorted(bytes.fromhex(r["record_hash"]) for r in rows)
            appender = _Appender(conn)
            seq = appender.append("records_loaded", None, {
                "name": name, "count": n, "n_features": X.shape[1], "classes": classes,
                "records_root": merkle.root([merkle.leaf_hash(f) for f in fingerprints]).hex(),
            }, iso(now))
            appender.flush(conn)
        self._schema = None
        return seq

    def live_records(self) -> LiveRecords:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(RECORDS.c.record_id, RECORDS.c.subject_id, RECORDS.c.features,
                       RECORDS.c.label).where(RECORDS.c.state == "live")
                .order_by(RECORDS.c.record_id)).all()
        n_features = self.schema().n_features if self.schema() else 0
        return LiveRecords(
            record_ids=np.array([r.record_id for r in rows], dtype=object),
            subject_ids=np.array([r.subject_id for r in rows], dtype=object),
            X=np.array([r.features for r in rows], dtype=np.float64).reshape(len(rows), n_features),
            y=np.array([r.label for r in rows], dtype=np.int64),
        )

    def record_data(self, record_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Features and labels of records, in the order given (an add's payload)."""
        ids = [str(r) for r in record_ids]
        found: dict[str, Any] = {}
        with self.engine.connect() as conn:
            for i in range(0, len(ids), _CHUNK):
                for r in conn.execute(select(RECORDS.c.record_id, RECORDS.c.features,
                                             RECORDS.c.label)
                                      .where(RECORDS.c.record_id.in_(ids[i:i + _CHUNK]))):
                    found[r.record_id] = r
        missing = [r for r in ids if r not in found or found[r].features is None]
        if missing:
            raise KeyError(f"{len(missing)} record(s) hold no data, e.g. {missing[0]!r}")
        n_features = self.schema().n_features
        X = np.array([found[r].features for r in ids], dtype=np.float64).reshape(len(ids),
                                                                               n_features)
        return X, np.array([found[r].label for r in ids], dtype=np.int64)

    def purged(self, record_ids: Sequence[str]) -> set[str]:
        """Those of `record_ids` whose data a deletion has purged."""
        if not record_ids:
            return set()
        with self.engine.connect() as conn:
            return set(conn.execute(select(RECORDS.c.record_id).where(
                RECORDS.c.record_id.in_(list(record_ids)), RECORDS.c.state == "purged"
            )).scalars())

    def records_digest(self, record_ids: Sequence[str]) -> tuple[int, str]:
        """(count, Merkle root) of these records' keyed fingerprints, sorted.

        A model manifest names its training set by this root; an auditor holding the
        fingerprints (the ledger keeps them after a purge) can recompute it without
        seeing any record.
        """
        ids = [str(r) for r in record_ids]
        fps: list[bytes] = []
        with self.engine.connect() as conn:
            for i in range(0, len(ids), _CHUNK):
                fps.extend(bytes.fromhex(h) for h in conn.execute(
                    select(RECORDS.c.record_hash)
                    .where(RECORDS.c.record_id.in_(ids[i:i + _CHUNK]))).scalars())
        if len(fps) != len(set(ids)):
            raise KeyError(f"{len(set(ids)) - len(fps)} record id(s) are not in the ledger")
        fps.sort()
        return len(fps), merkle.root([merkle.leaf_hash(f) for f in fps]).hex()

    def record_event(self, kind: str, payload: dict[str, Any], model_version: str | None = None,
                     in_transaction: Callable[[Connection], None] | None = None) -> int:
        """Append an event that belongs to no request (a model published, say)."""
        if kind in REQUEST_STATUSES:
            raise ValueError(f"{kind!r} is a request lifecycle event")
        with writing(self.engine) as conn:
            appender = _Appender(conn)
            seq = appender.append(kind, None, payload, iso(utc_now()), model_version)
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)
        return seq

    def requests_with_status(self, status: str, limit: int = 10_000) -> list[Request]:
        """Requests in one lifecycle state, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(REQUESTS).where(REQUESTS.c.status == status)
                                .order_by(REQUESTS.c.received_seq).limit(limit)).all()
        return [Request.model_validate(dict(r._mapping)) for r in rows]

    def requests_of_subject(self, subject_id: str) -> list[dict[str, Any]]:
        """Every request about a subject: by subject id, or naming any of its records."""
        with self.engine.connect() as conn:
            own = set(conn.execute(select(RECORDS.c.record_id)
                                   .where(RECORDS.c.subject_id == subject_id)).scalars())
            rows = conn.execute(select(REQUESTS).order_by(REQUESTS.c.received_seq)).all()
        return [{"request_id": r.request_id, "op": r.op, "status": r.status,
                 "subject_id": r.subject_id, "record_ids": list(r.record_ids),
                 "received_at": iso(r.received_at)}
                for r in rows if r.subject_id == subject_id or own.intersection(r.record_ids)]

    def consumed(self, topic: str) -> int:
        """Kafka messages of `topic` recorded so far (sum of the partitions' next offsets)."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.coalesce(func.sum(OFFSETS.c.next_offset), 0))
                                    .where(OFFSETS.c.topic == topic)).scalar())

    def status_counts(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {s: n for s, n in conn.execute(
                select(REQUESTS.c.status, func.count()).group_by(REQUESTS.c.status))}

    def last_seq(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0

    # ------------------------------------------------------------------ intake
    def receive(self, value: bytes | str | dict[str, Any],
                source: Literal["kafka", "http", "cli"] = "http") -> IntakeResult:
        """Validate and record one request (the HTTP and CLI path)."""
        return self.receive_batch([IncomingMessage(value, source)])[0]

    def receive_batch(self, messages: Sequence[IncomingMessage],
                      before_commit: RejectHook | None = None) -> list[IntakeResult]:
        """Validate and record a batch in ONE transaction; idempotent on request_id.

        Kafka messages below the partition's recorded offset are redeliveries (the
        consumer died after this transaction but before its Kafka commit) and are
        skipped, so every message has exactly one effect. `before_commit` gets the
        rejected messages while the transaction is still open: if it raises (the
        dead-letter topic is down), nothing is recorded and the batch can be retried.
        """
        schema = self.schema()
        parsed: list[RequestMessage | InvalidRequest] = []
        for m in messages:
            try:
                parsed.append(parse_request(m.value, schema))
            except InvalidRequest as exc:
                parsed.append(exc)
        with writing(self.engine) as conn:
            now = utc_now()  # read under the lock, so event times follow seq order
            now_s = iso(now)
            intake = _BatchIntake(self._key, conn, parsed, now, now_s)
            results = [intake.handle(m, p) for m, p in zip(messages, parsed, strict=True)]
            intake.write(conn)
            self._maybe_checkpoint(conn, intake.appender.seq)
            rejected = [(m, r) for m, r in zip(messages, results, strict=True)
                        if r.status == "rejected"]
            if rejected and before_commit is not None:
                before_commit(rejected)
        for (op, status), n in Counter((r.op or "unknown", r.status) for r in results).items():
            metrics.REQUESTS.labels(op=op, status=status).inc(n)
        return results

    # ------------------------------------------------------------------ lifecycle
    def claim(self, limit: int = 100, worker: str = "worker", lease_s: float = 300.0,
              retake_own: bool = True) -> list[Request]:
        """Move up to `limit` requests to `claimed`, oldest first.

        Besides received requests this takes claims older than `lease_s` (a worker
        that died for good) and, with `retake_own`, the worker's own claims (left by
        a crash of an earlier run under the same name, or by a failed pass), so a
        claimed request is never stranded.
        """
        with writing(self.engine) as conn:
            now = utc_now()
            retake = REQUESTS.c.claimed_at < now - timedelta(seconds=lease_s)
            if retake_own:
                retake = retake | (REQUESTS.c.claimed_by == worker)
            q = (select(REQUESTS).where((REQUESTS.c.status == "received")
                                       | ((REQUESTS.c.status == "claimed") & retake))
                 .order_by(REQUESTS.c.received_seq).limit(limit))
            if conn.dialect.name == "postgresql":
                q = q.with_for_update(skip_locked=True)
            rows = [Request.model_validate(dict(r._mapping)) for r in conn.execute(q)]
            if not rows:
                return []
            now_s = iso(now)
            appender = _Appender(conn)
            for r in rows:
                payload = {"worker": worker}
                if r.status == "claimed":
                    payload["reclaimed_from"] = r.claimed_by
                appender.append("claimed", r.request_id, payload, now_s)
                r.status, r.claimed_by, r.claimed_at = "claimed", worker, now
            conn.execute(update(REQUESTS)
                         .where(REQUESTS.c.request_id.in_([r.request_id for r in rows]))
                         .values(status="claimed", claimed_by=worker, claimed_at=now))
            appender.flush(conn)
        return rows

    def mark_applied(self, request_ids: Sequence[str], model_version: str,
                     detail: dict[str, Any] | None = None,
                     in_transaction: Callable[[Connection], None] | None = None) -> None:
        """The model `model_version` no longer holds deleted records (and holds added ones).

        Raw features and labels of deleted records are purged in the same
        transaction; their keyed fingerprints go into the event. `in_transaction`
        runs inside that transaction too (the registry publishes the version
        there), so the events and the served version change together or not at all.
        """
        with writing(self.engine) as conn:
            now = utc_now()
            reqs = self._requests_in_state(conn, request_ids, "claimed", "applied")
            appender = _Appender(conn)
            for r in reqs:
                if r.op == "delete":
                    fps = self._purge(conn, r.record_ids, r.request_id, now)
                    payload = {"purged_record_hashes": fps}
                else:
                    conn.execute(update(RECORDS).where(RECORDS.c.record_id.in_(r.record_ids))
                                 .values(state="live", added_at=now))
                    payload = {"added": len(r.record_ids)}
                payload.update(detail or {})
                appender.append("applied", r.request_id, payload, iso(now), model_version)
            self._set_status(conn, request_ids, "applied")
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)

    def mark_verified(self, request_ids: Sequence[str], model_version: str,
                      detail: dict[str, Any] | None = None,
                      in_transaction: Callable[[Connection], None] | None = None) -> None:
        with writing(self.engine) as conn:
            self._requests_in_state(conn, request_ids, "applied", "verified")
            appender = _Appender(conn)
            now_s = iso(utc_now())
            for rid in request_ids:
                appender.append("verified", rid, detail or {}, now_s, model_version)
            self._set_status(conn, request_ids, "verified")
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)

    def mark_failed(self, request_id: str, reason: str) -> None:
        with writing(self.engine) as conn:
            self._requests_in_state(conn, [request_id], "claimed", "failed")
            appender = _Appender(conn)
            appender.append("failed", request_id, {"reason": reason}, iso(utc_now()))
            self._set_status(conn, [request_id], "failed")
            appender.flush(conn)

    # ------------------------------------------------------------------ audit
    def checkpoint(self) -> Checkpoint | None:
        """Publish a tree head over every event so far (no-op if the last one covers them)."""
        with writing(self.engine) as conn:
            size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
            self._write_checkpoint(conn, size)
            row = conn.execute(select(CHECKPOINTS).order_by(CHECKPOINTS.c.tree_size.desc())
                               .limit(1)).first()
        return None if row is None else Checkpoint.model_validate(dict(row._mapping))

    def history(self, request_id: str) -> dict[str, Any]:
        """A request, its events, and for each event an inclusion proof to a published root.

        Publishes a new checkpoint first if the latest one does not cover the events yet.
        """
        with self.engine.connect() as conn:
            req = conn.execute(select(REQUESTS).where(REQUESTS.c.request_id == request_id)).first()
            events = conn.execute(select(EVENTS).where(EVENTS.c.request_id == request_id)
                                  .order_by(EVENTS.c.seq)).all()
        if req is None and not events:
            raise KeyError(f"no request or event with request_id {request_id!r}")
        head = self.checkpoint()
        with self.engine.connect() as conn:
            leaves = [event_leaf(h) for h in conn.execute(
                select(EVENTS.c.hash).where(EVENTS.c.seq <= head.tree_size)
                .order_by(EVENTS.c.seq)).scalars()]
        out_events = []
        for e in events:
            d = _event_dict(e)
            d["inclusion_proof"] = [p.hex() for p in merkle.inclusion_proof(leaves, e.seq - 1)]
            out_events.append(d)
        request = None
        if req is not None:
            request = {k: v for k, v in req._mapping.items() if k != "id"}
            for k in ("received_at", "claimed_at"):
                if request[k] is not None:
                    request[k] = iso(request[k])
        return {"request": request, "events": out_events,
                "tree_head": {"tree_size": head.tree_size, "root_hash": head.root_hash,
                              "created_at": head.created_at}}

    def export(self, since: str | int | None = None) -> Iterator[dict[str, Any]]:
        """Events for auditors, oldest first: since a sequence number or an ISO time."""
        q = select(EVENTS).order_by(EVENTS.c.seq)
        if isinstance(since, int):
            q = q.where(EVENTS.c.seq > since)
        elif since is not None:
            q = q.where(EVENTS.c.created_at >= iso(datetime.fromisoformat(since)))
        with self.engine.connect() as conn:
            for row in conn.execution_options(yield_per=5000).execute(q):
                yield _event_dict(row)

    def verify(self) -> VerifyResult:
        """Recompute the chain, every checkpoint and every record fingerprint."""
        problems: list[Problem] = []
        with self.engine.connect() as conn:
            checkpoints = {r.tree_size: r.root_hash for r in conn.execute(select(CHECKPOINTS))}
            frontier = merkle.MerkleFrontier()
            prev, expected = GENESIS_HASH, 1
            last_kind: dict[str, str] = {}
            for e in conn.execution_options(yield_per=5000).execute(
                    select(EVENTS).order_by(EVENTS.c.seq)):
                if e.seq != expected:
                    problems.append(Problem(f"event {expected}", "missing: the sequence jumps "
                                            f"to {e.seq} (deleted row?)", expected))
                    expected = e.seq
                if e.prev_hash != prev:
                    problems.append(Problem(f"event {e.seq}", "prev_hash does not match the "
                                            "previous event's hash", e.seq))
                if event_hash(e.seq, e.request_id, e.kind, e.payload, e.model_version,
                              e.created_at, e.prev_hash) != e.hash:
                    problems.append(Problem(f"event {e.seq}", "content does not match its "
                                            "hash (edited behind the ledger's back)", e.seq))
                prev, expected = e.hash, expected + 1
                frontier.append(event_leaf(e.hash))
                root = checkpoints.get(frontier.size)
                if root is not None and root != frontier.root().hex():
                    problems.append(Problem(f"checkpoint {frontier.size}", "Merkle root does not "
                                            "match the events it covers", frontier.size))
                if e.request_id and e.kind in REQUEST_STATUSES:
                    last_kind[e.request_id] = e.kind
            n_events = frontier.size
            for size in sorted(s for s in checkpoints if s > n_events):
                problems.append(Problem(f"checkpoint {size}", f"covers {size} events but the log "
                                        f"has {n_events} (events removed?)", n_events + 1))
            for r in conn.execute(select(REQUESTS.c.request_id, REQUESTS.c.status)):
                if last_kind.get(r.request_id) != r.status:
                    problems.append(Problem(f"request {r.request_id}", f"status {r.status!r} "
                                            f"disagrees with its last event "
                                            f"{last_kind.get(r.request_id)!r}"))
            n_records = 0
            for rec in conn.execution_options(yield_per=5000).execute(select(RECORDS)):
                n_records += 1
                problems.extend(self._check_record(rec))
        return VerifyResult(not problems, n_events, len(checkpoints), n_records, problems)

    # ------------------------------------------------------------------ internals
    def _check_record(self, rec: Any) -> list[Problem]:
        where = f"record {rec.record_id}"
        if rec.state == "purged":
            if rec.features is not None or rec.label is not None:
                return [Problem(where, "is purged but still holds raw features or label")]
            return []
        if rec.features is None or rec.label is None:
            return [Problem(where, f"is {rec.state} but has no features or label")]
        if record_fingerprint(self._key, rec.record_id, rec.subject_id, rec.features,
                              rec.label) != rec.record_hash:
            return [Problem(where, "features or label do not match its keyed fingerprint")]
        return []

    @staticmethod
    def _existing_records(conn: Connection, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(ids), _CHUNK):
            found.update(conn.execute(select(RECORDS.c.record_id)
                                      .where(RECORDS.c.record_id.in_(ids[i:i + _CHUNK])))
                         .scalars())
        return found

    @staticmethod
    def _requests_in_state(conn: Connection, request_ids: Sequence[str], state: str,
                           target: str) -> list[Request]:
        rows = {r.request_id: r for r in conn.execute(
            select(REQUESTS).where(REQUESTS.c.request_id.in_(list(request_ids))))}
        for rid in request_ids:
            r = rows.get(rid)
            if r is None:
                raise KeyError(f"unknown request {rid!r}")
            if r.status != state:
                raise ValueError(f"request {rid!r} is {r.status!r}; only a {state!r} request "
                                 f"can become {target!r}")
        return [Request.model_validate(dict(rows[rid]._mapping)) for rid in request_ids]

    @staticmethod
    def _set_status(conn: Connection, request_ids: Sequence[str], status: str) -> None:
        conn.execute(update(REQUESTS).where(REQUESTS.c.request_id.in_(list(request_ids)))
                     .values(status=status))

    @staticmethod
    def _purge(conn: Connection, record_ids: Sequence[str], request_id: str,
               now: datetime) -> dict[str, str]:
        fps = dict(conn.execute(select(RECORDS.c.record_id, RECORDS.c.record_hash)
                                .where(RECORDS.c.record_id.in_(list(record_ids)))).all())
        conn.execute(update(RECORDS)
                     .where(RECORDS.c.record_id.in_(list(record_ids)),
                            RECORDS.c.state != "purged")
                     .values(features=None, label=None, state="purged", purged_at=now,
                             purged_by=request_id))
        return fps

    def _maybe_checkpoint(self, conn: Connection, size: int) -> None:
        last = conn.execute(select(func.max(CHECKPOINTS.c.tree_size))).scalar() or 0
        if size - last >= self.checkpoint_every:
            self._write_checkpoint(conn, size)

    @staticmethod
    def _write_checkpoint(conn: Connection, size: int) -> None:
        """Extend the last checkpoint's stored frontier by the events after it."""
        last = conn.execute(select(CHECKPOINTS).order_by(CHECKPOINTS.c.tree_size.desc())
                            .limit(1)).first()
        if size == 0 or (last is not None and last.tree_size >= size):
            return
        frontier = (merkle.MerkleFrontier.from_state(last.tree_size,
                                                     [bytes.fromhex(h) for h in last.frontier])
                    if last is not None else merkle.MerkleFrontier())
        for h in conn.execute(select(EVENTS.c.hash)
                              .where(EVENTS.c.seq > frontier.size, EVENTS.c.seq <= size)
                              .order_by(EVENTS.c.seq)).scalars():
            frontier.append(event_leaf(h))
        conn.execute(insert(CHECKPOINTS), {
            "tree_size": size, "root_hash": frontier.root().hex(), "created_at": iso(utc_now()),
            "frontier": [h.hex() for h in frontier.state()[1]],
        })


def _event_dict(row: Any) -> dict[str, Any]:
    return {"seq": row.seq, "request_id": row.request_id, "kind": row.kind,
            "payload": json.loads(row.payload), "model_version": row.model_version,
            "created_at": row.created_at, "prev_hash": row.prev_hash, "hash": row.hash}


class _Appender:
    """Extends the hash chain from its current tail inside one locked transaction."""

    def __init__(self, conn: Connection) -> None:
        tail = conn.execute(select(EVENTS.c.seq, EVENTS.c.hash)
                            .order_by(EVENTS.c.seq.desc()).limit(1)).first()
        self.seq, self.prev = (tail.seq, tail.hash) if tail else (0, GENESIS_HASH)
        self.rows: list[dict[str, Any]] = []

    def append(self, kind: str, request_id: str | None, payload: dict[str, Any],
               created_at: str, model_version: str | None = None) -> int:
        self.seq += 1
        text = canonical_json(payload)
        h = event_hash(self.seq, request_id, kind, text, model_version, created_at, self.prev)
        self.rows.append({"seq": self.seq, "request_id": request_id, "kind": kind,
                          "payload": text, "model_version": model_version,
                          "created_at": created_at, "prev_hash": self.prev, "hash": h})
        self.prev = h
        return self.seq

    def flush(self, conn: Connection) -> None:
        if self.rows:
            insert_rows(conn, EVENTS, self.rows)
            for kind, n in Counter(r["kind"] for r in self.rows).items():
                metrics.LEDGER_EVENTS.labels(kind=kind).inc(n)
            self.rows = []


class _BatchIntake:
    """The database half of validating one batch: duplicates, unknown ids, expansion."""

    def __init__(self, hmac_key: bytes, conn: Connection,
                 parsed: Sequence[RequestMessage | InvalidRequest], now: datetime,
                 now_s: str) -> None:
        self.key, self.now, self.now_s = hmac_key, now, now_s
        self.appender = _Appender(conn)
        self.request_rows: list[dict[str, Any]] = []
        self.record_rows: list[dict[str, Any]] = []
        self.duplicates: list[str] = []
        self.offsets: dict[tuple[str, int], int] = {}
        self.next_offset: dict[tuple[str, int], int] = {}
        valid = [p for p in parsed if isinstance(p, RequestMessage)]
        ids = list({p.request_id for p in valid})
        self.seen: set[str] = set()
        for i in range(0, len(ids), _CHUNK):
            self.seen.update(conn.execute(select(REQUESTS.c.request_id).where(
                among(conn, REQUESTS.c.request_id, ids[i:i + _CHUNK]))).scalars())
        # record id -> (subject, state) for every record the batch names or expands to
        self.records: dict[str, tuple[str | None, str]] = {}
        rec_ids = list({r for p in valid for r in (p.record_ids or ())})
        subjects = list({p.subject_id for p in valid if p.op == "delete" and p.subject_id})
        cols = (RECORDS.c.record_id, RECORDS.c.subject_id, RECORDS.c.state)
        for i in range(0, len(rec_ids), _CHUNK):
            for r in conn.execute(select(*cols).where(
                    among(conn, RECORDS.c.record_id, rec_ids[i:i + _CHUNK]))):
                self.records[r.record_id] = (r.subject_id, r.state)
        self.by_subject: dict[str, list[str]] = {}
        for i in range(0, len(subjects), _CHUNK):
            for r in conn.execute(select(*cols).where(
                    among(conn, RECORDS.c.subject_id, subjects[i:i + _CHUNK]))):
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
        if isinstance(p, InvalidRequest):
            return self._reject(msg, p.request_id, p.reason, None)
        if p.request_id in self.seen:
            self.duplicates.append(p.request_id)
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
                    "record_id": r.record_id, "subject_id": p.subject_id,
                    "features": r.features, "label": r.label, "record_hash": fp,
                    "state": "pending", "added_by": p.request_id})
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
        return IntakeResult("accepted", p.request_id, None, tuple(record_ids), seq, p.op)

    def _resolve(self, p: RequestMessage) -> tuple[tuple[str, ...], bool]:
        """The records a request names, checked against the store; subjects expand here."""
        if p.op == "add":
            clash = [r for r in p.record_ids or () if r in self.records]
            if clash:
                raise InvalidRequest(f"record(s) already exist: {_few(clash)}")
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
            raise InvalidRequest(f"unknown record(s): {_few(unknown)}")
        gone = [r for r in p.record_ids if self.records[r][1] == "purged"]
        if gone:
            raise InvalidRequest(f"record(s) already deleted: {_few(gone)}")
        if p.subject_id is not None:
            foreign = [r for r in p.record_ids if self.records[r][0] != p.subject_id]
            if foreign:
                raise InvalidRequest(f"record(s) not owned by subject {p.subject_id!r}: "
                                     f"{_few(foreign)}")
        return p.record_ids, False

    def _reject(self, msg: IncomingMessage, request_id: str | None, reason: str,
                op: str | None) -> IntakeResult:
        raw = msg.value
        if isinstance(raw, dict):
            raw = canonical_json(raw)
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "surrogatepass")
        # The raw message stays out of the immutable log (it may hold personal data):
        # its digest is enough to match it with the dead-letter copy.
        seq = self.appender.append("rejected", request_id, {
            "reason": reason, "source": msg.source_info(),
            "message_sha256": hashlib.sha256(raw).hexdigest(), "message_bytes": len(raw),
        }, self.now_s)
        return IntakeResult("rejected", request_id, reason, (), seq, op)

    def write(self, conn: Connection) -> None:
        insert_rows(conn, RECORDS, self.record_rows)
        insert_rows(conn, REQUESTS, self.request_rows)
        self.appender.flush(conn)
        for rid, n in Counter(self.duplicates).items():
            conn.execute(update(REQUESTS).where(REQUESTS.c.request_id == rid)
                         .values(duplicate_count=REQUESTS.c.duplicate_count + n))
        for (topic, partition), nxt in self.next_offset.items():
            if (topic, partition) in self.offsets:
                conn.execute(update(OFFSETS).where(OFFSETS.c.topic == topic,
                                                   OFFSETS.c.partition == partition)
                             .values(next_offset=nxt))
            else:
                conn.execute(insert(OFFSETS), {"topic": topic, "partition": partition,
                                               "next_offset": nxt})


def _few(ids: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(i) for i in ids[:n])
    return shown + (f" and {len(ids) - n} more" if len(ids) > n else "")
