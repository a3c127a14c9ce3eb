"""The ledger's tables as SQLAlchemy Core objects, for the modules that write them in bulk.
See docs/ledger.md (Tables)."""

from __future__ import annotations

from ledger.models import (
    Checkpoint,
    Event,
    MerkleNode,
    PurgeMaintenanceState,
    RecordPayload,
    Request,
    RequestRecord,
    SealedPayload,
    SignedHead,
    SourceOffset,
    TrainingRecord,
)

EVENTS = Event.__table__
REQUESTS = Request.__table__
REQUEST_RECORDS = RequestRecord.__table__
RECORDS = TrainingRecord.__table__
PAYLOADS = RecordPayload.__table__
SEALED = SealedPayload.__table__
MAINTENANCE = PurgeMaintenanceState.__table__
CHECKPOINTS = Checkpoint.__table__
HEADS = SignedHead.__table__
MERKLE_NODES = MerkleNode.__table__
OFFSETS = SourceOffset.__table__
LOOKUP_CHUNK = 500  # rows per IN (...) lookup, well under every backend's parameter limit
