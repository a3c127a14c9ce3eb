"""A partial index over the key rotations (`events` where kind = 'key_rotated').

`verify --since-verified` and every signer follow the key rotations; without the index
that read scans the whole log, so an incremental verify grew with it. The index holds
the rotation rows only, so appends pay nothing for it. See docs/ledger.md#incremental-verify.

Revision ID: 0006_rotation_index
Revises: 0005_merkle_nodes
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.migrations import ops
from ledger.models import ROTATION_ONLY

revision = "0006_rotation_index"
down_revision = "0005_merkle_nodes"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if "ix_events_key_rotations" not in ops.indexes("events"):
        op.create_index("ix_events_key_rotations", "events", ["seq"],
                        sqlite_where=sa.text(ROTATION_ONLY),
                        postgresql_where=sa.text(ROTATION_ONLY))

