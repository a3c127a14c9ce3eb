"""Version directories in the model store, written and removed by several processes.

The store is ``OBLIVIATE_MODEL_STORE`` (``.obliviate/models``), each ledger's versions
under its identity, so ledgers never share a tag (``bentoml``: ``$BENTOML_HOME/models``).
BentoML's own store is not safe for several writers, so a version is written into a
staging directory and renamed into place whole, and removed by renaming it out first;
leftovers of a killed writer go at the next start (:mod:`jobs.orchestration.leftovers`).
See docs/operations.md (The model store) and docs/security.md.
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
# OBLIVIATE_MODEL_STORE's value for the place versions had before: $BENTOML_HOME/models,
# every ledger's versions side by side (deployments that have versions there keep it)
BENTOML_STORE = "bentoml"
LEDGER_LABEL = "ledger"  # the BentoML label naming the ledger a version belongs to


class VersionStore:
    """The versions of one model name of one ledger in a (shared) model store.

    `store`: the store's directory, or ``bentoml`` for ``$BENTOML_HOME/models`` (the
    default: every ledger's versions side by side); `scope`: the ledger's identity
    (None before its first event), under which a directory store keeps its versions.
    """

    def __init__(self, name: str, store: str = BENTOML_STORE,
                 scope: Callable[[], str | None] = lambda: None) -> None:
        self.name = name
        self.store = store
        self.scope = None if store == BENTOML_STORE else scope

    @property
    def home(self) -> Path:
        """Where the store keeps its work (staging, trash) and its versions."""
        if self.store == BENTOML_STORE:
            return Path(BentoMLContainer.bentoml_home.get())
        return Path(self.store).absolute()

    @property
    def root(self) -> Path | None:
        """The BentoML model store holding this ledger's versions (None: the ledger has
        no event yet, so no identity and no versions)."""
        if self.scope is None:
            return self.home / "models"
        scope = self.scope()
        return None if scope is None else self.home / scope

    def _dir(self, version: str = "") -> Path | None:
        root = self.root
        return None if root is None else root / self.name / version

    def path(self, version: str) -> Path:
        """A version's directory: this ledger's in the store, else the running Bento's
        own (only a version the Bento holds for this ledger)."""
        p = self._dir(version)
        if p is not None and (p / "model.yaml").is_file():
            return p
        try:
            model = bentoml.models.get(self.bento_tag(version))
        except NotFound:
            model = None
        if model is not None and (self.scope is None or
                                  model.info.labels.get(LEDGER_LABEL) == self.scope()):
            return Path(model.path)
        raise NotFound(f"{self.name}:{version} has no files in {p.parent if p else self.home}")

    def bento_tag(self, version: str) -> Tag:
        """The tag a Bento holds `version` under: with the ledger's identity (BentoML's
        own store is every ledger's), except in that store itself (``bentoml``)."""
        if self.scope is None:
            return Tag(self.name, version)
        return Tag(self.name, f"{version}-{self.scope()}")

    def versions(self) -> list[str]:
        d = self._dir()
        return sorted(p.name for p in d.iterdir() if p.is_dir()) \
            if d is not None and d.is_dir() else []

    def model_store(self) -> ModelStore:
        """This ledger's versions as a BentoML model store (what `obliviate build` reads)."""
        root = self.root
        if root is None:
            raise RuntimeError("the ledger has no event yet: no model version to find")
        return ModelStore(root)

    def write(self, version: str, metadata: dict[str, Any], labels: dict[str, str],
              fill: Callable[[Path], None]) -> Path:
        """Create `version` with `fill(directory)` and move it into the store whole;
        FileExistsError when the store has it already."""
        target = self._dir(version)
        if target is None:
            raise RuntimeError("the ledger has no event yet: no model version to store")
        if self.scope is not None:
            labels = {**labels, LEDGER_LABEL: str(self.scope())}
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
        src = self._dir(version)
        if src is None:
            return False
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
        and BentoML's temporary ones, see :mod:`jobs.orchestration.leftovers`) and removals
        that were interrupted (the trash)."""
        out = [*remove_abandoned(self.home / _STAGING, ""),
               *remove_abandoned(Path(tempfile.gettempdir()), f"bentoml-model-{self.name}-")]
        trash = self.home / _TRASH
        for d in sorted(trash.iterdir()) if trash.is_dir() else []:
            shutil.rmtree(d, ignore_errors=True)
            out.append(d)
        return out

    def _point_latest(self) -> None:
        versions, d = self.versions(), self._dir()
        if d is None:
            return
        latest = d / "latest"
        if not versions:
            latest.unlink(missing_ok=True)
            return
        tmp = latest.with_name(f".latest-{secrets.token_hex(4)}")
        tmp.write_text(versions[-1])
        tmp.replace(latest)
