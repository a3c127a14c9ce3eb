"""Keys that crypto-shredding relies on, kept outside the database.

A database keeps what it deletes in places no DELETE reaches (WAL, archives, dead tuples,
backups, replicas), so versions' sealing keys and added records' payload keys live here and
the database keeps only ciphertext. :class:`KeyStore` is the interface a KMS would implement,
:class:`DirectoryKeyStore` the default (0600 files in a 0700 directory), :class:`LedgerKeys`
one ledger's share of a store.
See docs/security.md (Crypto-shredding)."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Protocol

from sqlalchemy import Connection, Engine, select

KEY_BYTES = 32
DEFAULT_DIR = ".obliviate/keys"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class KeyStoreError(RuntimeError):
    """The key store cannot be used (not reachable, not writable, or a name is invalid)."""


class KeyStore(Protocol):
    """Named secret keys; names are '/'-separated paths of [A-Za-z0-9._-] parts."""

    def put(self, name: str, key: bytes) -> None:
        """Store `key` under `name` durably before returning; FileExistsError if taken."""

    def get(self, name: str) -> bytes | None:
        """The key, or None when there is none (never stored, or destroyed)."""

    def delete(self, name: str) -> bool:
        """Destroy the key; False when there was none."""

    def names(self, prefix: str) -> list[str]:
        """The names of the keys under `prefix` (a '/'-separated path)."""


class DirectoryKeyStore:
    """One 0600 file per key under a 0700 directory (``OBLIVIATE_KEY_STORE_DIR``, default
    ``.obliviate/keys``), shared by every process of a deployment (docs/operations.md)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"DirectoryKeyStore({str(self.root)!r})"

    def put(self, name: str, key: bytes) -> None:
        path = self._path(name)
        self._mkdirs(path.parent)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, key.hex().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and refuses to replace a key that exists
        finally:
            tmp.unlink()
        _fsync_dir(path.parent)

    def get(self, name: str) -> bytes | None:
        try:
            text = self._path(name).read_text().strip()
        except FileNotFoundError:
            return None
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise KeyStoreError(f"key file {self._path(name)} is not hex") from None

    def delete(self, name: str) -> bool:
        path = self._path(name)
        try:
            size = path.stat().st_size
            with open(path, "r+b") as fh:  # overwrite before unlinking (best effort)
                fh.write(b"0" * size)
                fh.flush()
                os.fsync(fh.fileno())
            path.unlink()
        except FileNotFoundError:
            return False
        _fsync_dir(path.parent)
        return True

    def names(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith("."))

    def _path(self, name: str) -> Path:
        parts = name.split("/")
        if not all(_NAME.fullmatch(p) for p in parts):
            raise KeyStoreError(f"invalid key name {name!r}")
        return self.root.joinpath(*parts)

    def _mkdirs(self, d: Path) -> None:
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise KeyStoreError(f"the key store {self.root} cannot be written: {exc}") from exc


def default_key_store() -> DirectoryKeyStore:
    """The store of ``OBLIVIATE_KEY_STORE_DIR`` (default ``.obliviate/keys``)."""
    return DirectoryKeyStore(os.environ.get("OBLIVIATE_KEY_STORE_DIR") or DEFAULT_DIR)


class LedgerKeys:
    """One ledger's keys in a (possibly shared) store, under the ledger's identity: the
    first 16 hex digits of its first event's hash, which the hash chain fixes for good
    and a database restore keeps."""

    def __init__(self, engine: Engine, store: KeyStore | None = None) -> None:
        self.engine = engine
        self.store: KeyStore = store if store is not None else default_key_store()
        self._scope: str | None = None

    def scope(self, conn: Connection | None = None) -> str | None:
        """The ledger's identity (None before its first event). Pass the connection the
        caller holds: on SQLite a second one would wait for the first one's lock."""
        if self._scope is None:
            if conn is not None:
                self._scope = ledger_scope(conn)
            else:
                with self.engine.connect() as c:
                    self._scope = ledger_scope(c)
        return self._scope

    def name(self, kind: str, *parts: str, conn: Connection | None = None) -> str:
        scope = self.scope(conn)
        if scope is None:
            raise KeyStoreError("the ledger has no event yet: nothing to keep keys for")
        return "/".join((scope, kind, *parts))

    def put(self, name: str, key: bytes) -> None:
        self.store.put(name, key)

    def get(self, name: str) -> bytes | None:
        return self.store.get(name)

    def delete(self, name: str) -> bool:
        return self.store.delete(name)

    def names(self, kind: str, *parts: str) -> list[str]:
        """The names of this ledger's keys of `kind` (none before its first event)."""
        scope = self.scope()
        return [] if scope is None else self.store.names("/".join((scope, kind, *parts)))


def ledger_scope(conn: Connection) -> str | None:
    """The first event's hash, shortened; None for a ledger without events."""
    from ledger.tables import EVENTS

    h = conn.execute(select(EVENTS.c.hash).where(EVENTS.c.seq == 1)).scalar()
    return None if h is None else h[:16]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
