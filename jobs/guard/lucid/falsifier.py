"""A falsifier for the bound: leaking inputs with large confidence, by sampling and gradient
search, each checked exactly in float64. Each one's confidence is a lower bound on the
true beta*_c, which any sound bound must reach (tests; the benchmark's tightness).
See docs/guard.md (How the bound is computed)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from jobs.learners.networks.loo_training import LOOSet


def margins(logits: np.ndarray, c: int) -> np.ndarray:
    """``C^c = z_c - max_{c' != c} z_c'`` along the last axis."""
    others = np.delete(logits, c, axis=-1)
    return logits[..., c] - others.max(-1)


@dataclass
class LeakSearch:
    c: int
    best_margin: float  # -inf when no leaking input was found
    best_x: np.ndarray | None
    best_network: int | None  # index of a LOO network that disagrees at best_x
    n_leaking_samples: int
    n_samples: int
    sampled_best: float
    gradient_best: float


def _torch_stack(loo: LOOSet, idx: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.from_numpy(W[idx].astype(np.float64)),
             torch.from_numpy(b[idx].astype(np.float64)))
            for W, b in zip(loo.weights, loo.biases, strict=True)]


def _forward(params: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """Per-start networks: x (S, d) -> logits (S, C)."""
    a = x[:, None, :]
    for i, (W, b) in enumerate(params):
        a = torch.matmul(a, W.transpose(1, 2)) + b[:, None, :]
        if i < len(params) - 1:
            a = torch.relu(a)
    return a[:, 0, :]


def _tmargin(z: torch.Tensor, c: int) -> torch.Tensor:
    others = torch.cat([z[:, :c], z[:, c + 1:]], dim=1)
    return z[:, c] - others.max(1).values


def polish(loo: LOOSet, c: int, x: np.ndarray, j: int, *, tries: int = 40
           ) -> tuple[np.ndarray, float] | None:
    """Move a near-leaking ``x`` (LOO network ``j``'s margin slightly > 0, e.g. a MILP
    incumbent at solver tolerance) just across the boundary along ``-grad`` of that
    margin; returns ``(x', C_N^c(x'))`` once network ``j`` truly disagrees, else None."""
    x = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
    pJ = _torch_stack(loo, np.array([j]))
    xt = torch.tensor(x[None, :], requires_grad=True)
    with torch.enable_grad():
        m = _tmargin(_forward(pJ, xt), c)
        m.sum().backward()
    g = xt.grad.numpy()[0].copy()
    g[(x <= 0.0) & (g > 0)] = 0.0  # moving along -g must stay in the box
    g[(x >= 1.0) & (g < 0)] = 0.0
    gg = float(g @ g)
    m0 = float(margins(loo.logits(x[None, :], [j])[0], c)[0])
    if m0 <= 0:
        return x, float(margins(loo.logits(x[None, :], [0])[0], c)[0])
    if gg == 0.0:
        return None
    step = m0 / gg
    for k in range(tries):
        x2 = np.clip(x - step * (2.0 ** k) * g, 0.0, 1.0)
        z = loo.logits(x2[None, :], [0, j])
        if margins(z[1], c)[0] <= 0:
            return x2, float(margins(z[0], c)[0])
    return None


def find_leaking(
    loo: LOOSet,
    c: int,
    *,
    n_samples: int = 20000,
    n_starts: int = 64,
    steps: int = 300,
    lr: float = 0.01,
    seed: int = 0,
    extra_points: np.ndarray | None = None,
) -> LeakSearch:
    """Best leaking input of class ``c`` found by sampling plus gradient search."""
    rng = np.random.default_rng(seed)
    d = loo.config.n_features
    X = rng.random((n_samples, d))
    if extra_points is not None:
        X = np.concatenate([X, np.clip(np.asarray(extra_points, dtype=np.float64), 0, 1)])
    lg = loo.logits(X)  # (M, n, C)
    mN = margins(lg[0], c)
    mL = margins(lg[1:], c)  # (M-1, n)
    worst = mL.argmin(0)
    mmin = mL[worst, np.arange(len(X))]
    leak = mmin <= 0
    best, best_x, best_net = -np.inf, None, None
    if leak.any():
        i = int(np.flatnonzero(leak)[np.argmax(mN[leak])])
        best, best_x, best_net = float(mN[i]), X[i].copy(), int(worst[i]) + 1
    sampled_best = best

    # gradient search from the most promising samples
    score = mN - 5.0 * np.maximum(mmin, 0.0)
    starts = np.argsort(-score)[:n_starts]
    grad_best = -np.inf
    if len(starts):
        nets = worst[starts] + 1
        with torch.enable_grad():
            pN = _torch_stack(loo, np.zeros(len(starts), dtype=np.int64))
            pJ = _torch_stack(loo, nets)
            x = torch.tensor(X[starts], dtype=torch.float64, requires_grad=True)
            opt = torch.optim.Adam([x], lr=lr)
            for t in range(steps):
                lam = 1.0 + 99.0 * t / max(1, steps - 1)
                mn = _tmargin(_forward(pN, x), c)
                mj = _tmargin(_forward(pJ, x), c)
                with torch.no_grad():
                    ok = (mj <= 0).numpy()
                    if ok.any():
                        vals = mn.detach().numpy()
                        k = int(np.flatnonzero(ok)[np.argmax(vals[ok])])
                        if vals[k] > grad_best:
                            grad_best = float(vals[k])
                            cand_x, cand_net = x[k].detach().numpy().copy(), int(nets[k])
                loss = -(mn - lam * torch.relu(mj + 1e-3)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                with torch.no_grad():
                    x.clamp_(0.0, 1.0)
        if grad_best > best:
            # re-check exactly with the numpy evaluation
            z = loo.logits(cand_x[None, :], [0, cand_net])
            if margins(z[1], c)[0] <= 0:
                best, best_x, best_net = float(margins(z[0], c)[0]), cand_x, cand_net
    return LeakSearch(c, best, best_x, best_net, int(leak.sum()), len(X), sampled_best, grad_best)


__all__ = ["LeakSearch", "find_leaking", "margins", "polish"]
