"""The model registry: versions in the model store, the pointer in the ledger database.

A version's files (learner, fitted guard, ``manifest.json``) live in the model store under
the ledger's identity (:mod:`jobs.orchestration.model_store`); which version is current is
a row of the ledger database, moved in the transaction of the events that announce it, by
a compare-and-set on the parent: two workers can never both build on the same version.
See docs/sidecar.md (Registry)."""

from __future__ import annotations

import hashlib
import json
import socket
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    func,
    insert,
    select,
    update,
)
from sqlmodel import Field, SQLModel

from jobs import sealing
from jobs.orchestration.job_settings import JobSettings
from jobs.orchestration.model_store import VersionStore
from ledger import migrations
from ledger.chain import canonical_json, iso, utc_now
from ledger.db import upsert
from ledger.error_text import first_line
from ledger.keystore import LedgerKeys
from ledger.tables import EVENTS

if TYPE_CHECKING:  # the learners (torch, numba) load only with a model
    from jobs.orchestration.served_model import ServedModel


class ModelVersion(SQLModel, table=True):
    """One published version and its manifest (the lineage auditors read).

    ``superseded_by_deletion`` names the first later version that removed records on
    request: from then on this version holds (or predates) data that was deleted, so it
    may never be loaded or served again, and it is destroyed after the grace period
    (:mod:`jobs.orchestration.retention`), when ``destroyed_at`` is set.
    """

    __tablename__ = "model_versions"

    name: str = Field(max_length=64, primary_key=True)
    version: str = Field(max_length=64, primary_key=True)
    seq: int = Field(sa_type=BigInteger, index=True)
    parent: str | None = Field(default=None, max_length=64)
    manifest: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(sa_type=DateTime(timezone=True))
    superseded_by_deletion: str | None = Field(default=None, max_length=64)
    destroyed_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))

    @property
    def unavailable(self) -> str | None:
        """Why this version may not be loaded or served; None when it may."""
        if self.destroyed_at is not None:
            return f"{self.version} was destroyed at {iso(self.destroyed_at)}"
        if self.superseded_by_deletion is not None:
            return (f"{self.version} holds records that {self.superseded_by_deletion} "
                    "removed on request; it is being destroyed")
        return None


class VersionCounter(SQLModel, table=True):
    """The last version number handed out per model name: numbers are allocated by one
    atomic upsert, so several workers never build two versions under one tag."""

    __tablename__ = "model_version_counters"

    name: str = Field(max_length=64, primary_key=True)
    last_seq: int = Field(sa_type=BigInteger)


class ModelPointer(SQLModel, table=True):
    """The current version of a model name."""

    __tablename__ = "model_pointer"

    name: str = Field(max_length=64, primary_key=True)
    version: str = Field(max_length=64)
    seq: int = Field(sa_type=BigInteger)
    updated_at: datetime = Field(sa_type=DateTime(timezone=True))


MANIFEST_FILE = "manifest.json"
VERSIONS = ModelVersion.__table__
POINTER = ModelPointer.__table__
COUNTERS = VersionCounter.__table__


class PublishConflict(RuntimeError):
    """The current version moved since this one was built (another worker published)."""


class VersionUnavailable(LookupError):
    """A version that was destroyed, or holds deleted records, was asked to be loaded."""


class VersionRefused(LookupError):
    """A version that may not be loaded although the ledger does not say it is gone: the
    pointer names one that was never published or may not be served (a hand edit), no
    publication vouches for its manifest, or its files are not what the manifest records
    (planted, replaced, missing). Nothing is built on it or served from it."""

    def __init__(self, version: str, why: str) -> None:
        super().__init__(why)
        self.version = version


def version_tag(seq: int) -> str:
    return f"v{seq:06d}"


class Registry:
    """Stores, publishes and loads model versions of one model name."""

    def __init__(self, engine: Engine, name: str = "obliviate",
                 keys: LedgerKeys | None = None, store: str | None = None) -> None:
        """`keys`: the ledger's key store (`Ledger.keys`; default: the store of
        OBLIVIATE_KEY_STORE_DIR), where each version's sealing key is kept; `store`: the
        model store (default OBLIVIATE_MODEL_STORE), where its files are, under the
        ledger's identity."""
        self.engine = engine
        self.name = name
        self.keys = keys if keys is not None else LedgerKeys(engine)
        self.store = VersionStore(name, store or JobSettings.from_env().model_store,
                                  self.keys.scope)
        migrations.ensure(engine)  # its tables are in the ledger's migrations

    # ------------------------------------------------------------------ reading
    def current(self) -> ModelVersion | None:
        """The version the pointer names (read in one statement: the pointer and the row
        it names are of one publication)."""
        with self.engine.connect() as conn:
            row = conn.execute(select(VERSIONS).join(POINTER, (POINTER.c.name == VERSIONS.c.name)
                                                     & (POINTER.c.version == VERSIONS.c.version))
                               .where(POINTER.c.name == self.name)).first()
        return None if row is None else ModelVersion.model_validate(dict(row._mapping))

    def servable_current(self) -> ModelVersion | None:
        """The current version, None before the first; VersionRefused when the pointer
        names a version that was never published or may not be served (only a hand edit
        does that: a deletion moves the pointer in the transaction that supersedes)."""
        with self.engine.connect() as conn:
            row = conn.execute(select(POINTER.c.version.label("named"), VERSIONS)
                               .select_from(POINTER.outerjoin(
                                   VERSIONS, (POINTER.c.name == VERSIONS.c.name)
                                   & (POINTER.c.version == VERSIONS.c.version)))
                               .where(POINTER.c.name == self.name)).first()
        if row is None:
            return None
        if row.version is None:
            raise VersionRefused(row.named, f"the model pointer names {row.named}, which was "
                                            "never published")
        cur = ModelVersion.model_validate({k: v for k, v in row._mapping.items()
                                           if k != "named"})
        if cur.unavailable:
            raise VersionRefused(cur.version, f"the model pointer names {cur.version}, which "
                                              f"may not be served: {cur.unavailable}")
        return cur

    def current_seq(self) -> int:
        """Sequence number of the current version; 0 before the first one."""
        with self.engine.connect() as conn:
            return conn.execute(select(POINTER.c.seq).where(POINTER.c.name == self.name)
                                ).scalar() or 0

    def get(self, version: str) -> ModelVersion:
        with self.engine.connect() as conn:
            row = conn.execute(select(VERSIONS).where(VERSIONS.c.name == self.name,
                                                      VERSIONS.c.version == version)).first()
        if row is None:
            raise KeyError(f"no published version {self.name}:{version}")
        return ModelVersion.model_validate(dict(row._mapping))

    def lineage(self, limit: int = 100, before: int | None = None) -> list[ModelVersion]:
        """The newest `limit` published versions, newest first, of those numbered below
        `before` if given (the next page starts before the last seq of this one).
        ValueError for a limit under 1: SQLite reads LIMIT -1 as no limit, PostgreSQL
        refuses it."""
        if limit < 1:
            raise ValueError(f"the lineage's limit must be at least 1, got {limit}")
        q = select(VERSIONS).where(VERSIONS.c.name == self.name)
        if before is not None:
            q = q.where(VERSIONS.c.seq < before)
        with self.engine.connect() as conn:
            rows = conn.execute(q.order_by(VERSIONS.c.seq.desc()).limit(limit)).all()
        return [ModelVersion.model_validate(dict(r._mapping)) for r in rows]

    def load(self, version: str) -> ServedModel:
        """The version's model, held to what the ledger published: VersionUnavailable for
        one destroyed or holding deleted records (whatever the pointer says);
        VersionRefused for one never published, whose manifest no publication event
        vouches for, or whose files are not those its manifest records."""
        from jobs.orchestration.served_model import load_as_published

        try:
            row = self.get(version)
        except KeyError:
            raise VersionRefused(version, f"{version} was never published") from None
        if row.unavailable:
            raise VersionUnavailable(row.unavailable)
        man = self.vouched_manifest(row)
        try:
            with sealing.sealed_with(self.key(version)):
                return load_as_published(self.path(version), man)
        except Exception as exc:  # noqa: BLE001 - whatever a planted file makes a loader raise
            why = self.get(version).unavailable  # destroyed while it was read: not refused
            if why:
                raise VersionUnavailable(why) from None
            raise VersionRefused(version, f"{version} is not what was published: "
                                          f"{first_line(exc)}") from None

    def vouched_manifest(self, row: ModelVersion) -> dict[str, Any]:
        """`row`'s manifest, once the event that published it carries its digest (the
        ledger vouches for it); VersionRefused otherwise (the row was edited)."""
        with self.engine.connect() as conn:
            payload = conn.execute(
                select(EVENTS.c.payload)
                .where(EVENTS.c.seq > int(row.manifest.get("ledger_seq") or 0),
                       EVENTS.c.model_version == row.version)
                .order_by(EVENTS.c.seq).limit(1)).scalar()
        try:
            said = json.loads(payload or "{}").get("manifest_sha256")
        except (ValueError, AttributeError):
            said = None
        if said is None:
            raise VersionRefused(row.version, f"{row.version}: no publication event carries "
                                              "the digest of its manifest")
        if said != manifest_sha256(row.manifest):
            raise VersionRefused(row.version, f"{row.version}: its manifest is not the one its "
                                              "publication event vouches for (edited)")
        return row.manifest

    def key(self, version: str) -> bytes:
        """The key `version`'s files are sealed under; VersionUnavailable once destroyed."""
        key = self.keys.get(self.key_name(version))
        if key is None:
            raise VersionUnavailable(f"{self.name}:{version} has no key in the key store "
                                     f"{self.keys.store!r}: it was destroyed, or never saved")
        return key

    def has_key(self, version: str) -> bool:
        """Whether `version`'s sealing key still exists (a destroyed version has none)."""
        return self.keys.get(self.key_name(version)) is not None

    def key_name(self, version: str, conn: Connection | None = None) -> str:
        """Where `version`'s sealing key is kept in the ledger's key store (`conn`: the
        connection the caller holds, if any)."""
        return self.keys.name("versions", self.name, version, conn=conn)

    def keyed_versions(self) -> set[str]:
        """Versions of this model name whose sealing key is in the key store."""
        names = self.keys.names("versions", self.name)  # none before the ledger's first event
        return {n.rsplit("/", 1)[-1] for n in names}

    def path(self, version: str) -> Path:
        """Where a version's files are: the shared model store, else the running Bento's."""
        return self.store.path(version)

    # ------------------------------------------------------------------ writing
    def allocate_seq(self) -> int:
        """A version number no one else has or will get (one atomic upsert; numbers that
        are not published are skipped, never reused)."""
        start = (select(func.coalesce(func.max(VERSIONS.c.seq), 0) + 1)
                 .where(VERSIONS.c.name == self.name).scalar_subquery())
        with self.engine.begin() as conn:
            return int(conn.execute(
                upsert(conn, COUNTERS, {"name": self.name, "last_seq": start},
                       {"last_seq": COUNTERS.c.last_seq + 1})
                .returning(COUNTERS.c.last_seq)).scalar_one())

    def save(self, model: ServedModel, seq: int, manifest: dict[str, Any]) -> str:
        """Write a version's files to the model store (not yet current); returns its tag.

        `seq` comes from :meth:`allocate_seq`, so no other version has this tag: the
        store is never asked to replace a version's files.
        """
        version = version_tag(seq)
        key = sealing.new_key()
        self.keys.put(self.key_name(version), key)  # the key first: no file without its key

        def fill(path: Path) -> None:
            with sealing.sealed_with(key):
                model.save(path)
            (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))

        # BentoML metadata takes basic types only; the full manifest is a file beside.
        meta = {"learner": model.kind, "content_hash": manifest["content_hash"],
                "version_seq": seq, "parent": manifest["parent"] or ""}
        self.store.write(version, meta, {"learner": model.kind, "obliviate": "version"}, fill)
        return version

    def publish(self, conn: Connection, version: str, seq: int, parent: str | None,
                manifest: dict[str, Any], removes_records: bool = False) -> None:
        """Make `version` current inside the caller's (ledger) transaction.

        Raises PublishConflict unless `parent` is still the current version. When the
        version removes records on request (`removes_records`), every earlier version
        becomes unavailable at once and is destroyed after the grace period.
        """
        ptr = conn.execute(select(POINTER).where(POINTER.c.name == self.name)).first()
        if (ptr.version if ptr else None) != parent:
            raise PublishConflict(f"{self.name}: current is {ptr.version if ptr else None}, "
                                  f"not {parent}")
        now = utc_now()
        if removes_records:
            conn.execute(update(VERSIONS).where(
                VERSIONS.c.name == self.name, VERSIONS.c.seq < seq,
                VERSIONS.c.superseded_by_deletion.is_(None)).values(
                superseded_by_deletion=version))
        conn.execute(insert(VERSIONS), {"name": self.name, "version": version, "seq": seq,
                                        "parent": parent, "manifest": manifest,
                                        "created_at": now})
        values = {"version": version, "seq": seq, "updated_at": now}
        if ptr is None:
            conn.execute(insert(POINTER), {"name": self.name, **values})
        else:
            conn.execute(update(POINTER).where(POINTER.c.name == self.name).values(**values))

    def discard_unpublished(self, version: str) -> None:
        """Remove a saved version that lost its publication race, and its key."""
        self.remove_files(version)
        self.destroy_key(version)

    def destroy_key(self, version: str, conn: Connection | None = None) -> bool:
        """Destroy `version`'s sealing key: every copy of its files becomes unreadable."""
        return self.keys.delete(self.key_name(version, conn))

    def remove_files(self, version: str) -> bool:
        """Delete a version's directory from the model store; False if it had none."""
        return self.store.remove(version)

    def stored_versions(self) -> list[str]:
        """Versions of this model name that have files in the model store."""
        return self.store.versions()


def manifest(model: ServedModel, *, seq: int, parent: str | None, ledger_seq: int,
             training_set: tuple[int, str], change: dict[str, Any]) -> dict[str, Any]:
    """What a version is and how it came to be: enough to rebuild and check it."""
    count, root = training_set
    out = {
        "learner": model.kind,
        "params": model.params(),
        "seed": model.learner.get_params().get("random_state"),
        "guarantee": model.learner.guarantee,
        # what this version's answers are certified against: "approximate" until an exact
        # retrain replaces it (its change says which versions it replaces)
        "forgetting": model.forgetting,
        "device": model.device,
        "content_hash": model.learner.content_hash(),
        "classes": [int(c) for c in model.classes.tolist()],
        "n_features": model.n_features,
        # what Registry.load holds the guard it loads to (None: the version has none)
        "guard": {**model.guard_record(), "content_hash": model.guard_hash()},
        "training_set": {"count": count, "merkle_root": root},
        "version_seq": seq,
        "parent": parent,
        "ledger_seq": ledger_seq,
        "change": change,
        "built_by": socket.gethostname(),
        "built_at": iso(utc_now()),
    }
    if (network := model.network_record()) is not None:
        # the user's network: its import path and the SHA-256 of its source, whose copy
        # the version's files hold (docs/learners.md, "Your own network")
        out["network"] = network
    return out


def manifest_sha256(manifest: dict[str, Any]) -> str:
    """The digest the ledger's publication and `destroyed` events give for a manifest, of
    the manifest as its JSON column hands it back: integer keys (SISA's `from_slice`
    per shard) come back as text, and sorted as text "10" precedes "2", so the digest
    taken at publication must see them as text too, or a version of 11+ shards is
    refused as edited."""
    stored = json.loads(canonical_json(manifest))
    return hashlib.sha256(canonical_json(stored).encode()).hexdigest()
