"""Compile the numba kernels once, when the project is installed, so that no deletion waits.

A kernel compiles on its first call (about a minute for DaRE's deletion kernel on two
cores) and numba caches the machine code beside its source, in ``__pycache__``; later
processes load it in milliseconds. ``make install`` runs this module; an image built
from the sources should run it too (``python -m jobs.orchestration.warm_kernels``).
See docs/development.md (Install)."""

from __future__ import annotations

import time

import numpy as np
import torch

from jobs.learners.networks.torch_nets import build_net, init_net, train_stage
from jobs.orchestration.served_model import ServedModel


def warm() -> float:
    """Run every compiled path once (DaRE fit, deletion, addition; the forest guard's fit
    and update; the MLP training of SISA shards) on a small table with ties; returns the
    seconds it took."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    X = np.round(rng.random((400, 5)), 1)  # tied values, like a real table's
    y = (X[:, 0] + 0.3 * rng.random(400) > 0.6).astype(np.int64)
    ids = np.array([f"w{i}" for i in range(len(X))])
    model = ServedModel.train("dare", ids[:-2], X[:-2], y[:-2],
                              {"n_estimators": 3, "max_depth": 4, "random_state": 1})
    model.learner.delete(ids[:2])
    model.update_guard(deleted=list(ids[:2]))
    model.learner.add(ids[-2:], X[-2:], y[-2:])
    model.update_guard(added=list(ids[-2:]))
    model.certain(X[:10])
    warm_wide_indices(rng)
    ServedModel.train("sisa", ids[:60], X[:60], y[:60],  # the compiled LOO schedule
                      {"n_shards": 1, "hidden": [4], "epochs_per_slice": 1})
    net = init_net(build_net("mlp", X.shape[1], 2, [4]), 0)  # and compiled Adam
    train_stage(net, torch.from_numpy(X[:60].astype(np.float32)), torch.from_numpy(y[:60]),
                np.arange(60, dtype=np.uint64), seed=0, stage_key=(0,), epochs=1,
                batch_size=16, lr=0.01)
    return time.perf_counter() - t0


def warm_wide_indices(rng: np.random.Generator) -> None:
    """The same DaRE paths on a table past 65,535 records, where the kernels take int32
    record indices instead of uint16 (another compiled variant): without it a sidecar's
    first fit and first deletion above that size paid about a minute of compiling."""
    n = 66_000
    X = np.round(rng.random((n, 3)), 1)
    y = (X[:, 0] > 0.5).astype(np.int64)
    ids = np.array([f"v{i}" for i in range(n)])
    model = ServedModel.train("dare", ids[:-2], X[:-2], y[:-2],
                              {"n_estimators": 1, "max_depth": 3, "random_state": 1})
    model.learner.delete(ids[:2])
    model.learner.add(ids[-2:], X[-2:], y[-2:])


def main() -> None:
    print("compiling the DaRE, forest-guard and MLP kernels (cached after the first time) ...",
          flush=True)
    print(f"kernels ready in {warm():.1f} s")


if __name__ == "__main__":
    main()
