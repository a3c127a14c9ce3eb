"""Converging operations for the revisions: create what is missing, leave what is there.

A database from before the migrations may hold any subset of the tables (each
process used to create only those it imported), so every step asks the database
first.
See docs/ledger.md (Database schema and migrations)."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


def tables() -> set[str]:
    return set(sa.inspect(op.get_bind()).get_table_names())


def columns(table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}


def indexes(table: str) -> set[str]:
    return {i["name"] for i in sa.inspect(op.get_bind()).get_indexes(table)}


def create_table(name: str, *cols: sa.Column,
                 indexes: Sequence[tuple[str, bool]] = ()) -> bool:
    """CREATE TABLE `name` (and `ix_<name>_<column>` for each (column, unique) of
    `indexes`, as SQLModel names them) unless it exists; True if it was created."""
    if name in tables():
        return False
    op.create_table(name, *cols)
    for column, unique in indexes:
        op.create_index(f"ix_{name}_{column}", name, [column], unique=unique)
    return True


def add_column(table: str, column: sa.Column) -> bool:
    """ALTER TABLE ADD COLUMN unless the column is there; True if it was added."""
    if column.name in columns(table):
        return False
    op.add_column(table, column)
    return True


def tz() -> sa.DateTime:
    return sa.DateTime(timezone=True)
