"""The ledger's tables.

`events` is the tamper-evident part (insert-only, each row carrying its predecessor's hash;
`checkpoints` and `signed_heads` hold Merkle roots over its prefixes). `requests` and
`training_records` are working state whose every change an event announces
(`request_records` indexes the requests by the record ids they name);
`record_payloads` and `sealed_payloads` hold records' data until a purge deletes the row.
See docs/ledger.md (Tables)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, LargeBinary, Text, text
from sqlmodel import Field, SQLModel

from ledger.heads import ROTATION_KIND
from ledger.transform import InputTransform

# A request's status is the kind of its latest lifecycle event.
REQUEST_STATUSES = frozenset({"received", "claimed", "applied", "verified", "failed"})
# The predicate of the partial index over the key rotations; a query must spell it out (a
# bound parameter does not select a partial index on SQLite).
ROTATION_ONLY = f"kind = '{ROTATION_KIND}'"


class Request(SQLModel, table=True):
    """One accepted deletion or addition request and where it came from."""

    __tablename__ = "requests"

    id: int | None = Field(default=None, primary_key=True)
    request_id: str = Field(max_length=128, unique=True, index=True)
    op: str = Field(max_length=16)
    subject_id: str | None = Field(default=None, max_length=128, index=True)
    record_ids: list[str] = Field(sa_column=Column(JSON, nullable=False))
    expanded_from_subject: bool = False
    requested_at: str | None = Field(default=None, max_length=64)
    source: str = Field(max_length=16)
    source_topic: str | None = Field(default=None, max_length=255)
    source_partition: int | None = None
    source_offset: int | None = Field(default=None, sa_type=BigInteger)
    received_at: datetime = Field(sa_type=DateTime(timezone=True))
    received_seq: int = Field(sa_type=BigInteger)
    status: str = Field(max_length=16, index=True)
    claimed_by: str | None = Field(default=None, max_length=128)
    claimed_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    duplicate_count: int = 0


class RequestRecord(SQLModel, table=True):
    """Each record id a request names, keyed by (record id, the request's `received_seq`):
    the index a subject's requests page reads, instead of every request's `record_ids`.

    Written in the transaction that inserts the request, never changed. A purge leaves
    the rows, as it leaves the record's id in `training_records` and in the request's
    `record_ids`: ids are not the data a deletion removes.
    """

    __tablename__ = "request_records"

    record_id: str = Field(max_length=128, primary_key=True)
    received_seq: int = Field(sa_type=BigInteger, primary_key=True,
                              sa_column_kwargs={"autoincrement": False})
    request_id: str = Field(max_length=128)


class Event(SQLModel, table=True):
    """An append-only, hash-chained ledger entry. Never updated, never deleted.

    Indexed by seq and request_id, and the key rotations by a partial index (so that
    following them reads those rows only, not the log): any other index would be paid
    for on the intake hot path, and exports scan in seq order anyway.
    """

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_key_rotations", "seq", sqlite_where=text(ROTATION_ONLY),
                            postgresql_where=text(ROTATION_ONLY)),)

    seq: int = Field(sa_type=BigInteger, primary_key=True,
                     sa_column_kwargs={"autoincrement": False})
    request_id: str | None = Field(default=None, max_length=128, index=True)
    kind: str = Field(max_length=32)
    payload: str = Field(sa_type=Text)
    model_version: str | None = Field(default=None, max_length=128)
    created_at: str = Field(max_length=32)
    prev_hash: str = Field(max_length=64)
    hash: str = Field(max_length=64)


class TrainingRecord(SQLModel, table=True):
    """A training record: `pending` (an add not yet applied), `live`, or `purged`.

    What stays after a purge: ids, state and the keyed fingerprint. The raw
    features and label live in `record_payloads`, whose row a purge deletes.
    """

    __tablename__ = "training_records"

    record_id: str = Field(max_length=128, primary_key=True)
    subject_id: str | None = Field(default=None, max_length=128, index=True)
    record_hash: str = Field(max_length=64)
    state: str = Field(max_length=16, index=True)
    added_by: str | None = Field(default=None, max_length=128)
    added_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    purged_by: str | None = Field(default=None, max_length=128)
    purged_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class RecordPayload(SQLModel, table=True):
    """The raw data of a loaded record; a purge deletes the row. The features are one
    binary value, little-endian float64 (`chain.feature_bytes`): what the fingerprint is
    taken over, and what `live()` reads back with one `np.frombuffer` per record.

    A table of its own so that purge maintenance rewrites (PostgreSQL: VACUUM FULL)
    only this narrow table, under a lock that deletion intake and the request
    lifecycle never wait for: they read `training_records` and `requests` only.
    """

    __tablename__ = "record_payloads"

    record_id: str = Field(max_length=128, primary_key=True)
    features: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    label: int


class SealedPayload(SQLModel, table=True):
    """An added record's features and label, encrypted under the record's own key, which
    lives in the key store, not here (:mod:`ledger.sealed_payloads`); a purge deletes
    the row and destroys the key."""

    __tablename__ = "sealed_payloads"

    record_id: str = Field(max_length=128, primary_key=True)
    sealed: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class PurgeMaintenanceState(SQLModel, table=True):
    """One row: which purges have left the database files (`PurgeMaintenance.run`).

    `purges` counts purging transactions; `erased` is the value of `purges` that the
    last successful maintenance covered, so a crash between a purge and its
    maintenance leaves `purges > erased` for the next call to find.
    """

    __tablename__ = "purge_maintenance"

    id: int = Field(default=1, primary_key=True)
    purges: int = Field(default=0, sa_type=BigInteger)
    erased: int = Field(default=0, sa_type=BigInteger)
    last_purge_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    # PostgreSQL: txid_current() of the latest purge (purges are serialised by the
    # append lock, so it is also the largest purge xid)
    last_purge_xid: int | None = Field(default=None, sa_type=BigInteger)
    # a training_records table from before record_payloads must be rewritten once
    rewrite_records: bool = False
    # other tables of the database whose deleted rows must leave its files too
    # (written by ledgers from before the key store, whose version keys were a table here)
    pending_tables: list[str] | None = Field(default=None, sa_column=Column(JSON))
    last_run_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    last_erased_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    last_outcome: str | None = Field(default=None, max_length=32)


class Checkpoint(SQLModel, table=True):
    """An RFC 6962 tree head: the Merkle root over events 1..tree_size."""

    __tablename__ = "checkpoints"

    tree_size: int = Field(sa_type=BigInteger, primary_key=True,
                           sa_column_kwargs={"autoincrement": False})
    root_hash: str = Field(max_length=64)
    created_at: str = Field(max_length=32)
    # Roots of the perfect subtrees covering 1..tree_size, largest first, so the
    # next checkpoint extends this one instead of rehashing the whole log.
    frontier: list[str] = Field(sa_column=Column(JSON, nullable=False))


class MerkleNode(SQLModel, table=True):
    """The root of a perfect subtree of the events' Merkle tree (2**L events, L >= 1,
    starting at a multiple of 2**L), stored as its last event is appended so that proofs
    read O(log n) rows (`ledger.subtree_store`). Derived from the events: `verify`
    recomputes every row."""

    __tablename__ = "merkle_nodes"

    # the order subtrees are completed in (`subtree_store.position`): appends only add to
    # the end, and the rows over events 1..n are positions 0..n - popcount(n) - 1
    position: int = Field(sa_type=BigInteger, primary_key=True,
                          sa_column_kwargs={"autoincrement": False})
    hash: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class SignedHead(SQLModel, table=True):
    """A tree head signed with the ledger's Ed25519 key (`ledger.heads`), which is kept
    outside this database: published so that auditors can hold the log to it."""

    __tablename__ = "signed_heads"

    tree_size: int = Field(sa_type=BigInteger, primary_key=True,
                           sa_column_kwargs={"autoincrement": False})
    root_hash: str = Field(max_length=64)
    timestamp: str = Field(max_length=32)
    log_id: str = Field(max_length=64)
    signature: str = Field(max_length=128)


class SourceOffset(SQLModel, table=True):
    """The next Kafka offset to record per partition, written in the batch's transaction,
    with the topic id of the log it counts in (a log started again has a new one)."""

    __tablename__ = "source_offsets"

    topic: str = Field(max_length=255, primary_key=True)
    partition: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    next_offset: int = Field(sa_type=BigInteger)
    topic_id: str | None = Field(default=None, max_length=64)


class DatasetSchema(SQLModel, table=True):
    """The feature schema every `add` payload must match (one row), with the input
    transform fitted at `ledger init` (:mod:`ledger.transform`: per feature its name,
    min and max), which takes raw features into the model's input space."""

    __tablename__ = "dataset_schema"

    id: int = Field(default=1, primary_key=True)
    name: str = Field(max_length=128)
    n_features: int
    classes: list[int] = Field(sa_column=Column(JSON, nullable=False))
    transform: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))

    @property
    def input_transform(self) -> InputTransform:
        return InputTransform.from_json(self.transform, self.n_features)
