"""The Kafka topic id each partition's offset was recorded under (`source_offsets`).

A broker that lost its log numbers the new one from 0 under a new topic id; a consumer
started after the new log grew past the recorded offset can tell only from the id the
ledger recorded. See docs/ledger.md (Intake).

Revision ID: 0008_source_topic_ids
Revises: 0007_binary_features
"""

from __future__ import annotations

import sqlalchemy as sa

from ledger.migrations import ops

revision = "0008_source_topic_ids"
down_revision = "0007_binary_features"
branch_labels = None
depends_on = None


def upgrade() -> None:
    ops.add_column("source_offsets", sa.Column("topic_id", sa.String(64)))
