"""Features as one binary value: ``record_payloads.features`` from JSON text to float64
bytes, which new fingerprints are taken over; the rows are copied into a new table in
chunks and the old one dropped (no text left in dead tuples). Old fingerprints keep
their JSON scheme. See docs/ledger.md (Database schema and migrations).

Revision ID: 0007_binary_features
Revises: 0006_rotation_index
"""

from __future__ import annotations

import json

import numpy as np
import sqlalchemy as sa
from alembic import op

from ledger.chain import FEATURES_DTYPE

revision = "0007_binary_features"
down_revision = "0006_rotation_index"
branch_labels = None
depends_on = None

_NEW = "record_payloads_f64"
_CHUNK = 20_000


def upgrade() -> None:
    bind = op.get_bind()
    column = next(c for c in sa.inspect(bind).get_columns("record_payloads")
                  if c["name"] == "features")
    if isinstance(column["type"], sa.LargeBinary):
        return
    new = op.create_table(
        _NEW,
        sa.Column("record_id", sa.String(128), primary_key=True),
        sa.Column("features", sa.LargeBinary, nullable=False),
        sa.Column("label", sa.Integer, nullable=False))
    last = ""
    while rows := bind.execute(sa.text(
            "SELECT record_id, features, label FROM record_payloads WHERE record_id > :last "
            "ORDER BY record_id LIMIT :n"), {"last": last, "n": _CHUNK}).all():
        bind.execute(new.insert(), [
            {"record_id": r.record_id, "label": r.label,
             "features": np.asarray(json.loads(r.features) if isinstance(r.features, str)
                                    else r.features, dtype=FEATURES_DTYPE).tobytes()}
            for r in rows])
        last = rows[-1].record_id
    op.drop_table("record_payloads")
    op.rename_table(_NEW, "record_payloads")
    if bind.dialect.name == "postgresql":
        op.execute(f"ALTER INDEX {_NEW}_pkey RENAME TO record_payloads_pkey")
