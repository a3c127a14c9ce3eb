"""Database engines for the ledger: SQLite (WAL) embedded, PostgreSQL by URL.

Appending to a hash chain needs one writer at a time: SQLite gets that from
BEGIN IMMEDIATE, PostgreSQL from a transaction-scoped advisory lock, so that
several consumers, workers and service processes can share one ledger.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    ARRAY,
    JSON,
    ColumnElement,
    Connection,
    Engine,
    Table,
    any_,
    bindparam,
    create_engine,
    event,
    func,
    select,
    text,
)
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


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def insert_rows(conn: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
    """Bulk insert for the intake hot path: COPY on PostgreSQL, executemany on SQLite.

    Values still pass through each column type's bind processor, so JSON and
    timestamps are stored exactly as the ORM would store them.
    """
    if not rows:
        return
    names = list(rows[0])
    cols = [table.c[name] for name in names]
    procs = [_json_text if isinstance(c.type, JSON) else c.type.bind_processor(conn.dialect)
             for c in cols]
    params = [tuple([v if p is None else p(v)
                     for p, v in zip(procs, map(r.__getitem__, names), strict=True)])
              for r in rows]
    if conn.dialect.driver == "psycopg":  # COPY is several times faster than executemany
        cur = conn.connection.driver_connection.cursor()
        with cur.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
            for row in params:
                copy.write_row(row)
        return
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    conn.exec_driver_sql(f"INSERT INTO {table.name} ({', '.join(names)}) "
                         f"VALUES ({', '.join([mark] * len(names))})", params)


def among(conn: Connection, column: ColumnElement[Any], values: list[Any]) -> ColumnElement[bool]:
    """`column IN (values)`; on PostgreSQL one array parameter instead of one per value."""
    if conn.dialect.name == "postgresql":
        return column == any_(bindparam(None, values, type_=ARRAY(column.type)))
    if conn.dialect.name == "sqlite":  # one JSON parameter, unpacked by SQLite itself
        each = func.json_each(json.dumps(values)).table_valued("value")
        return column.in_(select(each.c.value))
    return column.in_(values)
