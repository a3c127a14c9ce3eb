"""Destroying the versions that hold deleted records.

A version published by deletion supersedes every earlier one; after the grace period each
is destroyed: in one ledger transaction ``destroyed_at`` (a compare-and-set) and a
``destroyed`` event, its key destroyed in the key store first; then its directory.
:func:`sweep` removes what a crash in between, or an unpublished save, left behind.
See docs/security.md (Versions)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import Connection, select, update

from jobs.orchestration.registry import POINTER, VERSIONS, Registry, manifest_sha256
from ledger.chain import iso, utc_now
from ledger.store import Ledger

log = logging.getLogger("obliviate.retention")


class _AlreadyDestroyed(Exception):
    """Another worker destroyed the version first (the transaction is rolled back)."""


def destroy_due(registry: Registry, ledger: Ledger, grace_s: float) -> list[str]:
    """Destroy every version superseded by a deletion at least `grace_s` seconds ago."""
    newer = VERSIONS.alias("newer")
    cutoff = utc_now() - timedelta(seconds=grace_s)
    with ledger.engine.connect() as conn:
        due = conn.execute(
            select(VERSIONS.c.version, VERSIONS.c.seq, VERSIONS.c.manifest,
                   VERSIONS.c.superseded_by_deletion)
            .join(newer, (newer.c.name == VERSIONS.c.name)
                  & (newer.c.version == VERSIONS.c.superseded_by_deletion))
            .where(VERSIONS.c.name == registry.name, VERSIONS.c.destroyed_at.is_(None),
                   newer.c.created_at <= cutoff)
            .order_by(VERSIONS.c.seq)).all()
    destroyed = []
    for row in due:
        payload = {"version": row.version, "manifest_sha256": manifest_sha256(row.manifest),
                   "content_hash": row.manifest["content_hash"],
                   "superseded_by": row.superseded_by_deletion,
                   "reason": "superseded by a version that removed records on request",
                   "grace_s": grace_s}
        try:
            ledger.events.append("destroyed", payload, row.version,
                                in_transaction=_mark_destroyed(registry, row.version))
        except _AlreadyDestroyed:
            continue
        registry.remove_files(row.version)
        destroyed.append(row.version)
        log.info("destroyed %s (superseded by %s)", row.version, row.superseded_by_deletion)
    return destroyed


def _mark_destroyed(registry: Registry, version: str) -> Callable[[Connection], None]:
    """Set `destroyed_at` and destroy the key, inside the transaction of the event: should
    it not commit, the version stays unservable (superseded) and is destroyed again."""
    def mark(conn: Connection) -> None:
        done = conn.execute(update(VERSIONS).where(
            VERSIONS.c.name == registry.name, VERSIONS.c.version == version,
            VERSIONS.c.destroyed_at.is_(None)).values(destroyed_at=utc_now()))
        if done.rowcount != 1:
            raise _AlreadyDestroyed(version)
        registry.destroy_key(version, conn)
    return mark


def sweep(registry: Registry) -> list[str]:
    """Remove files and keys no servable version owns: destroyed versions' files left by a
    crash, and versions saved but never published that the current one has passed."""
    with registry.engine.connect() as conn:
        current = conn.execute(select(POINTER.c.seq).where(POINTER.c.name == registry.name)
                               ).scalar() or 0
        published = {r.version: r.destroyed_at is not None for r in conn.execute(
            select(VERSIONS.c.version, VERSIONS.c.destroyed_at)
            .where(VERSIONS.c.name == registry.name))}
    keyed = registry.keyed_versions()
    removed = []
    for version in sorted(set(registry.stored_versions()) | keyed):
        if version in published:
            if published[version] and (registry.remove_files(version)
                                       | (version in keyed and registry.destroy_key(version))):
                removed.append(version)
        elif _seq(version) <= current:
            registry.discard_unpublished(version)
            removed.append(version)
    if removed:
        log.info("swept %s from the model store", ", ".join(removed))
    return removed


def _seq(version: str) -> int:
    try:
        return int(version.lstrip("v"))
    except ValueError:  # not one of ours: never ours to remove
        return 1 << 62


def destroyed_versions(registry: Registry) -> list[tuple[str, str]]:
    """(version, destroyed at) of every destroyed version, oldest first."""
    with registry.engine.connect() as conn:
        rows = conn.execute(select(VERSIONS.c.version, VERSIONS.c.destroyed_at)
                            .where(VERSIONS.c.name == registry.name,
                                   VERSIONS.c.destroyed_at.is_not(None))
                            .order_by(VERSIONS.c.seq)).all()
    return [(r.version, iso(r.destroyed_at)) for r in rows]
