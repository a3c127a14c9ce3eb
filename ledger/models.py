"""The ledger's tables.

`events` is the tamper-evident part: rows are only ever inserted, each carries
the hash of its predecessor, and `checkpoints` hold Merkle roots over prefixes
of it. `requests` and `training_records` are working state whose every change
is announced by an event.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Column, DateTime, Text
from sqlmodel import Field, SQLModel

# A request's status is the kind of its latest lifecycle event.
REQUEST_STATUSES = frozenset({"received", "claimed", "applied", "verified", "failed"})


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


class Event(SQLModel, table=True):
    """An append-only, hash-chained ledger entry. Never updated, never deleted.

    Indexed by seq and request_id only: every other index would be paid for on the
    intake hot path, and exports scan in seq order anyway.
    """

    __tablename__ = "events"

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

    Purging clears features and label; the keyed fingerprint stays.
    """

    __tablename__ = "training_records"

    record_id: str = Field(max_length=128, primary_key=True)
    subject_id: str | None = Field(default=None, max_length=128, index=True)
    # none_as_null: a purge must leave SQL NULL, not the JSON text 'null'
    features: list[float] | None = Field(default=None,
                                         sa_column=Column(JSON(none_as_null=True), nullable=True))
    label: int | None = None
    record_hash: str = Field(max_length=64)
    state: str = Field(max_length=16, index=True)
    added_by: str | None = Field(default=None, max_length=128)
    added_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    purged_by: str | None = Field(default=None, max_length=128)
    purged_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


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


class SourceOffset(SQLModel, table=True):
    """The next Kafka offset to record per partition, written in the batch's transaction."""

    __tablename__ = "source_offsets"

    topic: str = Field(max_length=255, primary_key=True)
    partition: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    next_offset: int = Field(sa_type=BigInteger)


class DatasetSchema(SQLModel, table=True):
    """The feature schema every `add` payload must match (one row)."""

    __tablename__ = "dataset_schema"

    id: int = Field(default=1, primary_key=True)
    name: str = Field(max_length=128)
    n_features: int
    classes: list[int] = Field(sa_column=Column(JSON, nullable=False))
