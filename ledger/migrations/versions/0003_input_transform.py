"""The input transform fitted at `ledger init`: per feature its name, min and max
(``dataset_schema.transform``, x -> (x - min) / (max - min)); a ledger from before it gets
the identity, so its clients keep sending what they sent.

Revision ID: 0003_input_transform
Revises: 0002_payloads_heads_destruction"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

from ledger.migrations import ops

revision = "0003_input_transform"
down_revision = "0002_payloads_heads_destruction"
branch_labels = None
depends_on = None


def upgrade() -> None:
    ops.add_column("dataset_schema", sa.Column("transform", sa.JSON))
    bind = op.get_bind()
    for row in bind.execute(sa.text("SELECT id, n_features FROM dataset_schema "
                                    "WHERE transform IS NULL")).all():
        identity = {"kind": "min-max", "fitted": False, "features": [
            {"name": f"x{j}", "min": 0.0, "max": 1.0} for j in range(row.n_features)]}
        bind.execute(sa.text("UPDATE dataset_schema SET transform = :t WHERE id = :i"),
                     {"t": json.dumps(identity), "i": row.id})

