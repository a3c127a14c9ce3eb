"""The ledger: the source of truth for every deletion and addition request.

Every state change is an event appended to the hash chain in the same
transaction as the change itself, so the log and the working tables can never
disagree after a crash. The request lifecycle is
received -> claimed -> applied -> verified, or rejected / failed with a reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import numpy as np
from sqlalchemy import Connection, case, delete, func, insert, inspect, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session

from ledger import merkle, metrics
from ledger.chain import (
    GENESIS_HASH,
    as_utc,
    canonical_json,
    event_hash,
    event_leaf,
    iso,
    record_fingerprint,
    utc_now,
)
from ledger.db import (
    among,
    create_tables,
    insert_rows,
    make_engine,
    pg_vacuum_full,
    sqlite_checkpoint,
    sqlite_vacuum,
    upsert,
    writing,
    xid_precedes,
)
from ledger.models import (
    REQUEST_STATUSES,
    Checkpoint,
    DatasetSchema,
    Event,
    PurgeMaintenance,
    RecordPayload,
    Request,
    SourceOffset,
    TrainingRecord,
)
from ledger.validation import InvalidRequest, RequestMessage, parse_request

EVENTS = Event.__table__
REQUESTS = Request.__table__
RECORDS = TrainingRecord.__table__
PAYLOADS = RecordPayload.__table__
MAINTENANCE = PurgeMaintenance.__table__
CHECKPOINTS = Checkpoint.__table__
OFFSETS = SourceOffset.__table__
_CHUNK = 500  # rows per IN (...) lookup, well under every backend's parameter limit

log = logging.getLogger("obliviate.ledger")

# Seconds between purge maintenance runs unless configured (OBLIVIATE_PURGE_MAINTENANCE_S).
# SQLite: a WAL checkpoint costs milliseconds, so after every purge. PostgreSQL: VACUUM
# FULL rewrites the whole payload table (measured on a 2-core machine, 30 features:
# 0.3 s and 66 MiB of WAL at 10^5 records, 2-4 s and 665 MiB at 10^6) and holds back
# additions while it runs, so at most every 10 minutes.
PURGE_MAINTENANCE_DEFAULT_S = {"sqlite": 0.0, "postgresql": 600.0}
_MAINTENANCE_RETRY_S = 30.0  # a run that could not erase everything is retried this soon
_PG_LOCK_TIMEOUT_S = 3.0  # VACUUM FULL gives up (and retries later) rather than queue longer
_MAINTENANCE_LOCK_KEY = 0x0B11_71A7F  # PostgreSQL advisory lock: one maintenance at a time


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

    def __init__(self, url: str, hmac_key: bytes, checkpoint_every: int = 1000,
                 purge_maintenance_s: float | None = None) -> None:
        if len(hmac_key) < 16:
            raise ValueError("the HMAC key must be at least 16 bytes")
        self.url = url
        self.engine = make_engine(url)
        create_tables(self.engine)
        self._migrate_payloads()
        self.checkpoint_every = checkpoint_every
        # minimum seconds between two purge maintenance runs (None: the backend's default)
        self.purge_maintenance_s = float(
            PURGE_MAINTENANCE_DEFAULT_S.get(self.engine.dialect.name, 0.0)
            if purge_maintenance_s is None else purge_maintenance_s)
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
            rows, payloads = [], []
            for rid, sid, x, label in zip(ids, subject_ids, X.tolist(), y.tolist(), strict=True):
                sid = None if sid is None else str(sid)
                rows.append({"record_id": rid, "subject_id": sid, "state": "live",
                             "added_at": now,
                             "record_hash": record_fingerprint(self._key, rid, sid, x, int(label))})
                payloads.append({"record_id": rid, "features": x, "label": int(label)})
            for i in range(0, n, 50_000):
                insert_rows(conn, RECORDS, rows[i:i + 50_000])
                insert_rows(conn, PAYLOADS, payloads[i:i + 50_000])
            fingerprints = sorted(bytes.fromhex(r["record_hash"]) for r in rows)
            appender = _Appender(conn)
            seq = appender.append("records_loaded", None, {
                "name": name, "count": n, "n_features": X.shape[1], "classes": classes,
                "records_root": merkle.root([merkle.leaf_hash(f) for f in fingerprints]).hex(),
            }, iso(now))
            appender.flush(conn)
        self._schema = None
        return seq

    def record_states(self) -> dict[str, str]:
        """Every record id the ledger knows, with its state (pending, live, purged)."""
        with self.engine.connect() as conn:
            return dict(conn.execute(select(RECORDS.c.record_id, RECORDS.c.state)).all())

    def live_records(self) -> LiveRecords:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(RECORDS.c.record_id, RECORDS.c.subject_id, PAYLOADS.c.features,
                       PAYLOADS.c.label)
                .select_from(RECORDS.outerjoin(PAYLOADS,
                                               PAYLOADS.c.record_id == RECORDS.c.record_id))
                .where(RECORDS.c.state == "live")
                .order_by(RECORDS.c.record_id)).all()
        missing = [r.record_id for r in rows if r.features is None]
        if missing:
            raise ValueError(f"{len(missing)} live record(s) hold no data, e.g. {missing[0]!r} "
                             "(`obliviate ledger verify` names them all)")
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
                for r in conn.execute(select(PAYLOADS)
                                      .where(PAYLOADS.c.record_id.in_(ids[i:i + _CHUNK]))):
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
                     in_transaction: Callable[[Connection], None] | None = None) -> int:
        """The model `model_version` no longer holds deleted records (and holds added ones).

        Raw features and labels of deleted records are purged in the same
        transaction; their keyed fingerprints go into the event. `in_transaction`
        runs inside that transaction too (the registry publishes the version
        there), so the events and the served version change together or not at all.
        Returns the number of records whose data was purged: when it is not 0, call
        `purge_maintenance()` (on SQLite this method has already run it).
        """
        purged = 0
        with writing(self.engine) as conn:
            now = utc_now()
            reqs = self._requests_in_state(conn, request_ids, "claimed", "applied")
            appender = _Appender(conn)
            for r in reqs:
                if r.op == "delete":
                    fps, n = self._purge(conn, r.record_ids, r.request_id, now)
                    purged += n
                    payload = {"purged_record_hashes": fps}
                else:
                    conn.execute(update(RECORDS).where(RECORDS.c.record_id.in_(r.record_ids))
                                 .values(state="live", added_at=now))
                    payload = {"added": len(r.record_ids)}
                payload.update(detail or {})
                appender.append("applied", r.request_id, payload, iso(now), model_version)
            self._set_status(conn, request_ids, "applied")
            if purged:
                self._note_purge(conn, now)
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)
        if purged and self.engine.dialect.name == "sqlite":
            # the checkpoint that takes the purged pages out of the WAL: never fails the purge
            try:
                self.purge_maintenance()
            except Exception:  # noqa: BLE001 - logged; the next maintenance call retries
                log.exception("purge maintenance after a purge failed; the next call retries")
        return purged

    # ------------------------------------------------------------------ purge maintenance
    def purge_status(self) -> dict[str, Any]:
        """Purges counted, purges whose bytes maintenance has erased, and when."""
        with self.engine.connect() as conn:
            row = conn.execute(select(MAINTENANCE).where(MAINTENANCE.c.id == 1)).first()
        if row is None:
            return {"purges": 0, "erased": 0, "pending": 0, "rewrite_records": False,
                    "pending_tables": [], "last_purge_at": None, "last_run_at": None,
                    "last_erased_at": None, "last_outcome": None, "last_purge_xid": None}
        out = {k: row._mapping[k] for k in ("purges", "erased", "rewrite_records",
                                            "last_outcome", "last_purge_xid")}
        out["pending_tables"] = list(row.pending_tables or [])
        for k in ("last_purge_at", "last_run_at", "last_erased_at"):
            out[k] = None if row._mapping[k] is None else as_utc(row._mapping[k])
        out["pending"] = row.purges - row.erased
        return out

    def note_purge(self, conn: Connection, tables: Sequence[str] = ()) -> None:
        """In the transaction that deleted secret rows from `tables` (of this database),
        have the next `purge_maintenance` erase them from the files too.

        For components that keep secrets next to the ledger, e.g. a `record_event`
        `in_transaction` callback that deletes a sealing key. Record purges
        (`mark_applied`) are noted without it. On SQLite the checkpoint covers every
        table; on PostgreSQL each named table is rewritten by VACUUM FULL.
        """
        self._note_purge(conn, utc_now(), tables=tables)

    def purge_maintenance(self, force: bool = False) -> dict[str, Any]:
        """Make the bytes of purged records leave the database's files.

        SQLite: a TRUNCATE checkpoint (secure_delete has zeroed the purged rows in
        their pages; the checkpoint writes those pages into the database file and
        empties the WAL that still holds older copies). PostgreSQL: VACUUM FULL of
        `record_payloads` (and of the tables `note_purge` named), which rewrites it,
        its TOAST table and its index into new files and truncates the old ones.

        Runs only when purges happened since the last successful run, and at most
        every `purge_maintenance_s` seconds (a run that could not finish: after at
        most 30 s) unless `force`. A crash between a purge and its maintenance leaves
        the purge counted as pending, so the next call does the work. A busy database
        does not raise; the outcome says what happened: "erased"; "blocked" (SQLite
        readers kept the WAL); "locked" (a PostgreSQL lock wait over 3 s); "held" (a
        snapshot older than the purge was open, so the rewrite had to keep its rows);
        "busy" (another process is running maintenance); "throttled"; "nothing to do".
        """
        t0 = time.perf_counter()
        state = self.purge_status()
        out: dict[str, Any] = {"backend": self.engine.dialect.name, "ran": False,
                               "outcome": None, "pending": state["pending"],
                               "erased": state["pending"] == 0, "seconds": 0.0}
        if not force:
            if state["pending"] <= 0 and not state["rewrite_records"]:
                out["outcome"] = "nothing to do"
                return out
            if state["last_run_at"] is not None:
                wait = self.purge_maintenance_s
                if state["last_outcome"] != "erased":
                    wait = min(wait, _MAINTENANCE_RETRY_S)
                age = (utc_now() - state["last_run_at"]).total_seconds()
                if age < wait:
                    out.update(outcome="throttled", due_in_s=round(wait - age, 3))
                    return out
        if self.engine.dialect.name == "postgresql":
            outcome, tables = self._pg_maintenance(state)
        else:
            outcome, tables = self._sqlite_maintenance(state)
        if outcome != "busy":
            self._record_maintenance(state, outcome)
        after = self.purge_status()
        out.update(ran=outcome != "busy", outcome=outcome, erased=outcome == "erased",
                   pending=after["pending"], tables=tables,
                   seconds=round(time.perf_counter() - t0, 4))
        log.info("purge maintenance: %s (%s) in %.3f s; %d purge(s) pending", outcome,
                 ", ".join(tables) or "-", out["seconds"], out["pending"])
        return out

    def _sqlite_maintenance(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        tables = []
        if state["rewrite_records"]:
            try:
                sqlite_vacuum(self.engine)  # a file from before secure_delete: rebuild it once
                tables.append("VACUUM")
            except Exception as exc:  # noqa: BLE001 - sqlite3.OperationalError: busy
                log.warning("VACUUM of the ledger failed (%s); the next maintenance retries", exc)
                return "blocked", tables
        tables.append("wal_checkpoint(TRUNCATE)")
        return ("erased" if sqlite_checkpoint(self.engine) else "blocked"), tables

    def _pg_maintenance(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        tables: list[Any] = [PAYLOADS] + ([RECORDS] if state["rewrite_records"] else [])
        tables += [t for t in state["pending_tables"] if t not in {PAYLOADS.name, RECORDS.name}]
        with self.engine.connect() as c:
            conn = c.execution_options(isolation_level="AUTOCOMMIT")
            if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                {"k": _MAINTENANCE_LOCK_KEY}).scalar():
                return "busy", []
            try:
                conn.exec_driver_sql(f"SET lock_timeout = '{int(_PG_LOCK_TIMEOUT_S * 1000)}ms'")
                horizons = {}
                for t in tables:
                    name = getattr(t, "name", t)
                    try:
                        horizons[name] = pg_vacuum_full(conn, t)
                    except DBAPIError as exc:
                        code = getattr(exc.orig, "sqlstate", None)
                        if code == "42P01":  # undefined_table: gone, nothing left to erase
                            log.warning("purge maintenance: no table %s to rewrite", name)
                            continue
                        if code != "55P03":  # lock_not_available
                            raise
                        log.warning("VACUUM FULL %s waited over %.0f s for its lock; the next "
                                    "maintenance retries", name, _PG_LOCK_TIMEOUT_S)
                        return "locked", list(horizons)
                xid = state["last_purge_xid"]
                held = [n for n, frozen in horizons.items()
                        if xid is not None and not xid_precedes(xid, frozen)]
                if held:
                    log.warning("VACUUM FULL %s kept the latest purge's rows: a snapshot older "
                                "than the purge is still open (%s), or this role does not own "
                                "the table (VACUUM skipped it); the next maintenance retries",
                                ", ".join(held), _snapshot_holders(conn))
                    return "held", list(horizons)
                return "erased", list(horizons)
            finally:
                conn.exec_driver_sql("RESET lock_timeout")
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MAINTENANCE_LOCK_KEY})

    def _record_maintenance(self, state: dict[str, Any], outcome: str) -> None:
        """Write down the run; an erasing run covers the purges counted before it started."""
        now = utc_now()
        values: dict[str, Any] = {"last_run_at": now, "last_outcome": outcome}
        with writing(self.engine) as conn:
            if outcome == "erased":
                values.update(erased=case((MAINTENANCE.c.erased < state["purges"],
                                           state["purges"]), else_=MAINTENANCE.c.erased),
                              last_erased_at=now)
                if state["rewrite_records"]:
                    values["rewrite_records"] = False
                if state["pending_tables"]:  # keep what a purge since added
                    now_pending = conn.execute(select(MAINTENANCE.c.pending_tables)
                                               .where(MAINTENANCE.c.id == 1)).scalar() or []
                    values["pending_tables"] = [t for t in now_pending
                                                if t not in state["pending_tables"]]
            conn.execute(upsert(conn, MAINTENANCE, {"id": 1, "purges": 0, "erased": 0,
                                                    "rewrite_records": False,
                                                    "last_run_at": now, "last_outcome": outcome},
                                values))

    @staticmethod
    def _note_purge(conn: Connection, now: datetime, rewrite_records: bool = False,
                    tables: Sequence[str] = ()) -> None:
        """Count a purging transaction (and on PostgreSQL its xid) for purge maintenance."""
        values: dict[str, Any] = {"last_purge_at": now, "last_purge_xid": None}
        new_xid: dict[str, Any] = {}
        if conn.dialect.name == "postgresql":
            values["last_purge_xid"] = func.txid_current()
            # the largest purge xid, whatever order concurrent purges commit in
            new_xid["last_purge_xid"] = func.greatest(MAINTENANCE.c.last_purge_xid,
                                                      func.txid_current())
        if rewrite_records:
            values["rewrite_records"] = True
        if tables:
            pending = conn.execute(select(MAINTENANCE.c.pending_tables)
                                   .where(MAINTENANCE.c.id == 1)).scalar() or []
            values["pending_tables"] = sorted({*pending, *tables})
        conn.execute(upsert(conn, MAINTENANCE,
                            {"id": 1, "purges": 1, "erased": 0, "rewrite_records": False,
                             **values},
                            {"purges": MAINTENANCE.c.purges + 1, **values, **new_xid}))

    def _migrate_payloads(self) -> None:
        """Move raw data out of a `training_records` table from before `record_payloads`.

        Copies live and pending records' features and labels, drops the two columns and
        asks purge maintenance for one rewrite of the whole table (PostgreSQL: VACUUM
        FULL training_records; SQLite: VACUUM), which takes out what earlier purges
        left in dead tuples or free space.
        """
        def legacy(bind: Any) -> bool:
            return "features" in {c["name"] for c in inspect(bind).get_columns(RECORDS.name)}

        if not legacy(self.engine):
            return
        with writing(self.engine) as conn:
            if not legacy(conn):  # another process migrated it meanwhile
                return
            moved = conn.execute(text(
                "INSERT INTO record_payloads (record_id, features, label) "
                "SELECT r.record_id, r.features, r.label FROM training_records r "
                "WHERE r.state <> 'purged' AND r.features IS NOT NULL AND r.label IS NOT NULL "
                "AND NOT EXISTS (SELECT 1 FROM record_payloads p "
                "WHERE p.record_id = r.record_id)")).rowcount
            for column in ("features", "label"):
                conn.execute(text(f"ALTER TABLE training_records DROP COLUMN {column}"))
            self._note_purge(conn, utc_now(), rewrite_records=True)
        log.warning("moved the raw data of %d record(s) from training_records to record_payloads;"
                    " the next purge maintenance rewrites training_records", moved)

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
            for rec in conn.execution_options(yield_per=5000).execute(
                    select(RECORDS, PAYLOADS.c.features, PAYLOADS.c.label,
                           PAYLOADS.c.record_id.label("payload_of"))
                    .select_from(RECORDS.outerjoin(PAYLOADS,
                                                   PAYLOADS.c.record_id == RECORDS.c.record_id))):
                n_records += 1
                problems.extend(self._check_record(rec))
            for rid in conn.execute(
                    select(PAYLOADS.c.record_id)
                    .select_from(PAYLOADS.outerjoin(RECORDS,
                                                    RECORDS.c.record_id == PAYLOADS.c.record_id))
                    .where(RECORDS.c.record_id.is_(None))).scalars():
                problems.append(Problem(f"record {rid}", "raw features and label in "
                                        "record_payloads belong to no training record"))
        return VerifyResult(not problems, n_events, len(checkpoints), n_records, problems)

    # ------------------------------------------------------------------ internals
    def _check_record(self, rec: Any) -> list[Problem]:
        where = f"record {rec.record_id}"
        if rec.state == "purged":
            if rec.payload_of is not None:
                return [Problem(where, "is purged but still holds raw features or label "
                                       "(a row in record_payloads)")]
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
               now: datetime) -> tuple[dict[str, str], int]:
        """Delete the records' raw data; (their fingerprints, how many payload rows went)."""
        ids = list(record_ids)
        fps = dict(conn.execute(select(RECORDS.c.record_id, RECORDS.c.record_hash)
                                .where(RECORDS.c.record_id.in_(ids))).all())
        n = conn.execute(delete(PAYLOADS).where(PAYLOADS.c.record_id.in_(ids))).rowcount
        conn.execute(update(RECORDS)
                     .where(RECORDS.c.record_id.in_(ids), RECORDS.c.state != "purged")
                     .values(state="purged", purged_at=now, purged_by=request_id))
        return fps, n

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
        self.payload_rows: list[dict[str, Any]] = []
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
                    "record_id": r.record_id, "subject_id": p.subject_id, "record_hash": fp,
                    "state": "pending", "added_by": p.request_id})
                self.payload_rows.append({"record_id": r.record_id, "features": r.features,
                                          "label": r.label})
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
        insert_rows(conn, PAYLOADS, self.payload_rows)
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


def _snapshot_holders(conn: Connection) -> str:
    """What may hold PostgreSQL's xmin horizon back: the oldest snapshots, slots, 2PC."""
    found = [f"pid {r.pid} ({r.usename}, {r.state}, since {r.xact_start})" for r in conn.execute(
        text("SELECT pid, usename, state, xact_start FROM pg_stat_activity "
             "WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() "
             "ORDER BY age(backend_xmin) DESC LIMIT 3"))]
    found += [f"replication slot {n}" for n in conn.execute(text(
        "SELECT slot_name FROM pg_replication_slots WHERE xmin IS NOT NULL "
        "OR catalog_xmin IS NOT NULL")).scalars()]
    found += [f"prepared transaction {g}" for g in conn.execute(text(
        "SELECT gid FROM pg_prepared_xacts")).scalars()]
    return "; ".join(found) or "none visible to this role"


def _few(ids: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(i) for i in ids[:n])
    return shown + (f" and {len(ids) - n} more" if len(ids) > n else "")
