"""iDP guard benchmark: batched LOO training, bound computation, tightness.

    python tests/bench/bench_loo.py [--quick] [--solver highs|gurobi|auto] [--budget S]

Data: make_moons (200 points, noise 0.2; --quick: 100 points) min-max scaled to
[0, 1]^2; an MLP 2x50 (--quick: 2x10), SGD lr 0.1, weight decay 1e-5, 30
epochs, batch 32 (LUCID's settings), one CPU thread.

1. LOO training: all |D| + 1 networks batched
(:func:`jobs.learners.networks.loo_training.train_loo`)
   against two sequential estimates -- ``train_single`` (the same kernel, one
   network) and a plain PyTorch loop (``nn.Module`` + autograd +
   ``torch.optim.SGD`` on the same keyed batches) -- each timed on a few
   networks and multiplied by |D| + 1. A few LOO networks are re-trained
   alone and compared bit for bit.
2. Bounds: :func:`jobs.guard.lucid.branch_and_bound.compute_bounds` (branch and bound, LP-tightened
   MILPs), per class beta_c, time, MILPs, sets explored.
3. Falsifier: the largest confidence of a leaking input found by sampling
   plus gradient search (:func:`jobs.guard.lucid.falsifier.find_leaking`) and by
   re-checking the final MILP's incumbent on the real networks; tightness =
   beta_c / that (>= 1 up to the 1e-4 safety margin; 1 is tight).

The last lines are

    RESULT loo n=... networks=... batched_s=... single_seq_est_s=... torch_seq_est_s=... exact=true
    RESULT bound class=c beta=... found=... tightness=... time_s=... milps=... exact=...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import make_moons
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jobs.guard.lucid.branch_and_bound import compute_bounds  # noqa: E402
from jobs.guard.lucid.falsifier import find_leaking  # noqa: E402
from jobs.learners.keyed import prf_u64, prf_u64_many  # noqa: E402
from jobs.learners.networks.loo_training import train_loo, train_single  # noqa: E402
from jobs.learners.networks.torch_nets import MLP, epoch_batches, init_net  # noqa: E402


def plain_torch_single(X, y, ids, exclude, cfg) -> float:
    """One LOO network the way one would write it by hand; returns seconds."""
    t0 = time.perf_counter()
    net = init_net(MLP(cfg.n_features, cfg.n_classes, cfg.hidden), cfg.seed)
    opt = torch.optim.SGD(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    order = np.argsort(np.asarray(ids), kind="stable")
    Xs = torch.from_numpy(X[order].astype(np.float32))
    ys = torch.from_numpy(y[order].astype(np.int64))
    keys = prf_u64_many(cfg.seed, "loo-batch", np.asarray(ids)[order].tolist())
    ex = int(np.flatnonzero(np.asarray(ids)[order] == exclude)[0])
    for e in range(cfg.epochs):
        for rows in epoch_batches(keys, prf_u64(cfg.seed, "loo-epoch", e), cfg.n_batches):
            rows = rows[rows != ex]
            if len(rows) == 0:
                continue
            idx = torch.from_numpy(rows)
            opt.zero_grad()
            F.cross_entropy(net(Xs[idx]), ys[idx]).backward()
            opt.step()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--solver", default="highs", choices=["highs", "gurobi", "auto"])
    ap.add_argument("--budget", type=float, default=None, help="bound time budget, seconds")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--manifest", default=None, help="write the bound manifest (JSON) here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = args.n or (100 if args.quick else 200)
    h = args.hidden or (10 if args.quick else 50)
    budget = args.budget or (120.0 if args.quick else 1200.0)
    X, y = make_moons(n, noise=0.2, random_state=0)
    X = (X - X.min(0)) / (X.max(0) - X.min(0))
    ids = [f"r{i:04d}" for i in range(n)]
    kw = dict(hidden=(h, h), epochs=30, batch_size=32, lr=0.1, weight_decay=1e-5, seed=0)
    print(f"data: make_moons n={n} d=2, MLP 2x{h}, epochs 30, batch 32, B={-(-n // 32)}")

    # ---- 1. LOO training (after a warm-up: first calls load kernels)
    train_loo(X[:8], y[:8], ids[:8], **{**kw, "epochs": 1})
    plain_torch_single(X[:8], y[:8], ids[:8], ids[0], train_loo(X[:8], y[:8], ids[:8],
                                                                **{**kw, "epochs": 1}).config)
    t0 = time.perf_counter()
    loo = train_loo(X, y, ids, **kw)
    batched_s = time.perf_counter() - t0
    M = loo.n_networks
    acc = float((loo.logits(X, [0])[0].argmax(1) == y).mean())
    rng = np.random.default_rng(0)
    picks = rng.choice(ids, 5, replace=False).tolist()
    t0 = time.perf_counter()
    exact = all(train_single(X, y, ids, exclude=r, **kw).equal(loo.loo(r)) for r in picks)
    single_s = (time.perf_counter() - t0) / len(picks)
    torch_s = float(np.mean([plain_torch_single(X, y, ids, r, loo.config) for r in picks[:3]]))
    print(f"N train accuracy {acc:.3f}; max |logit(N_-x) - logit(N)| on D "
          f"{np.abs(loo.logits(X)[1:] - loo.logits(X, [0])).max():.4f}")
    print(f"LOO training: {M} networks batched {batched_s:.2f}s; sequential estimate "
          f"{single_s * M:.2f}s (train_single {single_s * 1e3:.1f} ms each), "
          f"{torch_s * M:.2f}s (plain torch {torch_s * 1e3:.1f} ms each); "
          f"bitwise equal to single runs on {len(picks)} records: {exact}")

    # ---- 2. bounds
    def show(e: dict) -> None:
        print(f"  class {e['class']}: bound {e['bound']:.5f} popped |S|={e['popped_size']} "
              f"open {e['open_sets']} MILPs {e['n_milps']} {e['elapsed_s']:.1f}s", flush=True)

    t0 = time.perf_counter()
    rep = compute_bounds(loo, budget, args.solver, progress=show)
    bound_s = time.perf_counter() - t0
    man = rep.manifest()
    if args.manifest:
        Path(args.manifest).write_text(json.dumps(man, indent=1))
    print(f"bounds: {bound_s:.1f}s, {man['n_milps']} MILPs, solvers {man['solvers_used']}")

    # ---- 3. falsifier
    results = []
    for c in range(loo.n_classes):
        cb = rep.per_class[c]
        t0 = time.perf_counter()
        w = cb.witness
        s = find_leaking(loo, c, extra_points=X, n_samples=50000, n_starts=128, steps=300)
        found = s.best_margin
        wm = w["n_margin"] if w else float("nan")
        if w is not None and w["leaking"]:
            found = max(found, w["n_margin"])
        tight = cb.beta / found if found > 0 else float("nan")
        print(f"class {c}: beta {cb.beta:.5f} (root {cb.root_bound:.5f}); best leaking margin "
              f"found {found:.5f} (sampling {s.sampled_best:.5f}, gradient "
              f"{s.gradient_best:.5f}, MILP witness "
              f"{wm:.5f} at LOO margin {w['loo_margin'] if w else float('nan'):.2e}); "
              f"search {time.perf_counter() - t0:.1f}s")
        results.append((c, cb, found, tight))
    print(f"RESULT loo n={n} networks={M} batched_s={batched_s:.2f} "
          f"single_seq_est_s={single_s * M:.2f} torch_seq_est_s={torch_s * M:.2f} "
          f"exact={'true' if exact else 'false'}")
    for c, cb, found, tight in results:
        print(f"RESULT bound class={c} beta={cb.beta:.5f} found={found:.5f} "
              f"tightness={tight:.4f} time_s={cb.elapsed_s:.1f} milps={cb.n_milps} "
              f"explored={cb.sets_explored} exact={'true' if cb.exact else 'false'}")
    ok = exact and all(cb.beta >= found for _c, cb, found, _t in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
