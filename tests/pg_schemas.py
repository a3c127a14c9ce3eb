"""A fresh PostgreSQL schema to hold one ledger: tests and benchmarks share a server, so
each ledger gets a schema of its own (and a module that scans files, a database)."""

from __future__ import annotations

import uuid

from sqlalchemy import create_engine, text


def new_schema(base_url: str, prefix: str = "t_", connect_timeout: float | None = None
               ) -> str:
    """Create a schema named `prefix` + random hex in the database of `base_url`; the URL
    whose connections use it."""
    schema = f"{prefix}{uuid.uuid4().hex[:12]}"
    args = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
    engine = create_engine(base_url, connect_args=args)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
    finally:
        engine.dispose()
    return f"{base_url}?options=-csearch_path%3D{schema}"
