"""`obliviate build`: the Bento of the service, holding this ledger's current version.

`bentofile.yaml` names the code and the requirements; the model it bundles is the
version the registry serves now, read from the model store under the ledger's
identity (`bentoml build` alone reads only ``$BENTOML_HOME``'s store, where another
ledger's ``obliviate:latest`` may be). See docs/operations.md, "The image".
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ledger.store import Ledger

if TYPE_CHECKING:
    from bentoml import Tag
    from bentoml._internal.models.model import ModelStore


def build_bento(ledger: Ledger, model_name: str, bentofile: Path) -> tuple[str, str | None]:
    """Build the Bento of `bentofile` with the current version of `model_name`; returns
    (the Bento's tag, the model's). Before the first version, the code alone (the
    service then loads versions from the model store)."""
    import bentoml
    from bentoml._internal.bento.build_config import BentoEnvSchema
    from bentoml._internal.configuration.containers import BentoMLContainer

    from jobs.orchestration.registry import Registry

    if not bentofile.is_file():
        raise ValueError(f"{bentofile}: no such file (run `obliviate build` where "
                         "bentofile.yaml is, or pass --bentofile)")
    registry = Registry(ledger.engine, model_name, ledger.keys)
    current = registry.servable_current()
    config = yaml.safe_load(bentofile.read_text())
    config["models"] = []
    if current is not None:
        tag = registry.store.bento_tag(current.version)
        _copy_into_bentoml(registry.path(current.version), tag,
                           BentoMLContainer.model_store.get())
        config["models"] = [str(tag)]
    config["envs"] = [BentoEnvSchema(**e) for e in config.get("envs") or []]
    bento = bentoml.bentos.build(**config, build_ctx=str(bentofile.resolve().parent))
    return str(bento.tag), config["models"][0] if config["models"] else None


def _copy_into_bentoml(src: Path, tag: Tag, models: ModelStore) -> None:
    """Put a version's files in BentoML's own store under `tag` (where `bentoml export`
    and `containerize` look for a Bento's models), unless it holds them already."""
    import bentoml
    from bentoml.exceptions import NotFound

    try:
        models.get(tag)
        return
    except NotFound:
        pass
    info = yaml.safe_load((src / "model.yaml").read_text())
    with bentoml.models.create(tag, labels=info.get("labels"), metadata=info.get("metadata"),
                               _model_store=models) as m:
        shutil.copytree(src, m.path, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("model.yaml"))
