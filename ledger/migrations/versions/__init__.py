"""Alembic revisions of the schema, one file each, applied in order by ledger.migrations."""
