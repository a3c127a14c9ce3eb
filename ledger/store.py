"""The ledger: the source of truth for every deletion and addition request.

Every state change is an event appended to the hash chain in the same
transaction as the change itself, so the log and the working tables can never
disagree after a crash. The request lifecycle is
received -> claimed -> applied -> verified, or rejected / failed with a reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import numpy as np
from sqlalchemy import Connection, case, delete, func, insert, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session

from ledger import intake_metrics as metrics
from ledger import merkle, migrations
from ledger.appender import ChainAppender
from ledger.chain import (
    GENESIS_HASH,
    as_utc,
    event_hash,
    event_leaf,
    iso,
    record_fingerprint,
    utc_now,
)
from ledger.db import (
    insert_rows,
    make_engine,
    pg_vacuum_full,
    sqlite_checkpoint,
    sqlite_vacuum,
    upsert,
    writing,
    xid_precedes,
)
from ledger.heads import ROTATION_KIND, HeadSigner, KeyChain, log_id, verify_head
from ledger.intake import (
    BatchIntake,
    IncomingMessage,
    IntakeResult,
    RejectHook,
    Unstorable,
    caused_by_input,
    first_line,
    message_bytes,
    parse_message,
)
from ledger.keystore import KeyStore, LedgerKeys
from ledger.log_check import LogFacts, Problem, VerifyResult, schema_sha256
from ledger.models import (
    REQUEST_STATUSES,
    Checkpoint,
    DatasetSchema,
    Request,
)
from ledger.sealed_payloads import PayloadKeyMissing, PayloadSealer, live_sealed, sealed_rows
from ledger.signing import SigningKeyRefused, SigningKeys, head_dict
from ledger.tables import (
    CHECKPOINTS,
    EVENTS,
    HEADS,
    LOOKUP_CHUNK,
    MAINTENANCE,
    OFFSETS,
    PAYLOADS,
    RECORDS,
    REQUESTS,
    SEALED,
)
from ledger.transform import InputTransform
from ledger.validation import InvalidRequest, RequestMessage

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
class LiveRecords:
    """The training set as the ledger holds it now (records neither pending nor purged)."""

    record_ids: np.ndarray
    subject_ids: np.ndarray
    X: np.ndarray
    y: np.ndarray


class Ledger:
    """Append-only, hash-chained request ledger over SQLite or PostgreSQL."""

    def __init__(self, url: str, hmac_key: bytes, checkpoint_every: int = 1000,
                 purge_maintenance_s: float | None = None, signing_key: bytes | None = None,
                 head_interval_s: float = 60.0, public_key: bytes | None = None,
                 key_store: KeyStore | None = None) -> None:
        """`signing_key` (the Ed25519 seed, kept outside the database) signs the tree heads
        taken every `checkpoint_every` events and once events are `head_interval_s` old;
        without it the heads are plain checkpoints. `public_key` lets a ledger without
        the signing key check the heads' signatures. `key_store` keeps the keys of added
        records' payloads and of model versions (default: OBLIVIATE_KEY_STORE_DIR's)."""
        if len(hmac_key) < 16:
            raise ValueError("the HMAC key must be at least 16 bytes")
        self.url = url
        self.engine = make_engine(url)
        self.keys = LedgerKeys(self.engine, key_store)
        # the schema is Alembic's (ledger.migrations): to head, or one SELECT once there
        self.schema_upgrade = migrations.upgrade(self.engine, self.keys.store)
        self.checkpoint_every = checkpoint_every
        # minimum seconds between two purge maintenance runs (None: the backend's default)
        self.purge_maintenance_s = float(
            PURGE_MAINTENANCE_DEFAULT_S.get(self.engine.dialect.name, 0.0)
            if purge_maintenance_s is None else purge_maintenance_s)
        self._key = hmac_key
        self.sealer = PayloadSealer(self.keys, hmac_key)
        self._schema: DatasetSchema | None = None
        if not head_interval_s > 0:
            raise ValueError(f"head_interval_s must be > 0 seconds, got {head_interval_s}")
        self.head_interval_s = float(head_interval_s)
        self._signing = SigningKeys(HeadSigner(signing_key) if signing_key is not None else None,
                                 public_key)
        self._next_head_check = 0.0  # monotonic time before which maybe_sign_head is a no-op

    def close(self) -> None:
        self.engine.dispose()

    @property
    def _signer(self) -> HeadSigner | None:
        return self._signing.signer

    @property
    def public_key(self) -> bytes | None:
        """The public half of the key this process signs (or checks) the heads with."""
        return self._signing.public_key

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

    def input_transform(self) -> InputTransform | None:
        """The transform from raw features to the model's input space (None before init)."""
        schema = self.schema()
        return None if schema is None else schema.input_transform

    def load_records(self, record_ids: Sequence[str], subject_ids: Sequence[str | None],
                     X: np.ndarray, y: np.ndarray, name: str = "dataset",
                     transform: InputTransform | None = None) -> int:
        """Seed the record store (the initial training set); returns the event's seq.

        `X` is in the model's input space already (`transform.scale` of the raw table);
        `transform` is stored with the schema by the first load (None: the identity,
        for features that were scaled elsewhere). A later load must bring the same
        transform, or none.
        """
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(y)
        n = len(record_ids)
        if X.ndim != 2 or len(X) != n or len(y) != n or len(subject_ids) != n:
            raise ValueError("record_ids, subject_ids, X (2-D) and y must have the same length")
        if not np.all(np.isfinite(X)):
            bad = np.argwhere(~np.isfinite(X))[0]
            raise ValueError(f"X contains NaN or infinite values: row {int(bad[0])}, "
                             f"feature {int(bad[1])} is {X[bad[0], bad[1]]}")
        if transform is not None and transform.n_features != X.shape[1]:
            raise ValueError(f"the input transform has {transform.n_features} features, "
                             f"the data {X.shape[1]}")
        ids = [str(r) for r in record_ids]
        if len(set(ids)) != n:
            raise ValueError("record_ids must be unique")
        classes = sorted(int(c) for c in np.unique(y))
        now = utc_now()
        with writing(self.engine) as conn:
            schema = conn.execute(select(DatasetSchema.__table__)).first()
            if schema is None:
                stored = transform or InputTransform.identity(X.shape[1])
                conn.execute(insert(DatasetSchema.__table__),
                             {"id": 1, "name": name, "n_features": X.shape[1], "classes": classes,
                              "transform": stored.to_json()})
                digest = schema_sha256(X.shape[1], classes, stored.to_json())
            elif schema.n_features != X.shape[1] or not set(classes) <= set(schema.classes):
                raise ValueError(f"data does not match the ledger's schema {schema.name!r} "
                                 f"({schema.n_features} features, classes {schema.classes})")
            elif transform is not None and not transform.same_as(
                    InputTransform.from_json(schema.transform, schema.n_features)):
                raise ValueError("the ledger's input transform was fixed by its first load; "
                                 "scale the new table with it (`obliviate ledger init` does)")
            else:
                digest = schema_sha256(schema.n_features, schema.classes, schema.transform)
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
            appender = ChainAppender(conn)
            seq = appender.append("records_loaded", None, {
                "name": name, "count": n, "n_features": X.shape[1], "classes": classes,
                "records_root": merkle.root([merkle.leaf_hash(f) for f in fingerprints]).hex(),
                # what every query and addition means (the input transform, classes, width):
                # `verify` holds the schema row to it
                "schema_sha256": digest,
            }, iso(now))
            appender.flush(conn)
            self._maybe_checkpoint(conn, appender.seq)
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
            sealed = live_sealed(conn) if any(r.features is None for r in rows) else {}
        data = [(r.features, r.label) if r.features is not None
                else self._open_sealed(r.record_id, sealed) for r in rows]
        missing = [r.record_id for r, d in zip(rows, data, strict=True) if d is None]
        if missing:
            raise ValueError(f"{len(missing)} live record(s) hold no data, e.g. {missing[0]!r} "
                             "(`obliviate ledger verify` names them all)")
        n_features = self.schema().n_features if self.schema() else 0
        return LiveRecords(
            record_ids=np.array([r.record_id for r in rows], dtype=object),
            subject_ids=np.array([r.subject_id for r in rows], dtype=object),
            X=np.array([d[0] for d in data], dtype=np.float64).reshape(len(rows), n_features),
            y=np.array([d[1] for d in data], dtype=np.int64),
        )

    def record_data(self, record_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Features and labels of records, in the order given (an add's payload)."""
        ids = [str(r) for r in record_ids]
        found: dict[str, tuple[list[float], int] | None] = {}
        with self.engine.connect() as conn:
            for i in range(0, len(ids), LOOKUP_CHUNK):
                for r in conn.execute(select(PAYLOADS)
                                      .where(PAYLOADS.c.record_id.in_(ids[i:i + LOOKUP_CHUNK]))):
                    found[r.record_id] = (r.features, r.label)
            rest = [r for r in ids if r not in found]
            sealed = sealed_rows(conn, rest) if rest else {}
        for r in rest:
            found[r] = self._open_sealed(r, sealed)
        missing = [r for r in ids if found[r] is None]
        if missing:
            raise KeyError(f"{len(missing)} record(s) hold no data, e.g. {missing[0]!r}")
        n_features = self.schema().n_features
        X = np.array([found[r][0] for r in ids], dtype=np.float64).reshape(len(ids),
                                                                          n_features)
        return X, np.array([found[r][1] for r in ids], dtype=np.int64)

    def _open_sealed(self, record_id: str, sealed: dict[str, bytes]
                     ) -> tuple[list[float], int] | None:
        """A sealed record's data; None when it has no sealed row or its key is gone."""
        blob = sealed.get(record_id)
        if blob is None:
            return None
        try:
            return self.sealer.open(record_id, blob)
        except PayloadKeyMissing:
            return None

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
            for i in range(0, len(ids), LOOKUP_CHUNK):
                fps.extend(bytes.fromhex(h) for h in conn.execute(
                    select(RECORDS.c.record_hash)
                    .where(RECORDS.c.record_id.in_(ids[i:i + LOOKUP_CHUNK]))).scalars())
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
            appender = ChainAppender(conn)
            seq = appender.append(kind, None, payload, iso(utc_now()), model_version)
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)
            self._maybe_checkpoint(conn, appender.seq)
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

    def intake_counts(self) -> dict[str, int]:
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

        No input makes this raise: a message that cannot be parsed is rejected, and
        a batch the database refuses for a reason of one message's making (a
        DataError, say, for what validation let through) is recorded again message
        by message, the one it fails on rejected with the error's first line.
        Errors of the database itself (OperationalError) and of `before_commit` do
        propagate, with nothing recorded.
        """
        schema = self.schema()
        parsed = [parse_message(m.value, schema) for m in messages]
        results = self._record_batch(messages, parsed, before_commit)
        for (op, status), n in Counter((r.op or "unknown", r.status) for r in results).items():
            metrics.REQUESTS.labels(op=op, status=status).inc(n)
        return results

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
                intake = BatchIntake(self._key, conn, parsed, now, now_s, sealer=self.sealer)
                results = [intake.handle(m, p) for m, p in zip(messages, parsed, strict=True)]
                intake.write(conn)
            except Exception as exc:
                if caused_by_input(exc, self.engine.dialect.dbapi):
                    raise Unstorable(first_line(exc)) from exc
                raise
            self._maybe_checkpoint(conn, intake.appender.seq)
            rejected = [(m, r) for m, r in zip(messages, results, strict=True)
                        if r.status == "rejected"]
            if rejected and before_commit is not None:
                before_commit(rejected)
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
            appender = ChainAppender(conn)
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
            self._maybe_checkpoint(conn, appender.seq)
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
        purged, sealed = 0, []
        with writing(self.engine) as conn:
            now = utc_now()
            reqs = self._requests_in_state(conn, request_ids, "claimed", "applied")
            appender = ChainAppender(conn)
            for r in reqs:
                if r.op == "delete":
                    fps, n, keyed = self._purge(conn, r.record_ids, r.request_id, now)
                    purged += n
                    sealed += keyed
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
            self._maybe_checkpoint(conn, appender.seq)
        # crypto-shredding: every copy of their sealed rows (WAL, backups) is unreadable now;
        # a crash before this line leaves keys that the next maintenance sweeps
        self.sealer.destroy(sealed)
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

    def purge_maintenance(self, force: bool = False) -> dict[str, Any]:
        """Make the bytes of purged records leave the database's files.

        SQLite: a TRUNCATE checkpoint (secure_delete has zeroed the purged rows in
        their pages; the checkpoint writes those pages into the database file and
        empties the WAL that still holds older copies). PostgreSQL: VACUUM FULL of
        `record_payloads` and `sealed_payloads`, which rewrites them,
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
            swept = self.sealer.sweep(self.engine)
            if swept:
                log.warning("destroyed %d payload key(s) of purged records that a crash had "
                            "left in the key store", swept)
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
        tables: list[Any] = [PAYLOADS, SEALED] + ([RECORDS] if state["rewrite_records"] else [])
        tables += [t for t in state["pending_tables"]
                   if t not in {PAYLOADS.name, SEALED.name, RECORDS.name}]
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
    def _note_purge(conn: Connection, now: datetime) -> None:
        """Count a purging transaction (and on PostgreSQL its xid) for purge maintenance."""
        values: dict[str, Any] = {"last_purge_at": now, "last_purge_xid": None}
        new_xid: dict[str, Any] = {}
        if conn.dialect.name == "postgresql":
            values["last_purge_xid"] = func.txid_current()
            # the largest purge xid, whatever order concurrent purges commit in
            new_xid["last_purge_xid"] = func.greatest(MAINTENANCE.c.last_purge_xid,
                                                      func.txid_current())
        conn.execute(upsert(conn, MAINTENANCE,
                            {"id": 1, "purges": 1, "erased": 0, "rewrite_records": False,
                             **values},
                            {"purges": MAINTENANCE.c.purges + 1, **values, **new_xid}))

    def mark_verified(self, request_ids: Sequence[str], model_version: str,
                      detail: dict[str, Any] | None = None,
                      in_transaction: Callable[[Connection], None] | None = None,
                      skip_settled: bool = False) -> None:
        """Mark applied requests verified on `model_version`; with `skip_settled`, requests
        no longer `applied` (another worker verified them) are left as they are instead
        of refused."""
        with writing(self.engine) as conn:
            reqs = self._requests_in_state(conn, request_ids, "applied", "verified",
                                           skip_settled)
            request_ids = [r.request_id for r in reqs]
            appender = ChainAppender(conn)
            now_s = iso(utc_now())
            for rid in request_ids:
                appender.append("verified", rid, detail or {}, now_s, model_version)
            self._set_status(conn, request_ids, "verified")
            if in_transaction is not None:
                in_transaction(conn)
            appender.flush(conn)
            self._maybe_checkpoint(conn, appender.seq)

    def mark_failed(self, request_id: str, reason: str) -> None:
        with writing(self.engine) as conn:
            self._requests_in_state(conn, [request_id], "claimed", "failed")
            appender = ChainAppender(conn)
            appender.append("failed", request_id, {"reason": reason}, iso(utc_now()))
            self._set_status(conn, [request_id], "failed")
            appender.flush(conn)
            self._maybe_checkpoint(conn, appender.seq)

    # ------------------------------------------------------------------ audit
    def checkpoint(self) -> Checkpoint | None:
        """Publish a tree head over every event so far (no-op if the last one covers them);
        signed when the ledger has its signing key."""
        with writing(self.engine) as conn:
            size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
            self._take_head(conn, size)
            self._write_checkpoint(conn, size)  # no-op unless the head was refused
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
        proofs = self.inclusion_proofs([e.seq for e in events], head.tree_size)
        out_events = [{**_event_dict(e), "inclusion_proof": proofs[e.seq]} for e in events]
        request = None
        if req is not None:
            request = {k: v for k, v in req._mapping.items() if k != "id"}
            for k in ("received_at", "claimed_at"):
                if request[k] is not None:
                    request[k] = iso(request[k])
        return {"request": request, "events": out_events,
                "tree_head": {"tree_size": head.tree_size, "root_hash": head.root_hash,
                              "created_at": head.created_at,
                              "signed": self._head_at(head.tree_size)}}

    def inclusion_proofs(self, seqs: Sequence[int], tree_size: int) -> dict[int, list[str]]:
        """The inclusion proof of each of events `seqs` in the tree of the first
        `tree_size` events (hex hashes)."""
        with self.engine.connect() as conn:
            leaves = [event_leaf(h) for h in conn.execution_options(yield_per=20_000).execute(
                select(EVENTS.c.hash).where(EVENTS.c.seq <= tree_size)
                .order_by(EVENTS.c.seq)).scalars()]
        return {s: [p.hex() for p in merkle.inclusion_proof(leaves, s - 1)] for s in seqs}

    def receipt_token(self, request_id: str) -> str:
        """The token that lets a request's subject fetch its deletion receipt: an HMAC of
        the request id under the deployment secret, so nothing is stored for it."""
        return hmac.new(self._key, b"obliviate receipt token\0" + request_id.encode(),
                        hashlib.sha256).hexdigest()

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

    # ------------------------------------------------------------------ signed heads
    def published_heads(self, since: int = 0, limit: int | None = None) -> dict[str, Any]:
        """The signed heads over more than `since` events (the newest `limit`, oldest
        first), each naming its key, with the log's current public key and its key
        rotations: what `ledger heads` prints and auditors save."""
        q = select(HEADS).where(HEADS.c.tree_size > since)
        with self.engine.connect() as conn:
            chain, rotations = self._published_keys(conn)
            if chain is not None:
                q = q.where(HEADS.c.log_id.in_(list(chain.log_ids())))
            q = q.order_by(HEADS.c.tree_size.desc())
            rows = conn.execute(q if limit is None else q.limit(limit)).all()
        current = None if chain is None else chain.current
        return {"format": "obliviate-tree-heads/v1",
                "log_id": None if current is None else log_id(current),
                "public_key": None if current is None else current.hex(),
                "heads": [self._signing.named(head_dict(r)) for r in reversed(rows)],
                "rotations": rotations}

    def _published_keys(self, conn: Connection, upto: int | None = None
                        ) -> tuple[KeyChain | None, list[dict[str, Any]]]:
        """The chain of this log's keys (None without a key or a rotation) and the
        rotation records (over at most `upto` events) that lead along it, for auditors."""
        chain, _ = self._signing.chain(conn)
        return chain, self._signing.records(conn, upto)

    def signing_log(self) -> str | None:
        """The log id of the key that signs this ledger now (None before its first head)."""
        with self.engine.connect() as conn:
            return self._signing.current_log(conn)

    def use_signing_key(self, seed: bytes) -> None:
        """Sign this ledger's heads with `seed` from now on. SigningKeyRefused when that
        would give it a second signing identity: its heads belong to another key, or a
        key rotation retired this one."""
        signer = HeadSigner(seed)
        keys = SigningKeys(signer, None)
        with self.engine.connect() as conn:
            why = keys.refusal(conn)
        if why:
            raise SigningKeyRefused(f"{why}; every process of a deployment signs with its one "
                                    "key: give this one that key (OBLIVIATE_LEDGER_SIGNING_KEY_"
                                    "HEX or _FILE), or hand the log over with `obliviate "
                                    "ledger rotate-key`")
        self._signing = keys

    def rotate_key(self, new_seed: bytes) -> dict[str, Any]:
        """Hand the log over to a new signing key. One transaction appends a
        `key_rotated` event naming the new public key, signed by the current key, and that
        key's head over exactly that event; every later head is the new key's, and a
        process still holding the old key stops signing (and refuses to start): give
        every process the new key. Returns the event's seq and the old key's last head."""
        old = self._signer
        if old is None:
            raise ValueError("rotating the signing key needs the current one")
        new = HeadSigner(new_seed)
        if new.public_key == old.public_key:
            raise ValueError("the new signing key is the current one")
        try:
            with writing(self.engine) as conn:
                why = self._signing.refusal(conn)
                if why:
                    raise SigningKeyRefused(why)
                appender = ChainAppender(conn)
                payload = old.rotation(new.public_key, appender.seq + 1, appender.prev)
                seq = appender.append(ROTATION_KIND, None, payload, iso(utc_now()))
                appender.flush(conn)
                head = self._take_head(conn, seq)
                if head is None:
                    raise RuntimeError("the current key could not sign a head over the "
                                       "rotation (the log says why): nothing was rotated")
        except BaseException:
            self._signing.forget()  # the rotation event read inside the transaction is gone
            raise
        self._signing.use(new)
        return {"seq": seq, "head": head, "public_key": new.public_key.hex(),
                "log_id": new.log_id}

    def sign_head(self) -> dict[str, Any] | None:
        """A signed head over every event now (the latest one if it covers them already);
        None without a signing key or events, or when signing is refused (logged)."""
        if self._signer is None:
            return None
        with writing(self.engine) as conn:
            size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
            if size == 0:
                return None
            return self._take_head(conn, size) or self._signing.head_at(conn, size)

    def maybe_sign_head(self) -> dict[str, Any] | None:
        """Take a head if one is due: `checkpoint_every` events, or events older than
        `head_interval_s`, not covered yet. Every long-running process calls this from its
        loop (appends take heads when due too, but an idle log needs the timer). Cheap:
        at most one look at the database a second, none at all in between. Never raises
        (a database that cannot be reached is logged; the next call tries again)."""
        now = time.monotonic()
        if now < self._next_head_check:
            return None
        self._next_head_check = now + min(1.0, self.head_interval_s / 4)
        try:
            with self.engine.connect() as conn:
                size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
                if not self._head_due(conn, size):
                    return None
            with writing(self.engine) as conn:
                size = conn.execute(select(func.max(EVENTS.c.seq))).scalar() or 0
                if not self._head_due(conn, size):  # another process took it meanwhile
                    return None
                return self._take_head(conn, size)
        except Exception:  # noqa: BLE001 - a loop's housekeeping must not end the loop
            log.exception("taking a tree head failed; the next call retries")
            return None

    def consistency(self, old_size: int, new_size: int) -> dict[str, Any]:
        """RFC 6962 consistency proof that events 1..old_size are a prefix of 1..new_size,
        with both roots as the events give them now (an auditor compares those with the
        signed heads it holds, never trusts them). ValueError for impossible sizes."""
        last = self.last_seq()
        if not 0 <= old_size <= new_size <= last:
            raise ValueError(f"need 0 <= old <= new <= {last} (the log's size); "
                             f"got old={old_size}, new={new_size}")
        with self.engine.connect() as conn:
            leaves = [event_leaf(h) for h in conn.execution_options(yield_per=20_000).execute(
                select(EVENTS.c.hash).where(EVENTS.c.seq <= new_size)
                .order_by(EVENTS.c.seq)).scalars()]
            if len(leaves) != new_size:
                raise ValueError(f"events 1..{new_size} are not all there ({len(leaves)} "
                                 "found)")
            _, rotations = self._published_keys(conn, new_size)
            heads = (self._signing.head_at(conn, old_size), self._signing.head_at(conn, new_size))
        return {"old_size": old_size, "new_size": new_size,
                "old_root": merkle.root(leaves[:old_size]).hex(),
                "new_root": merkle.root(leaves).hex(),
                "proof": [p.hex() for p in merkle.consistency_proof(leaves, old_size)],
                "old_head": heads[0], "new_head": heads[1], "rotations": rotations}

    def verify(self) -> VerifyResult:
        """Recompute the chain, every checkpoint and signed head, every record fingerprint,
        and hold the requests and records to what the events say happened to them."""
        problems: list[Problem] = []
        notes: list[str] = []
        facts = LogFacts()
        with self.engine.connect() as conn:
            self.keys.scope(conn)  # read here: on SQLite a second connection would wait
            checkpoints = {r.tree_size: r.root_hash for r in conn.execute(select(CHECKPOINTS))}
            heads = {r.tree_size: r for r in conn.execute(select(HEADS))}
            covered = self._check_heads(conn, heads, checkpoints, problems, notes)
            first_uncovered = last_at = None
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
                head = heads.get(frontier.size)
                if head is not None and head.root_hash != frontier.root().hex():
                    problems.append(Problem(f"signed head {frontier.size}", "Merkle root does "
                                            "not match the events it covers (the log was "
                                            "rewritten)", frontier.size))
                if e.request_id and e.kind in REQUEST_STATUSES:
                    last_kind[e.request_id] = e.kind
                facts.see(e, problems)
                if e.seq == covered + 1:
                    first_uncovered = e.created_at
                last_at = e.created_at
            n_events = frontier.size
            for size in sorted(s for s in checkpoints if s > n_events):
                problems.append(Problem(f"checkpoint {size}", f"covers {size} events but the log "
                                        f"has {n_events} (events removed?)", n_events + 1))
            for size in sorted(s for s in heads if s > n_events):
                problems.append(Problem(f"signed head {size}", f"covers {size} events but the "
                                        f"log has {n_events} (events removed)", n_events + 1))
            self._check_tail(covered, n_events, first_uncovered, last_at, bool(heads)
                             or self.public_key is not None, problems, notes)
            status_of: dict[str, str] = {}
            for r in conn.execute(select(REQUESTS.c.request_id, REQUESTS.c.status,
                                         REQUESTS.c.received_seq)):
                status_of[r.request_id] = r.status
                if last_kind.get(r.request_id) != r.status:
                    problems.append(Problem(f"request {r.request_id}", f"status {r.status!r} "
                                            f"disagrees with its last event "
                                            f"{last_kind.get(r.request_id)!r}"))
                problems.extend(facts.check_request(r))
            problems.extend(facts.requests_without_rows(status_of))
            n_records = 0
            for rec in conn.execution_options(yield_per=5000).execute(
                    select(RECORDS, PAYLOADS.c.features, PAYLOADS.c.label,
                           PAYLOADS.c.record_id.label("payload_of"), SEALED.c.sealed)
                    .select_from(RECORDS.outerjoin(PAYLOADS,
                                                   PAYLOADS.c.record_id == RECORDS.c.record_id)
                                 .outerjoin(SEALED, SEALED.c.record_id == RECORDS.c.record_id))):
                n_records += 1
                problems.extend(self._check_record(rec))
                problems.extend(facts.check_record(rec, status_of))
            problems.extend(facts.check_loaded())
            problems.extend(facts.check_schema(
                conn.execute(select(DatasetSchema.__table__)).first(), notes))
            problems.extend(facts.check_offsets(conn.execute(select(OFFSETS)).all()))
            for table in (PAYLOADS, SEALED):
                for rid in conn.execute(
                        select(table.c.record_id)
                        .select_from(table.outerjoin(RECORDS,
                                                     RECORDS.c.record_id == table.c.record_id))
                        .where(RECORDS.c.record_id.is_(None))).scalars():
                    problems.append(Problem(f"record {rid}", "raw features and label in "
                                            f"{table.name} belong to no training record"))
        return VerifyResult(not problems, n_events, len(checkpoints), n_records, problems,
                            heads=len(heads), notes=notes)

    def _check_heads(self, conn: Connection, heads: dict[int, Any],
                     checkpoints: dict[int, str], problems: list[Problem],
                     notes: list[str]) -> int:
        """Signatures of the signed heads, each by the key that signs its size (the key
        rotations followed, and leading through this process's key); returns how many
        events the heads (or, on a ledger that never had a signing key, the checkpoints)
        cover."""
        chain = None
        if self.public_key is None:
            if heads:
                notes.append("no public key: the signed heads' signatures were not checked "
                             "(set the signing key, or check them with `obliviate audit check`)")
            else:
                notes.append("no signing key: the checkpoints are not signed, so whoever can "
                             "write to the database can rewrite the log and its checkpoints")
                return max(checkpoints, default=0)
        else:
            chain, why = self._signing.chain(conn, fresh=True)
            problems.extend(Problem("signing keys", w) for w in why)
            if chain is not None and chain.current != self.public_key \
                    and self.public_key in chain.keys:
                notes.append(f"this process's key (log {log_id(self.public_key)[:16]}...) was "
                             "retired by a key rotation: give it the current key")
        good = []
        for size, row in sorted(heads.items()):
            why = None if chain is None else chain.check_head(head_dict(row))
            if why:
                problems.append(Problem(f"signed head {size}", why))
            else:
                good.append(size)
        return max(good, default=0)

    def _check_tail(self, covered: int, n_events: int, first_at: str | None,
                    last_at: str | None, signed: bool, problems: list[Problem],
                    notes: list[str]) -> None:
        """Events after the latest head: no one can check them yet, but none of them may
        be `head_interval_s` older than the newest event: every append takes a head once
        the oldest uncovered event is that old, so a longer tail had its heads dropped.
        (The writers' OBLIVIATE_HEAD_INTERVAL_S is assumed; `checkpoint_every` is not
        held to, since processes may differ in it.)"""
        if covered >= n_events:
            return
        what = "signed head" if signed else "checkpoint"
        n = n_events - covered
        try:
            span = (_parse_time(last_at) - _parse_time(first_at)).total_seconds()
        except (TypeError, ValueError):
            span = float("inf")
        if span >= self.head_interval_s:
            problems.append(Problem(
                f"events {covered + 1}..{n_events}", f"no {what} covers these {n} events over "
                f"{span:.1f} s, though one is taken once events are {self.head_interval_s:g} s "
                "old: heads dropped, or written by something that takes none", covered + 1))
        else:
            notes.append(f"events {covered + 1}..{n_events} ({n}) come after the latest {what}: "
                         "nothing can check an unsigned tail until the next head covers it")

    # ------------------------------------------------------------------ internals
    def _check_record(self, rec: Any) -> list[Problem]:
        where = f"record {rec.record_id}"
        if rec.state == "purged":
            if rec.payload_of is not None or rec.sealed is not None:
                return [Problem(where, "is purged but still holds raw features or label "
                                       "(a row in record_payloads or sealed_payloads)")]
            if rec.added_by is not None and self.sealer.has_key(rec.record_id):
                return [Problem(where, "is purged but its payload key is still in the key "
                                       "store (copies of its sealed row would open)")]
            return []
        features, label = rec.features, rec.label
        if features is None and rec.sealed is not None:
            try:
                features, label = self.sealer.open(rec.record_id, bytes(rec.sealed))
            except (PayloadKeyMissing, ValueError) as exc:
                return [Problem(where, f"is {rec.state} but its data cannot be read: {exc}")]
        if features is None or label is None:
            return [Problem(where, f"is {rec.state} but has no features or label")]
        if record_fingerprint(self._key, rec.record_id, rec.subject_id, features,
                              label) != rec.record_hash:
            return [Problem(where, "features or label do not match its keyed fingerprint")]
        return []

    @staticmethod
    def _existing_records(conn: Connection, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(ids), LOOKUP_CHUNK):
            found.update(conn.execute(select(RECORDS.c.record_id)
                                      .where(RECORDS.c.record_id.in_(ids[i:i + LOOKUP_CHUNK])))
                         .scalars())
        return found

    @staticmethod
    def _requests_in_state(conn: Connection, request_ids: Sequence[str], state: str,
                           target: str, skip_others: bool = False) -> list[Request]:
        """The requests, locked until the transaction ends (PostgreSQL), all in `state`
        (else KeyError / ValueError; with `skip_others`, those in another state left out)."""
        rows = {r.request_id: r for r in conn.execute(
            select(REQUESTS).where(REQUESTS.c.request_id.in_(list(request_ids)))
            .with_for_update())}
        out = []
        for rid in request_ids:
            r = rows.get(rid)
            if r is None:
                raise KeyError(f"unknown request {rid!r}")
            if r.status != state:
                if skip_others:
                    continue
                raise ValueError(f"request {rid!r} is {r.status!r}; only a {state!r} request "
                                 f"can become {target!r}")
            out.append(Request.model_validate(dict(r._mapping)))
        return out

    @staticmethod
    def _set_status(conn: Connection, request_ids: Sequence[str], status: str) -> None:
        conn.execute(update(REQUESTS).where(REQUESTS.c.request_id.in_(list(request_ids)))
                     .values(status=status))

    @staticmethod
    def _purge(conn: Connection, record_ids: Sequence[str], request_id: str,
               now: datetime) -> tuple[dict[str, str], int, list[str]]:
        """Delete the records' raw data; (their fingerprints, how many payload rows went,
        the records whose sealed payload went: their keys are to be destroyed)."""
        ids = list(record_ids)
        fps = dict(conn.execute(select(RECORDS.c.record_id, RECORDS.c.record_hash)
                                .where(RECORDS.c.record_id.in_(ids))).all())
        n = conn.execute(delete(PAYLOADS).where(PAYLOADS.c.record_id.in_(ids))).rowcount
        sealed = list(conn.execute(delete(SEALED).where(SEALED.c.record_id.in_(ids))
                                   .returning(SEALED.c.record_id)).scalars())
        conn.execute(update(RECORDS)
                     .where(RECORDS.c.record_id.in_(ids), RECORDS.c.state != "purged")
                     .values(state="purged", purged_at=now, purged_by=request_id))
        return fps, n + len(sealed), sealed

    def _maybe_checkpoint(self, conn: Connection, size: int) -> None:
        """In a transaction that appended events 1..size: take a head if one is due, so
        that no event stays uncovered for `checkpoint_every` events or `head_interval_s`
        while the log grows (`verify` holds the log to that)."""
        if self._head_due(conn, size):
            try:
                self._take_head(conn, size)
            except ValueError:  # an edited hash or frontier: the change itself still commits
                log.exception("not taking a tree head over %d events; run `obliviate ledger "
                              "verify`", size)

    def _covered(self, conn: Connection) -> int:
        """Events the latest head covers: this log's signed heads, else the checkpoints."""
        if self._signer is not None:
            return self._signing.covered(conn)
        return conn.execute(select(func.max(CHECKPOINTS.c.tree_size))).scalar() or 0

    def _head_due(self, conn: Connection, size: int) -> bool:
        last = self._covered(conn)
        if size <= last:
            return False
        if size - last >= self.checkpoint_every:
            return True
        first = conn.execute(select(EVENTS.c.created_at).where(EVENTS.c.seq == last + 1)
                             ).scalar()
        try:
            return first is None or (utc_now() - _parse_time(first)).total_seconds() \
                >= self.head_interval_s
        except ValueError:  # an edited time: verify names it; a head does no harm
            return True

    def _take_head(self, conn: Connection, size: int) -> dict[str, Any] | None:
        """Sign a head over events 1..size, extending this log's latest signed head (only
        once the events after it are all there and the events up to it still give its
        signed root). Without a signing key: an unsigned checkpoint. None when nothing
        was signed; a refusal is logged (and `verify` says why). A checkpoint (the
        frontier the next heads start from) is written every `checkpoint_every` events."""
        if self._signer is None:
            self._write_checkpoint(conn, size)
            return None
        frontier = self._trusted_frontier(conn)
        if frontier is None or frontier.size >= size:
            return None
        why = self._signing.refusal(conn, size)
        if why:
            log.error("not signing a head over %d events: %s (restart this process with the "
                      "ledger's key)", size, why)
            return None
        _extend(conn, frontier, size)
        if frontier.size != size:
            log.error("not signing a head over %d events: only %d of them are there", size,
                      frontier.size)
            return None
        if conn.execute(select(HEADS.c.log_id).where(HEADS.c.tree_size == size)).first():
            log.error("not signing a head over %d events: the database holds another log's "
                      "head of that size (run `obliviate ledger verify`)", size)
            return None
        root = frontier.root().hex()
        head = self._signer.sign(size, root, iso(utc_now()))
        conn.execute(insert(HEADS), head)
        last_cp = conn.execute(select(func.max(CHECKPOINTS.c.tree_size))).scalar() or 0
        if size - last_cp >= self.checkpoint_every:
            conn.execute(insert(CHECKPOINTS), {"tree_size": size, "root_hash": root,
                                               "created_at": head["timestamp"],
                                               "frontier": [h.hex() for h in
                                                            frontier.state()[1]]})
        return head

    def _trusted_frontier(self, conn: Connection) -> merkle.MerkleFrontier | None:
        """The Merkle frontier at this log's latest signed head, once it rebuilds the root
        that head signs: from the checkpoint below it, or else from event 1. None, logged,
        when the head's signature fails or the events no longer give its root: signing
        on would vouch for a rewritten log."""
        latest = self._signing.latest_head(conn)
        if latest is None:
            return merkle.MerkleFrontier()
        row, key = latest
        why = verify_head(head_dict(row), key)
        if why:
            log.error("not signing: the latest head in the database (%d events) %s; run "
                      "`obliviate ledger verify`", row.tree_size, why)
            return None
        cp = conn.execute(select(CHECKPOINTS).where(CHECKPOINTS.c.tree_size <= row.tree_size)
                          .order_by(CHECKPOINTS.c.tree_size.desc()).limit(1)).first()
        starts = [merkle.MerkleFrontier()]
        if cp is not None:
            try:
                f = merkle.MerkleFrontier.from_state(cp.tree_size,
                                                     [bytes.fromhex(h) for h in cp.frontier])
                starts.insert(0, f)
            except (TypeError, ValueError):
                pass  # an edited frontier: start from event 1
        for f in starts:
            _extend(conn, f, row.tree_size)
            if f.size == row.tree_size and f.root().hex() == row.root_hash:
                return f
        log.error("not signing: events 1..%d no longer give the root of the signed head over "
                  "them (the log was rewritten); run `obliviate ledger verify`", row.tree_size)
        return None

    def _head_at(self, size: int) -> dict[str, Any] | None:
        """This log's signed head over exactly `size` events, if there is one."""
        with self.engine.connect() as conn:
            return self._signing.head_at(conn, size)

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


def _extend(conn: Connection, frontier: merkle.MerkleFrontier, size: int) -> None:
    """Append the leaves of events frontier.size+1..size (those that are there)."""
    for h in conn.execute(select(EVENTS.c.hash)
                          .where(EVENTS.c.seq > frontier.size, EVENTS.c.seq <= size)
                          .order_by(EVENTS.c.seq).execution_options(yield_per=20_000)
                          ).scalars():
        frontier.append(event_leaf(h))


def _parse_time(ts: str) -> datetime:
    """An event's `created_at` (ISO 8601, UTC, `Z`) as an aware datetime."""
    return as_utc(datetime.fromisoformat(ts))


def _event_dict(row: Any) -> dict[str, Any]:
    return {"seq": row.seq, "request_id": row.request_id, "kind": row.kind,
            "payload": json.loads(row.payload), "model_version": row.model_version,
            "created_at": row.created_at, "prev_hash": row.prev_hash, "hash": row.hash}


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
