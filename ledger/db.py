"""Database engines for the ledger: SQLite (WAL) embedded, PostgreSQL by URL.

Appending to a hash chain needs one writer at a time (SQLite: BEGIN IMMEDIATE; PostgreSQL:
a transaction-scoped advisory lock), so several processes share one ledger. Purged bytes:
SQLite runs with secure_delete and TRUNCATE checkpoints, files 0600; PostgreSQL rewrites a
table with VACUUM FULL (:func:`pg_vacuum_full`).
See docs/security.md (The ledger database)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ARRAY,
    JSON,
    Column,
    ColumnElement,
    Connection,
    Engine,
    Table,
    any_,
    bindparam,
    create_engine,
    event,
    func,
    make_url,
    select,
    text,
)

log = logging.getLogger("obliviate.ledger")

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
        secure_sqlite_files(url)
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
        _configure_sqlite(engine)
    elif url.startswith("postgresql"):
        # a server that does not answer is an error in seconds, not the OS's TCP timeout
        timeout = {} if "connect_timeout" in url else {"connect_timeout": 10}
        engine = create_engine(url, pool_pre_ping=True, connect_args=timeout)
    else:
        raise ValueError(f"unsupported database URL {url!r}: use sqlite:///PATH or postgresql://...")
    return engine


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:  # noqa: ANN001 - DBAPI objects
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        _enable_wal(cur)
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        # zero deleted content in pages and freed pages instead of leaving it as free space
        if cur.execute("PRAGMA secure_delete=ON").fetchone()[0] != 1:
            raise RuntimeError("this SQLite build refuses PRAGMA secure_delete")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


_WAL_SWITCH_S = 60.0  # as long as a statement waits for a lock (busy_timeout)


def _enable_wal(cur: Any) -> None:
    """Put the database in WAL mode, waiting for the lock that takes. SQLite switches a
    new database's journal under an exclusive lock it does not wait for (no busy
    handler): processes opening a new database at once saw "database is locked"."""
    deadline, pause = time.monotonic() + _WAL_SWITCH_S, 0.005
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL; None for in-memory and `file:` URI databases, and for
    any other database."""
    parsed = make_url(normalise_url(url))
    database = parsed.database
    if (parsed.get_backend_name() != "sqlite" or not database or database == ":memory:"
            or database.startswith("file:")):
        return None
    return Path(database)


@contextmanager
def single_sqlite_worker(url: str) -> Iterator[None]:
    """Hold the SQLite ledger's worker lock (an exclusive flock on `<db>.worker.lock`)
    for the block; RuntimeError at once if another worker holds it. On SQLite claims
    cannot skip each other's rows (no SKIP LOCKED) and one writer runs at a time, so the
    rule is one worker; PostgreSQL takes any number (nothing to hold there)."""
    path = sqlite_path(url)
    if path is None:
        yield
        return
    lock = path.with_name(path.name + ".worker.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise RuntimeError(f"another worker (pid {holder}) runs on the SQLite ledger "
                               f"{path}: SQLite takes one worker at a time; use PostgreSQL "
                               "to run several") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def sqlite_files(path: Path) -> list[Path]:
    """The database file and its WAL and shared-memory index."""
    return [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]


def secure_sqlite_files(url: str) -> None:
    """Create the database file 0600 before SQLite does, and tighten existing files.

    SQLite gives the -wal and -shm files the database file's permission bits, so
    they are 0600 too.
    """
    path = sqlite_path(url)
    if path is None:
        return
    # exists already, or no parent directory (SQLite will say so)
    with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    for p in sqlite_files(path):
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:
            continue
        if mode & 0o077:
            try:
                p.chmod(mode & 0o700)
            except PermissionError:
                log.warning("cannot make %s private (mode %o): not its owner", p, mode & 0o777)


def sqlite_checkpoint(engine: Engine, attempts: int = 5, busy_ms: int = 100) -> bool:
    """Copy the WAL into the database file and truncate the WAL to zero bytes.

    A reader in the middle of a transaction blocks a full checkpoint: retry a few
    times briefly (not the connection's 60 s busy timeout), then give up and say so.
    """
    raw = engine.raw_connection()
    try:
        dbapi = raw.driver_connection
        dbapi.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
        try:
            for i in range(attempts):
                try:
                    busy = dbapi.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
                except Exception as exc:  # noqa: BLE001 - sqlite3.OperationalError: locked
                    busy, error = 1, exc
                else:
                    error = None
                if busy == 0:
                    return True
                time.sleep(0.02 * 2 ** i)
            log.warning("WAL checkpoint blocked by readers after %d tries%s; the next "
                        "purge maintenance will retry", attempts,
                        f" ({error})" if error else "")
            return False
        finally:
            dbapi.execute("PRAGMA busy_timeout=60000")
    finally:
        raw.close()


def sqlite_vacuum(engine: Engine) -> None:
    """Rebuild the whole database file (used once for a database from before secure_delete)."""
    raw = engine.raw_connection()
    try:
        raw.driver_connection.execute("VACUUM")
    finally:
        raw.close()


def pg_vacuum_full(conn: Connection, table: Table | str) -> int:
    """VACUUM FULL one table on an AUTOCOMMIT connection; returns its new relfrozenxid.

    The table, its TOAST table and its indexes are rewritten into new files and the
    old files are truncated at commit (unlinked at the next checkpoint). A deleted
    row survives the rewrite only if its deleting transaction is not older than
    every snapshot still open ("recently dead"); the new relfrozenxid is that
    horizon (VACUUM FULL freezes as far as it can), so a deletion whose xid
    precedes it is gone: see `xid_precedes`.
    """
    prep = conn.dialect.identifier_preparer
    name = (prep.format_table(table) if isinstance(table, Table)
            else ".".join(prep.quote(part) for part in table.split(".")))
    conn.exec_driver_sql(f"VACUUM (FULL) {name}")
    return int(conn.execute(text("SELECT relfrozenxid::text::bigint FROM pg_class "
                                 "WHERE oid = CAST(:t AS regclass)"), {"t": name}).scalar())


def xid_precedes(xid: int, than: int) -> bool:
    """PostgreSQL's TransactionIdPrecedes on 32-bit xids (`xid` may be a 64-bit txid)."""
    return ((xid & 0xFFFF_FFFF) - than) & 0xFFFF_FFFF >= 0x8000_0000


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
    procs = [_json_text if isinstance(table.c[name].type, JSON)
             else table.c[name].type.bind_processor(conn.dialect) for name in names]
    insert_params(conn, table, names, [
        tuple([v if p is None else p(v)
               for p, v in zip(procs, map(r.__getitem__, names), strict=True)])
        for r in rows])


def bind_value(conn: Connection, column: Column, value: Any) -> Any:
    """`value` as the driver takes it for `column` (what `insert_rows` does per cell)."""
    proc = column.type.bind_processor(conn.dialect)
    return value if proc is None else proc(value)


def insert_params(conn: Connection, table: Table, names: Sequence[str],
                  params: Sequence[tuple[Any, ...]]) -> None:
    """:func:`insert_rows` of tuples the driver takes as they are: text, numbers, bytes,
    None, and what :func:`bind_value` gave (a load's 10^6 rows skip the per-cell pass)."""
    if not params:
        return
    if conn.dialect.driver == "psycopg":  # COPY is several times faster than executemany
        cur = conn.connection.driver_connection.cursor()
        with cur.copy(f"COPY {table.name} ({', '.join(names)}) FROM STDIN") as copy:
            for row in params:
                copy.write_row(row)
        return
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    conn.exec_driver_sql(f"INSERT INTO {table.name} ({', '.join(names)}) "
                         f"VALUES ({', '.join([mark] * len(names))})", params)


def upsert(conn: Connection, table: Table, values: dict[str, Any],
           on_conflict: dict[str, Any]) -> Any:
    """INSERT `values`, or UPDATE SET `on_conflict` where the primary key exists."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    return dialect_insert(table).values(values).on_conflict_do_update(
        index_elements=list(table.primary_key.columns), set_=on_conflict)


def among(conn: Connection, column: ColumnElement[Any], values: list[Any]) -> ColumnElement[bool]:
    """`column IN (values)`; on PostgreSQL one array parameter instead of one per value."""
    if conn.dialect.name == "postgresql":
        return column == any_(bindparam(None, values, type_=ARRAY(column.type)))
    if conn.dialect.name == "sqlite":  # one JSON parameter, unpacked by SQLite itself
        each = func.json_each(json.dumps(values)).table_valued("value")
        return column.in_(select(each.c.value))
    return column.in_(values)
