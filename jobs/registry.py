"""The model registry: versions in BentoML's model store, the pointer in the ledger DB.

A version's files (learner, fitted guard, ``manifest.json``) live in BentoML's
model store under the tag ``<name>:v<seq>``.
Which version is current is a row in the ledger database, so every process
(workers, service replicas) agrees on it, and it moves in the same
transaction as the ledger events that announce it. Publishing is a
compare-and-set on the parent version: two workers can never both build on
the same version.
"""

from __future__ import annotations

import contextlib
import json
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

import bentoml
from bentoml import Tag
from bentoml._internal.configuration.containers import BentoMLContainer
from bentoml._internal.models.model import ModelStore
from bentoml.exceptions import NotFound
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Connection,
    DateTime,
    Engine,
    insert,
    select,
    update,
)
from sqlmodel import Field, SQLModel

from jobs.served_model import ServedModel
from ledger.chain import iso, utc_now


class ModelVersion(SQLModel, table=True):
    """One published version and its manifest (the lineage auditors read)."""

    __tablename__ = "model_versions"

    name: str = Field(max_length=64, primary_key=True)
    version: str = Field(max_length=64, primary_key=True)
    seq: int = Field(sa_type=BigInteger, index=True)
    parent: str | None = Field(default=None, max_length=64)
    manifest: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(sa_type=DateTime(timezone=True))


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


class PublishConflict(RuntimeError):
    """The current version moved since this one was built (another worker published)."""


def version_tag(seq: int) -> str:
    return f"v{seq:06d}"


class Registry:
    """Stores, publishes and loads model versions of one model name."""

    def __init__(self, engine: Engine, name: str = "obliviate") -> None:
        self.engine = engine
        self.name = name
        SQLModel.metadata.create_all(engine, tables=[VERSIONS, POINTER])

    # ------------------------------------------------------------------ reading
    def current(self) -> ModelVersion | None:
        with self.engine.connect() as conn:
            ptr = conn.execute(select(POINTER).where(POINTER.c.name == self.name)).first()
            if ptr is None:
                return None
            row = conn.execute(select(VERSIONS).where(VERSIONS.c.name == self.name,
                                                      VERSIONS.c.version == ptr.version)).one()
        return ModelVersion.model_validate(dict(row._mapping))

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

    def lineage(self, limit: int = 100) -> list[ModelVersion]:
        """Published versions, newest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(VERSIONS).where(VERSIONS.c.name == self.name)
                                .order_by(VERSIONS.c.seq.desc()).limit(limit)).all()
        return [ModelVersion.model_validate(dict(r._mapping)) for r in rows]

    def load(self, version: str) -> ServedModel:
        return ServedModel.load(self.path(version))

    def path(self, version: str) -> Path:
        """Where a version's files are: the shared model store, else the running Bento's."""
        tag = Tag(self.name, version)
        try:
            return Path(self._home_store().get(tag).path)
        except NotFound:
            return Path(bentoml.models.get(tag).path)

    # ------------------------------------------------------------------ writing
    def next_seq(self) -> int:
        with self.engine.connect() as conn:
            return (conn.execute(select(VERSIONS.c.seq).where(VERSIONS.c.name == self.name)
                                 .order_by(VERSIONS.c.seq.desc()).limit(1)).scalar() or 0) + 1

    def save(self, model: ServedModel, seq: int, manifest: dict[str, Any]) -> str:
        """Write a version's files to the model store (not yet current); returns its tag.

        A store entry under the same tag that was never published (a worker died
        between saving and publishing) is replaced.
        """
        version = version_tag(seq)
        tag = Tag(self.name, version)
        store = self._home_store()
        with contextlib.suppress(NotFound):
            store.delete(tag)
        # BentoML metadata takes basic types only; the full manifest is a file beside.
        meta = {"learner": model.kind, "content_hash": manifest["content_hash"],
                "version_seq": seq, "parent": manifest["parent"] or ""}
        with bentoml.models.create(tag, metadata=meta,
                                   labels={"learner": model.kind, "obliviate": "version"}) as m:
            model.save(m.path)
            (Path(m.path) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        return version

    def publish(self, conn: Connection, version: str, seq: int, parent: str | None,
                manifest: dict[str, Any]) -> None:
        """Make `version` current inside the caller's (ledger) transaction.

        Raises PublishConflict unless `parent` is still the current version.
        """
        ptr = conn.execute(select(POINTER).where(POINTER.c.name == self.name)).first()
        if (ptr.version if ptr else None) != parent:
            raise PublishConflict(f"{self.name}: current is {ptr.version if ptr else None}, "
                                  f"not {parent}")
        now = utc_now()
        conn.execute(insert(VERSIONS), {"name": self.name, "version": version, "seq": seq,
                                        "parent": parent, "manifest": manifest,
                                        "created_at": now})
        values = {"version": version, "seq": seq, "updated_at": now}
        if ptr is None:
            conn.execute(insert(POINTER), {"name": self.name, **values})
        else:
            conn.execute(update(POINTER).where(POINTER.c.name == self.name).values(**values))

    def discard_unpublished(self, version: str) -> None:
        """Remove a saved version that lost its publication race."""
        with contextlib.suppress(NotFound):
            self._home_store().delete(Tag(self.name, version))

    @staticmethod
    def _home_store() -> ModelStore:
        return ModelStore(Path(BentoMLContainer.bentoml_home.get()) / "models")


def manifest(model: ServedModel, *, seq: int, parent: str | None, ledger_seq: int,
             training_set: tuple[int, str], change: dict[str, Any]) -> dict[str, Any]:
    """What a version is and how it came to be: enough to rebuild and check it."""
    count, root = training_set
    return {
        "learner": model.kind,
        "params": model.params(),
        "seed": model.learner.get_params().get("random_state"),
        "guarantee": model.learner.guarantee,
        "content_hash": model.learner.content_hash(),
        "classes": [int(c) for c in model.classes.tolist()],
        "n_features": model.n_features,
        "guard": model.guard_record(),
        "training_set": {"count": count, "merkle_root": root},
        "version_seq": seq,
        "parent": parent,
        "ledger_seq": ledger_seq,
        "change": change,
        "built_by": socket.gethostname(),
        "built_at": iso(utc_now()),
    }

