"""Records apart from their data, purge maintenance, signed heads, version destruction:
``record_payloads`` takes the raw features and label out of ``training_records`` (one
rewrite of it asked of purge maintenance), ``signed_heads``, and the registry's
destruction columns, ``model_version_counters`` and ``version_keys``.

Revision ID: 0002_payloads_heads_destruction
Revises: 0001_baseline"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from ledger.migrations import ops

revision = "0002_payloads_heads_destruction"
down_revision = "0001_baseline"
branch_labels = None
depends_on = None

log = logging.getLogger("obliviate.ledger")


def upgrade() -> None:
    tz = ops.tz
    ops.create_table(
        "record_payloads",
        sa.Column("record_id", sa.String(128), primary_key=True),
        sa.Column("features", sa.JSON, nullable=False),
        sa.Column("label", sa.Integer, nullable=False))
    ops.create_table(
        "purge_maintenance",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("purges", sa.BigInteger, nullable=False),
        sa.Column("erased", sa.BigInteger, nullable=False),
        sa.Column("last_purge_at", tz()),
        sa.Column("last_purge_xid", sa.BigInteger),
        sa.Column("rewrite_records", sa.Boolean, nullable=False),
        sa.Column("pending_tables", sa.JSON),
        sa.Column("last_run_at", tz()),
        sa.Column("last_erased_at", tz()),
        sa.Column("last_outcome", sa.String(32)))
    ops.create_table(
        "signed_heads",
        sa.Column("tree_size", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("root_hash", sa.String(64), nullable=False),
        sa.Column("timestamp", sa.String(32), nullable=False),
        sa.Column("log_id", sa.String(64), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False))
    ops.add_column("model_versions", sa.Column("superseded_by_deletion", sa.String(64)))
    ops.add_column("model_versions", sa.Column("destroyed_at", tz()))
    ops.create_table(
        "model_version_counters",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("last_seq", sa.BigInteger, nullable=False))
    ops.create_table(
        "version_keys",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("version", sa.String(64), primary_key=True),
        sa.Column("key", sa.String(64), nullable=False))
    if "features" in ops.columns("training_records"):
        _move_payloads()


def _move_payloads() -> None:
    """Copy live and pending records' data to record_payloads, drop the old columns, and
    have purge maintenance rewrite training_records once (PostgreSQL: VACUUM FULL
    training_records; SQLite: VACUUM)."""
    bind = op.get_bind()
    moved = bind.execute(sa.text(
        "INSERT INTO record_payloads (record_id, features, label) "
        "SELECT r.record_id, r.features, r.label FROM training_records r "
        "WHERE r.state <> 'purged' AND r.features IS NOT NULL AND r.label IS NOT NULL "
        "AND NOT EXISTS (SELECT 1 FROM record_payloads p WHERE p.record_id = r.record_id)"
    )).rowcount
    for column in ("features", "label"):
        op.execute(f"ALTER TABLE training_records DROP COLUMN {column}")
    if not bind.execute(sa.text("SELECT 1 FROM training_records LIMIT 1")).first():
        return  # an empty table (a new database): no data ever lived in its files
    # count it as a purge, as ledger.purge_maintenance.note_purge does (with the xid on
    # PostgreSQL)
    pg = bind.dialect.name == "postgresql"
    xid = "txid_current()" if pg else "NULL"
    now = {"now": datetime.now(UTC)}
    if bind.execute(sa.text("SELECT 1 FROM purge_maintenance WHERE id = 1")).first():
        newest = "greatest(last_purge_xid, txid_current())" if pg else "NULL"
        bind.execute(sa.text(
            "UPDATE purge_maintenance SET purges = purges + 1, rewrite_records = :t, "
            f"last_purge_at = :now, last_purge_xid = {newest} WHERE id = 1"),
            {**now, "t": True})
    else:
        bind.execute(sa.text(
            "INSERT INTO purge_maintenance (id, purges, erased, rewrite_records, "
            f"last_purge_at, last_purge_xid) VALUES (1, 1, 0, :t, :now, {xid})"),
            {**now, "t": True})
    log.warning("moved the raw data of %d record(s) from training_records to record_payloads;"
                " the next purge maintenance rewrites training_records", moved)
