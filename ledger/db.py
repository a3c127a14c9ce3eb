"""Database engines for the ledger: SQLite (WAL) embedded, PostgreSQL by URL.

Appending to a hash chain needs one writer at a time: SQLite gets that from
BEGIN IMMEDIATE, PostgreSQL from a transaction-scoped advisory lock, so that
several consumers, workers and service processes can share one ledger.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlmodel import SQLModel

# Arbitrary constant naming the ledger's append lock among PostgreSQL advisory locks.
_APPEND_LOCK_KEY = 0x0B11_71A7E


def normalise_url(url: str) -> str:
    """Accept plain `postgresql://` and `sqlite:///path` URLs; use psycopg 3 for PostgreSQL."""
    if url.startswith(("postgres://", "postgresql://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_engine(url: str) -> Engine:
    url = normalise_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
        _configure_sqlite(engine)
    elif url.startswith("postgresql"):
        engine = create_engine(url, pool_pre_ping=True)
    else:
        raise ValueError(f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://...")
    return engine


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # noqa: ANN001 - DBAPI objects
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def create_tables(engine: Engine) -> None:
    import ledger.models  # noqa: F401 - registers the tables

    SQLModel.metadata.create_all(engine)


@contextmanager
def writing(engine: Engine) -> Iterator[Connection]:
    """A transaction that holds the ledger's single-writer lock until it commits."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _APPEND_LOCK_KEY})
        yield conn
