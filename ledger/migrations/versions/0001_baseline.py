"""The schema before migrations existed (commit ff838b8): ten tables, each created if missing,
so a database made by that code's ``create_all`` calls and an empty one both end with all ten.

Revision ID: 0001_baseline
Revises:"""

from __future__ import annotations

import sqlalchemy as sa

from ledger.migrations import ops

revision = "0001_baseline"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    _ledger_tables()
    _registry_tables()
    _private_mode_and_usage_tables()


def _ledger_tables() -> None:
    tz = ops.tz
    ops.create_table(
        "requests",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("op", sa.String(16), nullable=False),
        sa.Column("subject_id", sa.String(128)),
        sa.Column("record_ids", sa.JSON, nullable=False),
        sa.Column("expanded_from_subject", sa.Boolean, nullable=False),
        sa.Column("requested_at", sa.String(64)),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("source_topic", sa.String(255)),
        sa.Column("source_partition", sa.Integer),
        sa.Column("source_offset", sa.BigInteger),
        sa.Column("received_at", tz(), nullable=False),
        sa.Column("received_seq", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("claimed_by", sa.String(128)),
        sa.Column("claimed_at", tz()),
        sa.Column("duplicate_count", sa.Integer, nullable=False),
        indexes=[("request_id", True), ("status", False), ("subject_id", False)])
    ops.create_table(
        "events",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("request_id", sa.String(128)),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("model_version", sa.String(128)),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        indexes=[("request_id", False)])
    ops.create_table(
        "training_records",
        sa.Column("record_id", sa.String(128), primary_key=True),
        sa.Column("subject_id", sa.String(128)),
        sa.Column("features", sa.JSON(none_as_null=True)),
        sa.Column("label", sa.Integer),
        sa.Column("record_hash", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("added_by", sa.String(128)),
        sa.Column("added_at", tz()),
        sa.Column("purged_by", sa.String(128)),
        sa.Column("purged_at", tz()),
        indexes=[("state", False), ("subject_id", False)])
    ops.create_table(
        "checkpoints",
        sa.Column("tree_size", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("root_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.Column("frontier", sa.JSON, nullable=False))
    ops.create_table(
        "source_offsets",
        sa.Column("topic", sa.String(255), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("next_offset", sa.BigInteger, nullable=False))
    ops.create_table(
        "dataset_schema",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("n_features", sa.Integer, nullable=False),
        sa.Column("classes", sa.JSON, nullable=False))


def _registry_tables() -> None:
    """The model registry (jobs/orchestration/registry.py)."""
    tz = ops.tz
    ops.create_table(
        "model_versions",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("version", sa.String(64), primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("parent", sa.String(64)),
        sa.Column("manifest", sa.JSON, nullable=False),
        sa.Column("created_at", tz(), nullable=False),
        indexes=[("seq", False)])
    ops.create_table(
        "model_pointer",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("updated_at", tz(), nullable=False))


def _private_mode_and_usage_tables() -> None:
    """Private prediction mode's budgets (jobs/adaptive/budget.py) and the guard's usage
    per serving process (service/usage.py)."""
    tz = ops.tz
    ops.create_table(
        "seed_lineages",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("lineage", sa.String(64), primary_key=True),
        sa.Column("epsilon_per_answer", sa.Float, nullable=False),
        sa.Column("delta", sa.Float, nullable=False),
        sa.Column("epsilon_budget", sa.Float, nullable=False),
        sa.Column("answers_allowed", sa.BigInteger, nullable=False),
        sa.Column("answers_reserved", sa.BigInteger, nullable=False),
        sa.Column("created_at", tz(), nullable=False),
        sa.Column("exhausted_at", tz()))
    ops.create_table(
        "guard_usage",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("process", sa.String(128), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("period_end", tz(), nullable=False),
        sa.Column("certain", sa.Integer, nullable=False),
        sa.Column("noised", sa.Integer, nullable=False),
        sa.Column("fresh_noised", sa.Integer, nullable=False),
        sa.Column("epsilon_spent", sa.Float, nullable=False),
        indexes=[("period_end", False), ("version", False)])
