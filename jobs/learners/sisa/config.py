"""The configuration a SISA ensemble is trained under (``config_``): the constructor's
parameters with the schedule resolved and its defaults filled in. It is saved with the
ensemble, and the bits depend on every entry.
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

from typing import Any

from jobs.learners.networks.torch_nets import CROSS_ENTROPY
from jobs.learners.networks.user_network import ReluMLP

# Defaults per schedule (``None`` in the constructor). Plain SGD on inputs in [0, 1]^d needs
# a rate about 20-50x Adam's: with 0.01 small shards stayed at the majority class on
# census-like tables. The "loo" defaults are a network for tables: two hidden layers of 64,
# 40 epochs and at least 8,000 steps per stage, so that a shard of a fifth of the records
# learns what one shard does (bench_sisa.py's table rows; docs/learners.md, "SISA").
SCHEDULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "loo": {"hidden": (64, 64), "epochs_per_slice": 40, "min_steps": 8000, "lr": 0.2},
    "adam": {"hidden": (64,), "epochs_per_slice": 20, "min_steps": 0, "lr": 1e-2},
}


def resolve_config(params: dict[str, Any],
                   relu_mlp: ReluMLP | str | None = None) -> dict[str, Any]:
    """``config_`` of an ensemble with these (validated) constructor parameters; refuses
    the combinations no single constraint catches (:func:`_schedule`). ``relu_mlp``: a
    user network as the masked LOO schedule takes it, or why it cannot. Holds only what
    the shards train under: a user network's config leaves out ``hidden`` (its module
    decides) and, under ``"adam"``, ``weight_decay``. A user network's record (path,
    source hash) is added by ``fit``."""
    schedule = _schedule(params, relu_mlp)
    own = params.get("network") is not None
    dflt = SCHEDULE_DEFAULTS[schedule]

    def given(name: str) -> Any:
        return dflt[name] if params[name] is None else params[name]

    threads = params["cpu_threads"]
    config = {
        "n_shards": int(params["n_shards"]),
        "n_slices": int(params["n_slices"]),
        "model": params["model"],
        "hidden": [int(h) for h in given("hidden")],
        "epochs_per_slice": int(given("epochs_per_slice")),
        "min_steps": int(given("min_steps")),
        "batch_size": int(params["batch_size"]),
        "lr": float(given("lr")),
        "weight_decay": float(params["weight_decay"]),
        "schedule": schedule,
        "aggregation": params["aggregation"],
        "add_slice": params["add_slice"],
        "sampling": params["sampling"],
        "shard_prob": float(params["shard_prob"]),
        "cpu_threads": None if threads is None else int(threads),
        # how an MLP trains on the CPU (jobs.learners.networks.torch_nets.KERNELS): part of
        # what the bits depend on, so recorded (bundles from before the compiled one: "torch")
        "kernel": "compiled",
    }
    if own:  # only then: a built-in network's config (and hash) stays what it was
        del config["hidden"]
        if schedule == "loo":  # the masked schedule: plain SGD on the module's widths
            assert isinstance(relu_mlp, ReluMLP)
            config.update(hidden=list(relu_mlp.hidden), optimizer="sgd")
        else:
            del config["weight_decay"]
            config["optimizer"] = params.get("optimizer") or "adam"
        config.update(model="network", loss=params.get("loss", CROSS_ENTROPY))
    return config


def _schedule(params: dict[str, Any], relu_mlp: ReluMLP | str | None) -> str:
    """The schedule the shards train with: ``"auto"`` is ``"loo"`` for a one-slice MLP
    (built-in, or a user's the schedule can train), else ``"adam"``. Refuses
    ``schedule="loo"`` for a network it cannot train, and an optimiser or loss other than
    the default for a built-in network."""
    schedule, own = params["schedule"], params.get("network") is not None
    if not own:
        optimizer, loss = params.get("optimizer"), params.get("loss", CROSS_ENTROPY)
        if optimizer not in (None, "adam"):
            raise ValueError(f"optimizer={optimizer!r} needs a network of your own "
                             "(network=...): the built-in networks train with Adam or the "
                             "LOO schedule's SGD")
        if loss != CROSS_ENTROPY:
            raise ValueError(f"loss={loss!r} needs a network of your own (network=...): "
                             "the built-in networks train with cross-entropy")
        if schedule == "auto":
            return "loo" if params["model"] == "mlp" and params["n_slices"] == 1 else "adam"
        if schedule == "loo" and params["model"] != "mlp":
            raise ValueError("schedule='loo' needs model='mlp'")
        return schedule
    why = loo_obstacle(params, relu_mlp)
    if schedule == "auto":
        return "loo" if why is None and params["n_slices"] == 1 else "adam"
    if schedule == "loo" and why is not None:
        raise ValueError(f"schedule='loo' cannot train network {params['network']!r}: {why} "
                         "(it trains with schedule='adam', served by the vote rule)")
    return schedule


def loo_obstacle(params: dict[str, Any], relu_mlp: ReluMLP | str | None) -> str | None:
    """Why the masked LOO schedule (plain SGD on cross-entropy over a ReLU MLP) cannot
    train a user network under these parameters; None when it can."""
    if not isinstance(relu_mlp, ReluMLP):
        return relu_mlp or "its module was not inspected"
    if params.get("optimizer") == "adam":
        return "optimizer='adam' (the schedule is plain SGD)"
    if (loss := params.get("loss", CROSS_ENTROPY)) != CROSS_ENTROPY:
        return f"loss={loss!r} (the schedule's kernels take cross-entropy only)"
    return None


def unused_params(config: dict[str, Any]) -> set[str]:
    """Constructor parameters the ensemble trained under ``config`` ignores (a manifest
    leaves them out): a user network's ``model`` and ``hidden`` (its module decides), and
    under ``"adam"`` ``weight_decay``, under ``"loo"`` ``optimizer`` and ``loss`` (plain
    SGD on cross-entropy). None for a built-in network."""
    if "network" not in config:
        return set()
    if config["schedule"] == "loo":
        return {"model", "hidden", "optimizer", "loss"}
    return {"model", "hidden", "weight_decay"}
