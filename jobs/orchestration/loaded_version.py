"""The version a worker builds on, loaded once and kept while it stays current.

Loading a version (unsealing, checking it against its manifest) costs seconds for a
large model: the worker keeps the loaded model and reloads only when the registry's
pointer moved. See docs/sidecar.md#worker.
"""

from __future__ import annotations

from jobs.orchestration.registry import ModelVersion, Registry, VersionUnavailable
from jobs.orchestration.served_model import ServedModel


class NoVersion(RuntimeError):
    """No model version is published yet: there is nothing to build on."""


class LoadedVersion:
    """The current version's row and its model, loaded as published."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.model: ServedModel | None = None
        self.version: ModelVersion | None = None

    def get(self) -> tuple[ServedModel, ModelVersion]:
        """The current version, loaded as published; NoVersion before the first one,
        VersionRefused when it may not be built on."""
        for _ in range(5):
            cur = self.registry.servable_current()
            if cur is None:
                raise NoVersion("no model version is published; run `obliviate model train`")
            if (self.version is not None and self.version.version == cur.version
                    and self.model is not None):
                return self.model, self.version
            try:
                self.model = self.registry.load(cur.version)
            except VersionUnavailable:  # another worker published a deletion meanwhile
                continue
            self.version = cur
            return self.model, self.version
        raise VersionUnavailable(f"the current version {cur.version} cannot be loaded: "
                                 f"{cur.unavailable or 'its files or key are gone'}")

    def forget(self) -> None:
        """The model in hand may be half updated, or stale: load it again next time."""
        self.model = None

    def published(self, model: ServedModel, version: str) -> None:
        """`model` is now the current version `version` (this worker published it)."""
        self.model, self.version = model, self.registry.get(version)
