"""Alembic's environment: runs on the connection :func:`ledger.migrations.upgrade` hands
over, inside its transaction (which holds the database's write lock).
See docs/ledger.md (Database schema and migrations)."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run the migrations through `obliviate ledger migrate` (or "
                       "ledger.migrations.upgrade), which passes the connection")
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():  # the caller's transaction: commits when it does
    context.run_migrations()
