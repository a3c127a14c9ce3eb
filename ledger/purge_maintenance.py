"""Purge maintenance: making the bytes of purged records leave the database's files.

A deleted row's bytes stay in pages, the WAL and old table files until the database
rewrites them: SQLite gets a TRUNCATE checkpoint, PostgreSQL a VACUUM FULL of
`record_payloads` and `sealed_payloads`. Every purging transaction counts itself
(:func:`note_purge`), so a crash before maintenance leaves the purge pending, not lost.
See docs/security.md (The ledger database)."""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, case, func, select, text
from sqlalchemy.exc import DBAPIError

from ledger.chain import as_utc, utc_now
from ledger.db import (
    pg_vacuum_full,
    sqlite_checkpoint,
    sqlite_vacuum,
    upsert,
    writing,
    xid_precedes,
)
from ledger.sealed_payloads import PayloadSealer
from ledger.tables import MAINTENANCE, PAYLOADS, RECORDS, SEALED

log = logging.getLogger("obliviate.ledger")

# Seconds between purge maintenance runs unless configured (OBLIVIATE_PURGE_MAINTENANCE_S).
# SQLite: a WAL checkpoint costs milliseconds, so after every purge. PostgreSQL: VACUUM
# FULL rewrites the whole payload table (measured on a 2-core machine, 30 features:
# 0.3 s and 66 MiB of WAL at 10^5 records, 2-4 s and 665 MiB at 10^6) and holds back
# additions while it runs, so at most every 10 minutes.
PURGE_MAINTENANCE_DEFAULT_S = {"sqlite": 0.0, "postgresql": 600.0}
_MAINTENANCE_RETRY_S = 30.0  # a run that could not erase everything is retried this soon
_PG_LOCK_TIMEOUT_S = 3.0  # VACUUM FULL gives up (and retries later) rather than queue longer
_MAINTENANCE_LOCK_KEY = 0x0B11_71A7F  # PostgreSQL advisory lock: one maintenance at a time


class PurgeMaintenance:
    """Runs (and throttles) the rewrite that erases purged records' bytes."""

    def __init__(self, engine: Engine, sealer: PayloadSealer,
                 interval_s: float | None = None) -> None:
        """`interval_s`: minimum seconds between two runs (None: the backend's default)."""
        self.engine = engine
        self.sealer = sealer
        self.interval_s = float(PURGE_MAINTENANCE_DEFAULT_S.get(engine.dialect.name, 0.0)
                                if interval_s is None else interval_s)

    def status(self) -> dict[str, Any]:
        """Purges counted, purges whose bytes maintenance has erased, and when."""
        with self.engine.connect() as conn:
            row = conn.execute(select(MAINTENANCE).where(MAINTENANCE.c.id == 1)).first()
        if row is None:
            return {"purges": 0, "erased": 0, "pending": 0, "rewrite_records": False,
                    "pending_tables": [], "last_purge_at": None, "last_run_at": None,
                    "last_erased_at": None, "last_outcome": None, "last_purge_xid": None}
        out = {k: row._mapping[k] for k in ("purges", "erased", "rewrite_records",
                                            "last_outcome", "last_purge_xid")}
        out["pending_tables"] = list(row.pending_tables or [])
        for k in ("last_purge_at", "last_run_at", "last_erased_at"):
            out[k] = None if row._mapping[k] is None else as_utc(row._mapping[k])
        out["pending"] = row.purges - row.erased
        return out

    def run(self, force: bool = False) -> dict[str, Any]:
        """Make the bytes of purged records leave the database's files.

        Runs only when purges happened since the last successful run, and at most
        every `interval_s` seconds (a run that could not finish: after at most
        30 s) unless `force`. A busy database does not raise; the outcome says what
        happened: "erased"; "blocked" (SQLite readers kept the WAL); "locked" (a
        PostgreSQL lock wait over 3 s); "held" (a snapshot older than the purge was
        open, so the rewrite had to keep its rows); "busy" (another process is running
        maintenance); "throttled"; "nothing to do".
        """
        t0 = time.perf_counter()
        state = self.status()
        out: dict[str, Any] = {"backend": self.engine.dialect.name, "ran": False,
                               "outcome": None, "pending": state["pending"],
                               "erased": state["pending"] == 0, "seconds": 0.0}
        skip = None if force else self._skip(state)
        if skip is not None:
            out.update(skip)
            return out
        if self.engine.dialect.name == "postgresql":
            outcome, tables = self._pg_maintenance(state)
        else:
            outcome, tables = self._sqlite_maintenance(state)
        if outcome != "busy":
            self._record_run(state, outcome)
            swept = self.sealer.sweep(self.engine)
            if swept:
                log.warning("destroyed %d payload key(s) of purged records that a crash had "
                            "left in the key store", swept)
        after = self.status()
        out.update(ran=outcome != "busy", outcome=outcome, erased=outcome == "erased",
                   pending=after["pending"], tables=tables,
                   seconds=round(time.perf_counter() - t0, 4))
        log.info("purge maintenance: %s (%s) in %.3f s; %d purge(s) pending", outcome,
                 ", ".join(tables) or "-", out["seconds"], out["pending"])
        return out

    def after_purge(self) -> None:
        """On SQLite, the checkpoint that takes purged pages out of the WAL, right after
        the purge; it never fails the purge (logged: the next run retries)."""
        if self.engine.dialect.name != "sqlite":
            return
        try:
            self.run()
        except Exception:  # noqa: BLE001 - logged; the next maintenance call retries
            log.exception("purge maintenance after a purge failed; the next call retries")

    def _skip(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Why this run does nothing ("nothing to do", "throttled"), else None."""
        if state["pending"] <= 0 and not state["rewrite_records"]:
            return {"outcome": "nothing to do"}
        if state["last_run_at"] is not None:
            wait = self.interval_s
            if state["last_outcome"] != "erased":
                wait = min(wait, _MAINTENANCE_RETRY_S)
            age = (utc_now() - state["last_run_at"]).total_seconds()
            if age < wait:
                return {"outcome": "throttled", "due_in_s": round(wait - age, 3)}
        return None

    def _sqlite_maintenance(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        tables = []
        if state["rewrite_records"]:
            try:
                sqlite_vacuum(self.engine)  # a file from before secure_delete: rebuild it once
                tables.append("VACUUM")
            except Exception as exc:  # noqa: BLE001 - sqlite3.OperationalError: busy
                log.warning("VACUUM of the ledger failed (%s); the next maintenance retries", exc)
                return "blocked", tables
        tables.append("wal_checkpoint(TRUNCATE)")
        return ("erased" if sqlite_checkpoint(self.engine) else "blocked"), tables

    def _pg_maintenance(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        tables: list[Any] = [PAYLOADS, SEALED] + ([RECORDS] if state["rewrite_records"] else [])
        tables += [t for t in state["pending_tables"]
                   if t not in {PAYLOADS.name, SEALED.name, RECORDS.name}]
        with self.engine.connect() as c:
            conn = c.execution_options(isolation_level="AUTOCOMMIT")
            if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"),
                                {"k": _MAINTENANCE_LOCK_KEY}).scalar():
                return "busy", []
            try:
                conn.exec_driver_sql(f"SET lock_timeout = '{int(_PG_LOCK_TIMEOUT_S * 1000)}ms'")
                horizons = {}
                for t in tables:
                    name = getattr(t, "name", t)
                    try:
                        horizons[name] = pg_vacuum_full(conn, t)
                    except DBAPIError as exc:
                        code = getattr(exc.orig, "sqlstate", None)
                        if code == "42P01":  # undefined_table: gone, nothing left to erase
                            log.warning("purge maintenance: no table %s to rewrite", name)
                            continue
                        if code != "55P03":  # lock_not_available
                            raise
                        log.warning("VACUUM FULL %s waited over %.0f s for its lock; the next "
                                    "maintenance retries", name, _PG_LOCK_TIMEOUT_S)
                        return "locked", list(horizons)
                xid = state["last_purge_xid"]
                held = [n for n, frozen in horizons.items()
                        if xid is not None and not xid_precedes(xid, frozen)]
                if held:
                    log.warning("VACUUM FULL %s kept the latest purge's rows: a snapshot older "
                                "than the purge is still open (%s), or this role does not own "
                                "the table (VACUUM skipped it); the next maintenance retries",
                                ", ".join(held), _snapshot_holders(conn))
                    return "held", list(horizons)
                return "erased", list(horizons)
            finally:
                conn.exec_driver_sql("RESET lock_timeout")
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _MAINTENANCE_LOCK_KEY})

    def _record_run(self, state: dict[str, Any], outcome: str) -> None:
        """Write down the run; an erasing run covers the purges counted before it started."""
        now = utc_now()
        values: dict[str, Any] = {"last_run_at": now, "last_outcome": outcome}
        with writing(self.engine) as conn:
            if outcome == "erased":
                values.update(erased=case((MAINTENANCE.c.erased < state["purges"],
                                           state["purges"]), else_=MAINTENANCE.c.erased),
                              last_erased_at=now)
                if state["rewrite_records"]:
                    values["rewrite_records"] = False
                if state["pending_tables"]:  # keep what a purge since added
                    now_pending = conn.execute(select(MAINTENANCE.c.pending_tables)
                                               .where(MAINTENANCE.c.id == 1)).scalar() or []
                    values["pending_tables"] = [t for t in now_pending
                                                if t not in state["pending_tables"]]
            conn.execute(upsert(conn, MAINTENANCE, {"id": 1, "purges": 0, "erased": 0,
                                                    "rewrite_records": False,
                                                    "last_run_at": now, "last_outcome": outcome},
                                values))


def note_purge(conn: Connection, now: datetime) -> None:
    """Count a purging transaction (and on PostgreSQL its xid) for purge maintenance."""
    values: dict[str, Any] = {"last_purge_at": now, "last_purge_xid": None}
    new_xid: dict[str, Any] = {}
    if conn.dialect.name == "postgresql":
        values["last_purge_xid"] = func.txid_current()
        # the largest purge xid, whatever order concurrent purges commit in
        new_xid["last_purge_xid"] = func.greatest(MAINTENANCE.c.last_purge_xid,
                                                  func.txid_current())
    conn.execute(upsert(conn, MAINTENANCE,
                        {"id": 1, "purges": 1, "erased": 0, "rewrite_records": False,
                         **values},
                        {"purges": MAINTENANCE.c.purges + 1, **values, **new_xid}))


def _snapshot_holders(conn: Connection) -> str:
    """What may hold PostgreSQL's xmin horizon back: the oldest snapshots, slots, 2PC."""
    found = [f"pid {r.pid} ({r.usename}, {r.state}, since {r.xact_start})" for r in conn.execute(
        text("SELECT pid, usename, state, xact_start FROM pg_stat_activity "
             "WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() "
             "ORDER BY age(backend_xmin) DESC LIMIT 3"))]
    found += [f"replication slot {n}" for n in conn.execute(text(
        "SELECT slot_name FROM pg_replication_slots WHERE xmin IS NOT NULL "
        "OR catalog_xmin IS NOT NULL")).scalars()]
    found += [f"prepared transaction {g}" for g in conn.execute(text(
        "SELECT gid FROM pg_prepared_xacts")).scalars()]
    return "; ".join(found) or "none visible to this role"
