"""The LOO set and SISA's shards on CUDA: exactness on the device, time against the CPU.

    python tests/bench/bench_device.py [--quick] [--sizes 569,2000,8000,16000]

Without CUDA it prints ``RESULT device=cpu cuda=absent`` and stops: the CPU paths are
what ``make test`` checks. With CUDA, per size n (breast cancer for 569, else a
generated table of the census character, :func:`ledger.census.census_like`, min-max
scaled),
the sidecar's mlp network (one hidden layer of 32, 20 epochs, batch 32, lr 0.1):

1. ``train_loo`` on CUDA against the CPU's compiled loop, timed on ``--cpu-networks``
   networks of the same set and scaled to n + 1 (each CPU network is its own loop, so
   the cost is linear in them);
2. exactness on the device: ``train_single(exclude=x)`` on CUDA (one network, padded to
   ``CUDA_SLOTS`` slots) against slot x of the LOO set, bit for bit, for a few records at
   different positions, and the time of that single retrain;
3. the sidecar's learners with ``device="cuda"``: ``LeaveOneOutMLP`` (fit, LOO set,
   delete by swap, delete two, verify) and ``SISAEnsemble`` (5 shards, fit, delete,
   verify) -- ``verify`` retrains from scratch on the device that trained the model.

Last lines:

    RESULT n=... loo_cuda_s=... loo_cpu_est_s=... speedup=... single_cuda_s=... slots_exact=true
    RESULT learner=mlp device=cuda fit_s=... loo_s=... swap_ms=... exact=true
    RESULT learner=sisa device=cuda fit_s=... delete_s=... cpu_delete_s=... exact=true
    RESULT learner=sisa network=digits_cnn device=cuda fit_s=... cpu_fit_s=... exact=true
    RESULT learner=sisa network=relu_mlp device=cuda schedule=loo ... exact=true
    RESULT setting=cuda_memory_fraction value=0.25 capped=true

The last row is a user's own module (issue 30: the shipped example CNN,
``jobs/learners/networks/examples/digits.py``, on scikit-learn's digits, 5 shards): trained,
one record deleted and verified exact by a retrain from scratch on the same device, against
the same on the CPU. Then a user's ReLU MLP on the masked LOO schedule (its LOO sets equal
its deletions bit for bit) with the shipped table example, and the CUDA memory cap.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.preprocessing import MinMaxScaler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jobs.learners.mlp.leave_one_out import LeaveOneOutMLP  # noqa: E402
from jobs.learners.networks.loo_training import train_loo, train_single  # noqa: E402
from jobs.learners.sisa.ensemble import SISAEnsemble  # noqa: E402
from jobs.orchestration.served_model import DEFAULT_PARAMS  # noqa: E402
from ledger.census import census_like  # noqa: E402

SIDECAR_SISA = DEFAULT_PARAMS["sisa"]  # the served ensemble's network

NET = {"hidden": (32,), "epochs": 20, "batch_size": 32, "lr": 0.1, "weight_decay": 1e-5}


def table(n: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    if n == 569:
        X, y = load_breast_cancer(return_X_y=True)
    else:
        X, y = census_like(n, seed=0)
    X = MinMaxScaler().fit_transform(X).astype(np.float32)
    return X, np.asarray(y, dtype=np.int64), [f"r{i}" for i in range(len(y))]


def loo_row(n: int, cpu_networks: int) -> str:
    X, y, ids = table(n)
    args = {**NET, "seed": 11, "n_classes": int(y.max()) + 1}
    t0 = time.perf_counter()
    big = train_loo(X, y, ids, device="cuda", **args)
    torch.cuda.synchronize()
    cuda_s = time.perf_counter() - t0
    B = big.config.n_batches
    picks = np.random.default_rng(0).choice(len(ids), 4, replace=False)
    t0 = time.perf_counter()
    slots_exact = all(
        train_single(X, y, ids, exclude=ids[i], n_batches=B, device="cuda", **args)
        .equal(big.loo(ids[i])) for i in picks)
    single_s = (time.perf_counter() - t0) / len(picks)
    # the CPU's compiled loop: one network after the other, so time a few and scale
    train_single(X[:64], y[:64], ids[:64], device="cpu", **args)  # compile / warm
    t0 = time.perf_counter()
    for i in range(cpu_networks):
        train_single(X, y, ids, exclude=ids[i], n_batches=B, device="cpu", **args)
    cpu_est = (time.perf_counter() - t0) / cpu_networks * (len(ids) + 1)
    cpu_full = train_single(X, y, ids, device="cpu", **args)
    same_bits = cpu_full.equal(big.full())
    gap = float(np.abs(cpu_full.logits(X) - big.full().logits(X)).max())
    return (f"RESULT n={len(ids)} networks={big.n_networks} loo_cuda_s={cuda_s:.2f} "
            f"loo_cpu_est_s={cpu_est:.1f} speedup={cpu_est / cuda_s:.1f} "
            f"single_cuda_s={single_s:.2f} slots_exact={str(slots_exact).lower()} "
            f"cpu_cuda_same_bits={str(same_bits).lower()} cpu_cuda_max_logit_gap={gap:.2e}")


def mlp_row() -> str:
    X, y, ids = table(569)
    t0 = time.perf_counter()
    m = LeaveOneOutMLP(**NET, device="cuda", random_state=5).fit(X, y, record_ids=ids)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m.fit_loo()
    loo_s = time.perf_counter() - t0
    rep = m.delete([ids[3]])
    swap_ms = rep.seconds * 1e3
    exact1 = m.verify().exact and rep.retrained["swap"]
    m.delete([ids[4], ids[5]])
    exact2 = m.verify().exact
    return (f"RESULT learner=mlp device=cuda fit_s={fit_s:.2f} loo_s={loo_s:.2f} "
            f"swap_ms={swap_ms:.2f} exact={str(exact1 and exact2).lower()}")


def sisa_row() -> str:
    X, y, ids = table(2000)
    out = {}
    for dev in ("cuda", "cpu"):
        t0 = time.perf_counter()
        ens = SISAEnsemble(**{**SIDECAR_SISA, "device": dev, "random_state": 3}).fit(
            X, y, record_ids=ids)
        fit_s = time.perf_counter() - t0
        rep = ens.delete([ids[7]])
        out[dev] = (fit_s, rep.seconds, ens.verify().exact)
    (fit_s, del_s, exact), (_, cpu_del, _) = out["cuda"], out["cpu"]
    return (f"RESULT learner=sisa device=cuda n=2000 fit_s={fit_s:.2f} delete_s={del_s:.3f} "
            f"cpu_delete_s={cpu_del:.3f} exact={str(exact).lower()}")


def user_network_row() -> str:
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    ids = [f"d{i:04d}" for i in range(len(X))]
    params = {"n_shards": 5, "network": "jobs.learners.networks.examples.digits:build",
              "network_params": {"channels": 8, "hidden": 64}, "epochs_per_slice": 20,
              "lr": 0.01, "random_state": 3}
    out = {}
    for dev in ("cuda", "cpu"):
        t0 = time.perf_counter()
        ens = SISAEnsemble(**{**params, "device": dev}).fit(X, y, record_ids=ids)
        fit_s = time.perf_counter() - t0
        rep = ens.delete([ids[7]])
        out[dev] = (fit_s, rep.seconds, ens.verify().exact, ens.score(X, y))
    (fit_s, del_s, exact, acc), (cpu_fit, cpu_del, cpu_exact, _) = out["cuda"], out["cpu"]
    return (f"RESULT learner=sisa network=digits_cnn device=cuda n={len(X)} fit_s={fit_s:.2f} "
            f"cpu_fit_s={cpu_fit:.2f} delete_s={del_s:.3f} cpu_delete_s={cpu_del:.3f} "
            f"train_accuracy={acc:.3f} exact={str(exact and cpu_exact).lower()}")


def user_relu_row(device: str = "cuda") -> str:
    """A user's plain ReLU MLP (the masked LOO schedule) and the shipped table example on
    CUDA: each shard's rebuilt LOO set holds the served shard (checked) and, for a record,
    the shard after deleting it, bit for bit; both verify exact after deletions."""
    import copy

    from sklearn.datasets import make_moons

    from jobs.guard.lucid.shard_bounds import ensemble_loo_set

    X, y = make_moons(400, noise=0.25, random_state=1)
    X = MinMaxScaler().fit_transform(X).astype(np.float32)
    ids = [f"r{i:04d}" for i in range(len(X))]
    t0 = time.perf_counter()
    ens = SISAEnsemble(n_shards=5, network="tests.user_networks:relu_mlp", epochs_per_slice=20,
                       min_steps=0, device=device, random_state=0).fit(X, y, record_ids=ids)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    same = []
    for s in range(5):
        loo = ensemble_loo_set(ens, s)
        after = copy.deepcopy(ens)
        after.delete([loo.record_ids[0]])
        same.append(loo.loo(loo.record_ids[0]).equal(after.shard_params(s)))
    loo_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    Xt = np.zeros((600, 9), np.float32)  # one number, a 5- and a 3-category one-hot block
    Xt[:, 0] = rng.random(600)
    Xt[np.arange(600), 1 + rng.integers(0, 5, 600)] = 1
    Xt[np.arange(600), 6 + rng.integers(0, 3, 600)] = 1
    yt = ((Xt[:, 2] + (Xt[:, 0] > 0.5)) % 2).astype(int)
    tids = [f"t{i:04d}" for i in range(600)]
    tab = SISAEnsemble(n_shards=3, network="jobs.learners.networks.examples.tables:build",
                       network_params={"blocks": [[1, 5], [6, 3]]}, epochs_per_slice=10,
                       lr=0.05, device=device, random_state=2).fit(Xt, yt, record_ids=tids)
    tab.delete(tids[:4])
    ens.delete(ids[:3])
    exact = all(same) and ens.verify().exact and tab.verify().exact
    return (f"RESULT learner=sisa network=relu_mlp device={device} n={len(X)} "
            f"schedule={ens.config_['schedule']} fit_s={fit_s:.2f} loo_sets_s={loo_s:.2f} "
            f"tables_example=true exact={str(exact).lower()}")


def memory_cap_row() -> str:
    """OBLIVIATE_CUDA_MEMORY_FRACTION=0.25 refuses an allocation of 40% of the card."""
    from jobs.orchestration.job_settings import JobSettings

    JobSettings(device="cuda", cuda_memory_fraction=0.25).training_device()
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        big = torch.empty(int(total * 0.4) // 4, dtype=torch.float32, device="cuda")
        del big
        capped = False
    except torch.OutOfMemoryError:
        capped = True
    torch.cuda.set_per_process_memory_fraction(1.0)
    return f"RESULT setting=cuda_memory_fraction value=0.25 capped={str(capped).lower()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma-separated n (default 569,2000,8000,16000)")
    ap.add_argument("--cpu-networks", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the CPU paths are the tested default (make test)")
        print("RESULT device=cpu cuda=absent")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    sizes = ([569] if args.quick else [569, 2000, 8000, 16000]) if args.sizes is None else [
        int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        rows.append(loo_row(n, args.cpu_networks))
        print(rows[-1], flush=True)
    for row in (mlp_row, sisa_row, user_network_row, user_relu_row, memory_cap_row):
        rows.append(row())
        print(rows[-1], flush=True)
    ok = all("=false" not in r for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
