"""Version directories in BentoML's model store, written and removed by several processes.

BentoML's own store is not safe for several writers: it creates an item in place
(another process listing the store meanwhile meets a directory without
``model.yaml`` and fails), and deleting one item re-reads every other. Workers on
several hosts share one store, so here a version is written into a staging
directory beside the store (a BentoML store of its own, so its ``model.yaml`` is
BentoML's) and renamed into place whole, and a removal renames it out of the
store before deleting it. A writer holds the lock of its staging directory, and of
the temporary directory BentoML fills first (``bentoml-model-<name>-*`` in the
system's temporary directory), until both are removed; a writer killed mid-save
leaves them to the next :meth:`VersionStore.remove_leftovers`
(:mod:`jobs.orchestration.leftovers`). Readers only ever see complete versions; the ``latest``
pointer BentoML keeps per model name (``bentoml build`` resolves ``name:latest``
through it) names the highest version present.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import bentoml
from bentoml import Tag
from bentoml._internal.configuration.containers import BentoMLContainer
from bentoml._internal.models.model import ModelStore
from bentoml.exceptions import NotFound

from jobs.orchestration.leftovers import adopt_dir, make_dir, remove_abandoned

_STAGING = "obliviate-staging"
_TRASH = "obliviate-trash"


class VersionStore:
    """The versions of one model name in the shared model store (``$BENTOML_HOME``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def home(self) -> Path:
        return Path(BentoMLContainer.bentoml_home.get())

    @property
    def root(self) -> Path:
        return self.home / "models"

    def path(self, version: str) -> Path:
        """A version's directory: the shared store's, else the running Bento's own."""
        p = self.root / self.name / version
        if (p / "model.yaml").is_file():
            return p
        try:
            return Path(bentoml.models.get(Tag(self.name, version)).path)
        except NotFound:
            raise NotFound(f"{self.name}:{version} has no files in {self.root}") from None

    def versions(self) -> list[str]:
        d = self.root / self.name
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def write(self, version: str, metadata: dict[str, Any], labels: dict[str, str],
              fill: Callable[[Path], None]) -> Path:
        """Create `version` with `fill(directory)` and move it into the store whole;
        FileExistsError when the store has it already."""
        target = self.root / self.name / version
        if target.exists():
            raise FileExistsError(f"{self.name}:{version} is in the store already")
        with ExitStack() as held:  # removed in reverse: BentoML's directory, then staging
            staging = held.enter_context(make_dir(self.home / _STAGING, ""))
            with bentoml.models.create(Tag(self.name, version), metadata=metadata,
                                       labels=labels,
                                       _model_store=ModelStore(staging.path)) as m:
                held.enter_context(adopt_dir(Path(m.path)))
                fill(Path(m.path))
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging.path / self.name / version, target)  # atomic; fails if it exists
        self._point_latest()
        return target

    def remove(self, version: str) -> bool:
        """Delete a version's directory; False if there was none."""
        src = self.root / self.name / version
        trash = self.home / _TRASH / f"{self.name}-{version}-{secrets.token_hex(4)}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(src, trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        self._point_latest()
        return True

    def remove_leftovers(self) -> list[Path]:
        """Remove what writers that are gone left half-done (their staging directories
        and BentoML's temporary ones, see :mod:`jobs.orchestration.leftovers`) and removals that
        were
        interrupted (the trash)."""
        out = [*remove_abandoned(self.home / _STAGING, ""),
               *remove_abandoned(Path(tempfile.gettempdir()), f"bentoml-model-{self.name}-")]
        trash = self.home / _TRASH
        for d in sorted(trash.iterdir()) if trash.is_dir() else []:
            shutil.rmtree(d, ignore_errors=True)
            out.append(d)
        return out

    def _point_latest(self) -> None:
        versions = self.versions()
        latest = self.root / self.name / "latest"
        if not versions:
            latest.unlink(missing_ok=True)
            return
        tmp = latest.with_name(f".latest-{secrets.token_hex(4)}")
        tmp.write_text(versions[-1])
        tmp.replace(latest)
