"""The configuration a SISA ensemble is trained under (``config_``): the constructor's
parameters with the schedule resolved and its defaults filled in. It is saved with the
ensemble, and the bits depend on every entry.
See docs/learners.md (SISA's training function)."""

from __future__ import annotations

from typing import Any

# Defaults per schedule (``None`` in the constructor). Plain SGD on inputs in [0, 1]^d needs
# a rate about 20-50x Adam's: with 0.01 small shards stayed at the majority class on
# census-like tables. The "loo" defaults are a network for tables: two hidden layers of 64,
# 40 epochs and at least 8,000 steps per stage, so that a shard of a fifth of the records
# learns what one shard does (bench_sisa.py's table rows; docs/learners.md, "SISA").
SCHEDULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "loo": {"hidden": (64, 64), "epochs_per_slice": 40, "min_steps": 8000, "lr": 0.2},
    "adam": {"hidden": (64,), "epochs_per_slice": 20, "min_steps": 0, "lr": 1e-2},
}


def resolve_config(params: dict[str, Any]) -> dict[str, Any]:
    """``config_`` of an ensemble with these (validated) constructor parameters; refuses
    the combinations no single constraint catches (``schedule="loo"`` needs the built-in
    MLP; ``optimizer`` other than Adam needs a network of the user's). A user network's
    record (path, source hash) is added by ``fit``, once it is resolved."""
    schedule = params["schedule"]
    own = params.get("network") is not None
    if schedule == "auto":
        schedule = ("loo" if params["model"] == "mlp" and params["n_slices"] == 1 and not own
                    else "adam")
    if schedule == "loo" and (params["model"] != "mlp" or own):
        raise ValueError("schedule='loo' needs model='mlp'" + (
            " (a network of your own trains with schedule='adam')" if own else ""))
    optimizer = params.get("optimizer", "adam")
    if optimizer != "adam" and not own:
        raise ValueError(f"optimizer={optimizer!r} needs a network of your own (network=...): "
                         "the built-in networks train with Adam or the LOO schedule's SGD")
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
        config.update(model="network", optimizer=optimizer)
    return config
