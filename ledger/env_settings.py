"""Settings read from the environment: one dataclass per layer, one way to read them.

Each layer (the ledger's :class:`ledger.config.LedgerSettings`, the jobs' and the
service's) declares its settings as fields of a frozen dataclass with embedded
defaults; the variable OBLIVIATE_<FIELD> overrides a field wherever it is read, so a
variable means the same in every process.
See docs/operations.md (Deploying)."""

from __future__ import annotations

import os
from dataclasses import fields, replace
from typing import Self

# how an OBLIVIATE_<FIELD> value is read, by the field's annotation (default: the string)
_PARSERS = {"int": int, "float": float,
            "float | None": lambda v: None if v.strip() in ("", "auto") else float(v)}


class EnvSettings:
    """Base of a layer's settings dataclass: reading it, and checking a choice."""

    @classmethod
    def from_env(cls, **overrides: object) -> Self:
        """OBLIVIATE_<FIELD> variables override the defaults; keyword overrides win."""
        values: dict[str, object] = {}
        for f in fields(cls):
            env = os.environ.get(f"OBLIVIATE_{f.name.upper()}")
            if env is not None:
                try:
                    values[f.name] = _PARSERS.get(str(f.type), str)(env)
                except ValueError:
                    raise ValueError(f"OBLIVIATE_{f.name.upper()}={env!r} is not "
                                     f"a valid {f.type}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    @classmethod
    def variables(cls) -> set[str]:
        """The environment variables this layer reads."""
        return {f"OBLIVIATE_{f.name.upper()}" for f in fields(cls)}

    def choice(self, name: str, options: tuple[str, ...]) -> str:
        """The setting `name`, which must be one of `options` (ValueError naming its variable)."""
        value = getattr(self, name)
        if value not in options:
            raise ValueError(f"OBLIVIATE_{name.upper()} must be one of {', '.join(options)}; "
                             f"got {value!r}")
        return value
