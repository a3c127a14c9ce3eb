"""The database schema, as Alembic migrations: every table of the sidecar, one history.

The ledger's, the registry's, the seed budgets' and the guard usage's tables share one
database and one chain of revisions (``versions/``). Nothing else creates or alters a table:
constructors and commands call :func:`ensure`, which upgrades to :data:`HEAD` in one
transaction holding the write lock. Every revision converges (creates only what is
missing), so pre-migration databases of any partial shape reach head.
See docs/ledger.md (Database schema and migrations)."""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, inspect, text

if TYPE_CHECKING:
    from ledger.keystore import KeyStore

log = logging.getLogger("obliviate.ledger")

# The newest revision in versions/ (a test holds this to Alembic's own view of the chain).
HEAD = "0009_request_records"
VERSION_TABLE = "alembic_version"
SCRIPT_LOCATION = Path(__file__).resolve().parent
_LOCK_KEY = 0x0B11_71A80  # PostgreSQL advisory lock: one upgrade at a time

_ready: weakref.WeakKeyDictionary[Engine, Upgrade] = weakref.WeakKeyDictionary()
_ready_lock = threading.Lock()


@dataclass(frozen=True)
class Upgrade:
    """What :func:`upgrade` found and left: revisions before and after (None: empty, or
    a database from before the migrations)."""

    before: str | None
    after: str
    created: bool = False  # the database held no table: nothing was there to upgrade

    @property
    def changed(self) -> bool:
        return self.before != self.after

    @property
    def upgraded(self) -> bool:
        """An existing database's schema was changed (worth telling its operator)."""
        return self.changed and not self.created

    def describe(self) -> str:
        if not self.changed:
            return f"database schema at revision {self.after} (head)"
        if self.created:
            return f"database schema created at revision {self.after} (head)"
        return (f"database schema upgraded from {self.before or 'no revision'} to "
                f"{self.after} (head)")


def current(bind: Engine | Connection) -> str | None:
    """The database's revision; None for an empty database or one from before migrations."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return current(conn)
    if not inspect(bind).has_table(VERSION_TABLE):
        return None
    return bind.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def upgrade(engine: Engine, key_store: KeyStore | None = None) -> Upgrade:
    """Bring the database to :data:`HEAD`; a no-op (one SELECT) once it is there.

    `key_store` receives what a revision takes out of the database (0004: the model
    versions' sealing keys); a revision that needs it and has none refuses.

    What the first call of this process found is remembered per engine, so the
    start-up report of a process whose ledger was opened (and so upgraded) earlier
    still says what changed.
    """
    with _ready_lock:
        done = _ready.get(engine)
    if done is not None:
        return done
    before, created = current(engine), False
    if before != HEAD:
        before, created = _run(engine, key_store)
    result = Upgrade(before, HEAD, created)
    with _ready_lock:
        _ready.setdefault(engine, result)
    if result.changed:
        log.info("%s", result.describe())
    return result


ensure = upgrade


def _run(engine: Engine, key_store: KeyStore | None) -> tuple[str | None, bool]:
    """Run the upgrade in one transaction holding the write lock; returns the revision
    found inside it, and whether the database held no table at all."""
    from alembic import command
    from alembic.config import Config

    with engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE (the ledger's engines)
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
        before = current(conn)
        if before == HEAD:  # another process upgraded meanwhile
            return before, False
        created = not inspect(conn).get_table_names()
        cfg = Config()
        cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
        if before is not None and before not in _known(cfg):
            raise RuntimeError(f"the database's schema is at revision {before!r}, which this "
                               f"version of obliviate does not know (its newest is {HEAD}): "
                               "a newer obliviate migrated it; run that version")
        cfg.attributes["connection"] = conn
        cfg.attributes["key_store"] = key_store
        command.upgrade(cfg, "head")
    return before, created


def _known(cfg: object) -> set[str]:
    from alembic.script import ScriptDirectory

    return {r.revision for r in ScriptDirectory.from_config(cfg).walk_revisions()}


def script_heads() -> list[str]:
    """Alembic's own view of the chain's heads (for tests and `ledger migrate`)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    return list(ScriptDirectory.from_config(cfg).get_heads())
