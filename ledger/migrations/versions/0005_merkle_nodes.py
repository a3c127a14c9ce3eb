"""Stored subtree hashes: ``merkle_nodes``, back-filled from the events.

Proofs read O(log n) stored subtree roots (:mod:`ledger.subtree_store`). This creates
the table and stores the subtrees of the events already there, streamed in batches.
See docs/ledger.md#stored-subtree-hashes.

Revision ID: 0005_merkle_nodes
Revises: 0004_key_store
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger import subtree_store
from ledger.migrations import ops

revision = "0005_merkle_nodes"
down_revision = "0004_key_store"
branch_labels = None
depends_on = None


def upgrade() -> None:
    ops.create_table(
        "merkle_nodes",
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("hash", sa.LargeBinary, nullable=False))
    if "events" in ops.tables():
        bind = op.get_bind()
        size = bind.execute(sa.text("SELECT max(seq) FROM events")).scalar() or 0
        subtree_store.catch_up(bind, size)
