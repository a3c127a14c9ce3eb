"""Alembic's environment: runs on the connection :func:`ledger.migrations.upgrade` hands
over, inside its transaction (which holds the database's write lock). `alembic` run
alone has none: it says, in one line, to run `obliviate ledger migrate`.
See docs/ledger.md (Database schema and migrations)."""

from __future__ import annotations

import sys

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    print("obliviate: error: run the migrations with `obliviate ledger migrate` (--db URL "
          "or OBLIVIATE_DATABASE_URL), not `alembic`: it opens the ledger's database and "
          "brings it to the newest migration under the ledger's lock", file=sys.stderr)
    sys.exit(2)
context.configure(connection=connection, target_metadata=None)
with context.begin_transaction():  # the caller's transaction: commits when it does
    context.run_migrations()
