"""The record store: the training set as the ledger holds it.

Each record is a row with its state (pending, live, purged) and keyed fingerprint;
its features and label are a plain payload row (loaded records) or a sealed one
(additions, :mod:`ledger.sealed_payloads`). A purge deletes the data and keeps the
fingerprint, so what was deleted stays provable without being kept.
See docs/ledger.md (Tables)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from sqlalchemy import Connection, Engine, bindparam, delete, insert, select, update
from sqlmodel import Session

from ledger import merkle
from ledger.appender import ChainAppender
from ledger.chain import FEATURES_DTYPE, feature_bytes, iso, stored_record_fingerprint, utc_now
from ledger.db import bind_value, insert_params, writing
from ledger.log_check import schema_sha256
from ledger.models import DatasetSchema
from ledger.sealed_payloads import PayloadKeyMissing, PayloadSealer, live_sealed, sealed_rows
from ledger.tables import LOOKUP_CHUNK, PAYLOADS, RECORDS, SEALED
from ledger.training_digest import TrainingSetDigest
from ledger.transform import InputTransform
from ledger.tree_heads import TreeHeads

_INSERT_CHUNK = 50_000  # rows per INSERT of a load
_SCAN_OVER = 100_000  # fingerprints to look up past which the whole table is read
_RECORD_COLUMNS = ("record_id", "subject_id", "state", "added_at", "record_hash")


@dataclass(frozen=True)
class LiveRecords:
    """The training set as the ledger holds it now (records neither pending nor purged)."""

    record_ids: np.ndarray
    subject_ids: np.ndarray
    X: np.ndarray
    y: np.ndarray


class RecordStore:
    """Loads, reads and fingerprints the records; the schema they share."""

    def __init__(self, engine: Engine, hmac_key: bytes, sealer: PayloadSealer,
                 heads: TreeHeads) -> None:
        self.engine = engine
        self.sealer = sealer
        self._key = hmac_key
        self._heads = heads
        self._schema: DatasetSchema | None = None
        # a worker's digests read only the records new since the last one
        self._digest = TrainingSetDigest(self._fingerprints_of)

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

    def load(self, record_ids: Sequence[str], subject_ids: Sequence[str | None],
             X: np.ndarray, y: np.ndarray, name: str = "dataset",
             transform: InputTransform | None = None) -> int:
        """Seed the record store (the initial training set); returns the event's seq.

        `X` is in the model's input space already (`transform.scale` of the raw table);
        `transform` is stored with the schema by the first load (None: the identity,
        for features that were scaled elsewhere). A later load must bring the same
        transform, or none.
        """
        X = np.ascontiguousarray(X, dtype=FEATURES_DTYPE)
        y = np.asarray(y)
        n = len(record_ids)
        _check_table(record_ids, subject_ids, X, y, transform)
        ids = [str(r) for r in record_ids]
        subjects = [None if s is None else str(s) for s in subject_ids]
        classes = sorted(int(c) for c in np.unique(y))
        now = utc_now()
        with writing(self.engine) as conn:
            digest = _fix_schema(conn, name, X.shape[1], classes, transform)
            clash = _existing_records(conn, ids)
            if clash:
                raise ValueError(f"{len(clash)} record id(s) already exist, "
                                 f"e.g. {sorted(clash)[0]}")
            fingerprints: list[bytes] = []
            for i in range(0, n, _INSERT_CHUNK):
                part = slice(i, i + _INSERT_CHUNK)
                fingerprints += self._insert_chunk(conn, ids[part], subjects[part], X[part],
                                                   y[part].astype(np.int64).tolist(), now)
            fingerprints.sort()
            appender = ChainAppender(conn)
            seq = appender.append("records_loaded", None, {
                "name": name, "count": n, "n_features": X.shape[1], "classes": classes,
                "records_root": merkle.root([merkle.leaf_hash(f) for f in fingerprints]).hex(),
                # what every query and addition means (the input transform, classes, width):
                # `verify` holds the schema row to it
                "schema_sha256": digest,
            }, iso(now))
            appender.flush(conn)
            self._heads.take_if_due(conn, appender.seq)
        self._schema = None
        return seq

    def _insert_chunk(self, conn: Connection, ids: list[str], subjects: list[str | None],
                      X: np.ndarray, labels: list[int], now: datetime) -> list[bytes]:
        """Insert some of a load's records and payloads; their fingerprints. A chunk at a
        time, so a load of 10^6 records holds one chunk's row objects, not the table's."""
        key, rows, payloads, fps = self._key, [], [], []
        added = bind_value(conn, RECORDS.c.added_at, now)
        for rid, sid, x, label in zip(ids, subjects, X, labels, strict=True):
            features = x.tobytes()
            fp = stored_record_fingerprint(key, rid, sid, features, label)
            fps.append(bytes.fromhex(fp))
            rows.append((rid, sid, "live", added, fp))
            payloads.append((rid, features, label))
        insert_params(conn, RECORDS, _RECORD_COLUMNS, rows)
        insert_params(conn, PAYLOADS, ("record_id", "features", "label"), payloads)
        return fps

    def states(self) -> dict[str, str]:
        """Every record id the ledger knows, with its state (pending, live, purged)."""
        with self.engine.connect() as conn:
            return dict(conn.execute(select(RECORDS.c.record_id, RECORDS.c.state)).all())

    def live(self) -> LiveRecords:
        """The live records' ids, subjects and data, by record id."""
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
            X=_matrix([d[0] for d in data], n_features),
            y=np.array([d[1] for d in data], dtype=np.int64),
        )

    def data(self, record_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Features and labels of records, in the order given (an add's payload)."""
        ids = [str(r) for r in record_ids]
        found: dict[str, tuple[bytes | list[float], int] | None] = {}
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
        X = _matrix([found[r][0] for r in ids], self.schema().n_features)
        return X, np.array([found[r][1] for r in ids], dtype=np.int64)

    def purged(self, record_ids: Sequence[str]) -> set[str]:
        """Those of `record_ids` whose data a deletion has purged."""
        if not record_ids:
            return set()
        with self.engine.connect() as conn:
            return set(conn.execute(select(RECORDS.c.record_id).where(
                RECORDS.c.record_id.in_(list(record_ids)), RECORDS.c.state == "purged"
            )).scalars())

    def digest(self, record_ids: Sequence[str]) -> tuple[int, str]:
        """(count, Merkle root) of these records' keyed fingerprints, sorted.

        A model manifest names its training set by this root; an auditor holding the
        fingerprints (the ledger keeps them after a purge) can recompute it without
        seeing any record. KeyError for an id the ledger does not hold.
        """
        return self._digest(record_ids)

    def _fingerprints_of(self, ids: list[str]) -> dict[str, bytes]:
        """Record id -> fingerprint (fixed once the record is received: its row is never
        rewritten); a large set reads the whole table rather than a query per chunk."""
        out: dict[str, bytes] = {}
        want = set(ids)
        with self.engine.connect() as conn:
            if len(ids) > _SCAN_OVER:
                rows = conn.execute(select(RECORDS.c.record_id, RECORDS.c.record_hash))
                out.update((r, bytes.fromhex(h)) for r, h in rows if r in want)
            else:
                for i in range(0, len(ids), LOOKUP_CHUNK):
                    out.update((r, bytes.fromhex(h)) for r, h in conn.execute(
                        select(RECORDS.c.record_id, RECORDS.c.record_hash)
                        .where(RECORDS.c.record_id.in_(ids[i:i + LOOKUP_CHUNK]))))
        missing = len(want) - len(out)
        if missing:
            raise KeyError(f"{missing} record id(s) are not in the ledger")
        return out

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


def purge_records(conn: Connection, by_request: Sequence[tuple[str, Sequence[str]]],
                  now: datetime) -> tuple[dict[str, dict[str, str]], int, list[str]]:
    """Delete the raw data of the records each request names, for a batch of requests at
    once (a statement per request cost 2 ms each: 4 s a pass at 10^6 records); (each
    request's fingerprints, how many payload rows went, the records whose sealed payload
    went: their keys are to be destroyed). A record named twice is purged by the first."""
    ids = sorted({i for _, rids in by_request for i in rids})
    fps: dict[str, str] = {}
    n = 0
    sealed: list[str] = []
    for i in range(0, len(ids), LOOKUP_CHUNK):
        chunk = ids[i:i + LOOKUP_CHUNK]
        fps.update(conn.execute(select(RECORDS.c.record_id, RECORDS.c.record_hash)
                                .where(RECORDS.c.record_id.in_(chunk))).all())
        n += conn.execute(delete(PAYLOADS).where(PAYLOADS.c.record_id.in_(chunk))).rowcount
        sealed += conn.execute(delete(SEALED).where(SEALED.c.record_id.in_(chunk))
                               .returning(SEALED.c.record_id)).scalars()
    rows = [{"b_id": i, "b_by": req} for req, rids in by_request for i in rids]
    if rows:
        conn.execute(update(RECORDS)
                     .where(RECORDS.c.record_id == bindparam("b_id"),
                            RECORDS.c.state != "purged")
                     .values(state="purged", purged_at=now, purged_by=bindparam("b_by")),
                     rows)
    return ({req: {i: fps[i] for i in rids if i in fps}
             for req, rids in by_request}, n + len(sealed), sealed)


def _check_table(record_ids: Sequence[str], subject_ids: Sequence[str | None], X: np.ndarray,
                 y: np.ndarray, transform: InputTransform | None) -> None:
    """ValueError unless the table to load is whole: one row per id, finite features."""
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
    if len({str(r) for r in record_ids}) != n:
        raise ValueError("record_ids must be unique")


def _fix_schema(conn: Connection, name: str, n_features: int, classes: list[int],
                transform: InputTransform | None) -> str:
    """Write the schema on the first load, hold a later load to it; its digest."""
    schema = conn.execute(select(DatasetSchema.__table__)).first()
    if schema is None:
        stored = transform or InputTransform.identity(n_features)
        conn.execute(insert(DatasetSchema.__table__),
                     {"id": 1, "name": name, "n_features": n_features, "classes": classes,
                      "transform": stored.to_json()})
        return schema_sha256(n_features, classes, stored.to_json())
    if schema.n_features != n_features or not set(classes) <= set(schema.classes):
        raise ValueError(f"data does not match the ledger's schema {schema.name!r} "
                         f"({schema.n_features} features, classes {schema.classes})")
    if transform is not None and not transform.same_as(
            InputTransform.from_json(schema.transform, schema.n_features)):
        raise ValueError("the ledger's input transform was fixed by its first load; "
                         "scale the new table with it (`obliviate ledger init` does)")
    return schema_sha256(schema.n_features, schema.classes, schema.transform)


def _matrix(features: list[bytes | list[float]], n_features: int) -> np.ndarray:
    """Records' features (stored bytes, or a sealed payload's list) as one (n, width)
    float64 array: joined and read with one `np.frombuffer`, no Python float per value."""
    blob = bytearray().join(f if isinstance(f, bytes) else feature_bytes(f) for f in features)
    return np.frombuffer(blob, dtype=FEATURES_DTYPE).astype(np.float64, copy=False).reshape(
        len(features), n_features)  # writeable (a bytearray), not copied once more


def _existing_records(conn: Connection, ids: Sequence[str]) -> set[str]:
    """Those of `ids` the ledger holds already (none, without a look, in an empty one)."""
    if conn.execute(select(RECORDS.c.record_id).limit(1)).first() is None:
        return set()
    found: set[str] = set()
    for i in range(0, len(ids), LOOKUP_CHUNK):
        found.update(conn.execute(select(RECORDS.c.record_id)
                                  .where(RECORDS.c.record_id.in_(ids[i:i + LOOKUP_CHUNK])))
                     .scalars())
    return found
