"""The bytes of the ledger's database files, for the tests that scan them for purged data.

SQLite: the database file, its -wal and -shm. PostgreSQL: every fork and segment of
every relation of the ledger's schema, their TOAST tables and indexes
(`pg_relation_filepath` under `SHOW data_directory`), read directly when this OS user
can, else through the server (`pg_read_binary_file`, superuser).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text

from ledger.db import sqlite_files, sqlite_path
from ledger.store import Ledger

# False: read the files through pg_read_binary_file even when this user could open them
_PG_FILES_READABLE = os.environ.get("OBLIVIATE_TEST_PG_FILES", "direct") == "direct"


def is_superuser(ledger: Ledger) -> bool:
    with ledger.engine.connect() as conn:
        return bool(conn.execute(text(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")).scalar())


def relation_paths(ledger: Ledger) -> dict[str, str]:
    """relname -> file path relative to the data directory, for every relation of the
    ledger's schema that has storage, plus the TOAST tables and their indexes."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(text("""
            WITH own AS (SELECT c.oid, c.reltoastrelid FROM pg_class c
                         WHERE c.relnamespace = current_schema()::regnamespace)
            SELECT c.relname, pg_relation_filepath(c.oid) FROM pg_class c
            WHERE c.oid IN (SELECT oid FROM own)
               OR c.oid IN (SELECT reltoastrelid FROM own)
               OR c.oid IN (SELECT i.indexrelid FROM pg_index i
                            WHERE i.indrelid IN (SELECT reltoastrelid FROM own))
        """)).all()
    return {name: path for name, path in rows if path is not None}


def pg_files(ledger: Ledger) -> dict[str, bytes]:
    """The bytes of every fork and segment of the schema's relations, after a CHECKPOINT
    (so that what sits in shared buffers is on disk too)."""
    with ledger.engine.connect() as conn:
        conn.execute(text("CHECKPOINT"))
        datadir = Path(conn.execute(text("SHOW data_directory")).scalar())
        readable = _PG_FILES_READABLE and os.access(datadir / "base", os.R_OK | os.X_OK)
        files: dict[str, bytes] = {}
        for name, rel in relation_paths(ledger).items():
            candidates = [rel, *(f"{rel}{suffix}" for suffix in ("_fsm", "_vm", "_init"))]
            candidates += [f"{rel}.{n}" for n in range(1, 64)]
            for cand in candidates:
                if readable:
                    path = datadir / cand
                    if path.exists():
                        files[f"{name} ({cand})"] = path.read_bytes()
                # not readable by this OS user: read it through the server (superuser)
                elif conn.execute(text("SELECT (pg_stat_file(:p, true)).size IS NOT NULL"),
                                  {"p": cand}).scalar():
                    files[f"{name} ({cand})"] = bytes(conn.execute(
                        text("SELECT pg_read_binary_file(:p)"), {"p": cand}).scalar())
    assert any(k.startswith("record_payloads ") for k in files), files.keys()
    return files


def db_files(ledger: Ledger) -> dict[str, bytes]:
    if ledger.engine.dialect.name == "sqlite":
        path = sqlite_path(ledger.url)
        return {p.name: p.read_bytes() for p in sqlite_files(path) if p.exists()}
    if not is_superuser(ledger):
        pytest.skip("reading PostgreSQL's relation files needs a superuser")
    return pg_files(ledger)
