"""A network of the user's: a ``build(n_features, n_classes, **params)`` function named by
import path (``"pkg.module:build"``), resolved in one place, checked before any training
(it loads, returns a module, gives one logit per class, runs under deterministic kernels)
and pinned by the SHA-256 of its module's source file. A saved model keeps a copy of that
source and loads from it, so a version always runs the code it was trained with. A plain
Linear/ReLU one (:class:`ReluMLP`) moves to and from the LUCID encoder's form.
See docs/learners.md (Your own network)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from jobs import sealing
from jobs.learners.networks.loo_training import MLPParams
from jobs.learners.networks.torch_nets import deterministic
from ledger.error_text import first_line

SOURCE_FILE = "network.py"  # the copy of the module's source a saved model keeps
_NONDETERMINISTIC = re.compile(r"(\S+) does not have a deterministic implementation")


State = dict[str, torch.Tensor]


class NetworkError(ValueError):
    """A user network that cannot be used: unloadable, wrong output, changed, or using an
    operation without a deterministic implementation (one line, naming the network)."""


@dataclass(frozen=True, eq=False)
class UserNetwork:
    """The resolved ``build`` function of ``path`` with its keyword ``params``, and the
    source (and its SHA-256) of the module that defines it."""

    path: str
    params: dict[str, Any]
    source: bytes
    sha256: str
    build_fn: Callable[..., Any] = field(repr=False)

    @classmethod
    def resolve(cls, path: str, params: dict[str, Any] | None = None) -> UserNetwork:
        """Import ``path`` (``"module:function"``) as installed; NetworkError if it cannot."""
        module_name, attr = _split(path)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - whatever the user's import raises
            raise NetworkError(f"network {path!r}: cannot import {module_name!r} "
                               f"({first_line(exc)}); is its package "
                               "on PYTHONPATH?") from None
        source_file = inspect.getsourcefile(module)
        if source_file is None:
            raise NetworkError(f"network {path!r}: module {module_name!r} has no source file "
                               "to record")
        source = Path(source_file).read_bytes()
        return cls(path, _jsonable(path, params), source, _sha256(source),
                   _function(path, module, attr))

    @classmethod
    def from_source(cls, record: dict[str, Any], source: bytes) -> UserNetwork:
        """The network a model recorded (:meth:`record`), run from the saved copy of its
        source; NetworkError if the copy is not the source the model was trained with."""
        path, want = record["path"], record["sha256"]
        if (got := _sha256(source)) != want:
            raise NetworkError(f"network {path!r}: the saved source has SHA-256 {got[:12]}..., "
                               f"the model was trained with {want[:12]}...")
        module_name, attr = _split(path)
        private = f"_obliviate_network_{want[:16]}"
        module = sys.modules.get(private)
        if module is None:
            spec = importlib.util.spec_from_loader(private, loader=None)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            module.__package__ = module_name.rpartition(".")[0]  # its relative imports
            sys.modules[private] = module
            try:
                exec(compile(source, f"<{path} sha256:{want[:12]}>", "exec"), module.__dict__)
            except Exception as exc:  # noqa: BLE001 - whatever the user's module raises
                del sys.modules[private]
                raise NetworkError(f"network {path!r}: its saved source does not run "
                                   f"({first_line(exc)})") from None
        return cls(path, dict(record.get("params", {})), source, want,
                   _function(path, module, attr))

    @classmethod
    def recorded(cls, record: dict[str, Any]) -> UserNetwork:
        """The network a model recorded, imported as installed: refused (NetworkError) when
        its source is no longer the one the model was trained with."""
        now = cls.resolve(record["path"], record.get("params"))
        if now.sha256 != record["sha256"]:
            raise NetworkError(f"network {record['path']!r} changed since the model was "
                               f"trained: its source has SHA-256 {now.sha256[:12]}..., the "
                               f"model recorded {record['sha256'][:12]}...")
        return now

    def record(self) -> dict[str, Any]:
        """What a model records of its network (config, manifest): path, hash, params."""
        return {"path": self.path, "sha256": self.sha256, "params": self.params}

    def build(self, n_features: int, n_classes: int, seed: int | None = None) -> nn.Module:
        """A new module; ``seed`` fixes every random draw of its construction (its initial
        weights), whatever initialisation the user's code chose."""
        with seeded(seed):
            try:
                net = self.build_fn(n_features, n_classes, **self.params)
            except Exception as exc:  # noqa: BLE001 - whatever the user's build raises
                raise NetworkError(f"network {self.path!r}: build({n_features}, {n_classes}, "
                                   f"**{self.params}) raised "
                                   f"{first_line(exc)}") from None
        if not isinstance(net, nn.Module):
            raise NetworkError(f"network {self.path!r}: build returned "
                               f"{type(net).__name__}, not a torch.nn.Module")
        return net.float()

    def check(self, n_features: int, n_classes: int) -> None:
        """Refuse, before any shard trains, a network that does not give ``n_classes``
        logits per row or cannot train under deterministic kernels (one training step on
        two zero rows)."""
        net = self.build(n_features, n_classes, seed=0)
        net.train()
        with self.training(0):
            try:
                out = net(torch.zeros(2, n_features))
            except Exception as exc:  # noqa: BLE001 - whatever the user's forward raises
                if _NONDETERMINISTIC.search(str(exc)):
                    raise  # named by training()
                raise NetworkError(f"network {self.path!r}: a batch of shape (2, "
                                   f"{n_features}) fails: "
                                   f"{first_line(exc)}") from None
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, n_classes):
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise NetworkError(f"network {self.path!r} outputs {shape} for a batch of "
                                   f"shape (2, {n_features}); the table has {n_classes} "
                                   f"classes, so it must output (2, {n_classes})")
            F.cross_entropy(out, torch.zeros(2, dtype=torch.long)).backward()

    def relu_mlp(self, n_features: int, n_classes: int) -> ReluMLP | str:
        """The module as the masked LOO schedule and the LUCID encoder take it, or why
        they cannot (one phrase)."""
        return ReluMLP.of(self.build(n_features, n_classes, seed=0))

    @contextlib.contextmanager
    def training(self, seed: int) -> Iterator[None]:
        """Train under deterministic kernels with torch's random draws (dropout) seeded; an
        operation without a deterministic implementation becomes a NetworkError naming it."""
        try:
            with seeded(seed), deterministic():
                yield
        except RuntimeError as exc:
            if (m := _NONDETERMINISTIC.search(str(exc))) is None:
                raise
            raise NetworkError(f"network {self.path!r} uses {m.group(1)}, which has no "
                               "deterministic implementation: its learner trains only under "
                               "torch's deterministic algorithms (exact deletions need the "
                               "same bits every time)") from None


@dataclass(frozen=True)
class ReluMLP:
    """A user module that is a flat ``nn.Sequential`` of biased ``Linear`` layers with one
    ``ReLU`` between each two: what the masked LOO schedule trains and LUCID's encoder
    bounds. Keeps its hidden widths and its Linear layers' state-dict names, to move
    weights between the module's state and the encoder's form (:class:`MLPParams`)."""

    hidden: tuple[int, ...]
    layers: tuple[str, ...]

    @classmethod
    def of(cls, net: nn.Module) -> ReluMLP | str:
        """``net`` as a ReluMLP, or why it is not one."""
        if type(net) is not nn.Sequential:
            return (f"its module is a {type(net).__name__}, not a torch.nn.Sequential of "
                    "Linear and ReLU layers")
        # a hook may change the function in a way its weights (all the encoder sees) do not
        if any(m._forward_hooks or m._forward_pre_hooks for m in net.modules()):  # noqa: SLF001
            return "it has forward hooks"
        kids = list(net.named_children())
        for i, (name, m) in enumerate(kids):
            want = nn.Linear if i % 2 == 0 else nn.ReLU
            if type(m) is not want:
                return (f"its layer {name} is a {type(m).__name__} where the Linear/ReLU "
                        f"sequence needs a {want.__name__}")
            if want is nn.Linear and m.bias is None:
                return f"its Linear layer {name} has no bias"
        if len(kids) % 2 == 0:
            return "it does not end with a Linear layer"
        return cls(tuple(int(m.out_features) for _, m in kids[:-1:2]),
                   tuple(name for name, _ in kids[::2]))

    def params(self, state: State) -> MLPParams:
        """The encoder's form of a state of the module (copies, bit for bit)."""
        return MLPParams(
            [state[f"{n}.weight"].detach().cpu().numpy().copy() for n in self.layers],
            [state[f"{n}.bias"].detach().cpu().numpy().copy() for n in self.layers])

    def state(self, params: MLPParams) -> State:
        """The module's state holding ``params`` (copies, bit for bit)."""
        out: State = {}
        for n, W, b in zip(self.layers, params.weights, params.biases, strict=True):
            out[f"{n}.weight"] = torch.from_numpy(np.array(W, dtype=np.float32, copy=True))
            out[f"{n}.bias"] = torch.from_numpy(np.array(b, dtype=np.float32, copy=True))
        return out


@contextlib.contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """torch's CPU random state set from ``seed`` for the block, the caller's restored."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed) & ((1 << 63) - 1))
        yield


def save_source(path: Path, network: UserNetwork | None) -> None:
    """Write the copy of a user network's source into a bundle (sealed like every version
    file), before its meta.json, which is written last; nothing for a built-in network."""
    if network is not None:
        path.mkdir(parents=True, exist_ok=True)
        sealing.write_file(path / SOURCE_FILE, network.source)


def bundled(path: Path, config: dict[str, Any]) -> UserNetwork | None:
    """The user network a bundle recorded, from its saved source (else as installed,
    refused if its source changed); None for a built-in network."""
    record = config.get("network")
    if record is None:
        return None
    if (path / SOURCE_FILE).exists():
        return UserNetwork.from_source(record, sealing.read_file(path / SOURCE_FILE))
    return UserNetwork.recorded(record)


def network_hash(record: dict[str, Any] | None) -> str | None:
    """The source hash of a recorded network (None: the model uses a built-in one)."""
    return None if record is None else record["sha256"]


def _split(path: str) -> tuple[str, str]:
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise NetworkError(f"network {path!r}: expected an import path 'package.module:"
                           "function'")
    return module_name, attr


def _function(path: str, module: Any, attr: str) -> Callable[..., Any]:
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise NetworkError(f"network {path!r}: {module.__name__} has no function {attr!r}")
    return fn


def _jsonable(path: str, params: dict[str, Any] | None) -> dict[str, Any]:
    params = dict(params or {})
    try:
        json.dumps(params)
    except TypeError as exc:
        raise NetworkError(f"network {path!r}: its params must be JSON values ({exc})") from None
    return params


def _sha256(source: bytes) -> str:
    return hashlib.sha256(source).hexdigest()

