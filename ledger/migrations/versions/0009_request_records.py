"""``request_records``: each record id a request names, back-filled from the requests.

A subject's requests page read every request after its cursor and matched record ids in
Python (seconds a page at 10^6 requests); it now reads this table's primary key (record
id, received_seq) and ``ix_requests_subject_id``. See docs/ledger.md (Tables).

Revision ID: 0009_request_records
Revises: 0008_source_topic_ids
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from ledger.intake import backfill_request_records
from ledger.migrations import ops

revision = "0009_request_records"
down_revision = "0008_source_topic_ids"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if ops.create_table(
            "request_records",
            sa.Column("record_id", sa.String(128), primary_key=True),
            sa.Column("received_seq", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("request_id", sa.String(128), nullable=False)):
        backfill_request_records(op.get_bind())
    if "ix_requests_subject_id" not in ops.indexes("requests"):
        op.create_index("ix_requests_subject_id", "requests", ["subject_id"])


def downgrade() -> None:
    """The table goes; the subject index stays (revision 0001 declares it too)."""
    op.drop_table("request_records")
