"""Interval bound propagation (IBP) for an MLP, a hyper-network, and matching neurons.

Float64 on the float32 weights, every bound widened outwards so rounding never makes it
too tight: the bounds hold for the real-arithmetic networks the MILP reasons about.
See docs/guard.md (How the bound is computed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EPS = 1e-9  # outward widening, relative to the magnitude of the summed terms


def _widen(lo: np.ndarray, hi: np.ndarray, mag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pad = EPS * (1.0 + mag)
    return lo - pad, hi + pad


@dataclass
class Net64:
    """A network's weights ``[(out, in)]`` and biases as float64 arrays."""

    weights: list[np.ndarray]
    biases: list[np.ndarray]

    @classmethod
    def from_params(cls, params: object) -> Net64:
        """From anything with ``.weights`` / ``.biases`` (e.g.
        :class:`~jobs.learners.networks.loo_training.MLPParams`)."""
        return cls([np.asarray(W, dtype=np.float64) for W in params.weights],  # type: ignore[attr-defined]
                   [np.asarray(b, dtype=np.float64) for b in params.biases])  # type: ignore[attr-defined]

    def forward(self, X: np.ndarray) -> list[np.ndarray]:
        """Pre-activations of every layer at points ``X`` (n, d)."""
        out = []
        a = np.asarray(X, dtype=np.float64)
        for i, (W, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            z = a @ W.T + b
            out.append(z)
            if i < len(self.weights) - 1:
                a = np.maximum(z, 0.0)
        return out


@dataclass
class HyperNet:
    """Interval parameters over a set of networks (Def. 5.1), plus output-row differences.

    ``D_lo[c, c2, :]`` / ``d_lo[c, c2]`` = min over the set of ``W_L[c] - W_L[c2]``
    / ``b_L[c] - b_L[c2]`` (``D_hi``, ``d_hi`` the max).
    """

    W_lo: list[np.ndarray]
    W_hi: list[np.ndarray]
    b_lo: list[np.ndarray]
    b_hi: list[np.ndarray]
    D_lo: np.ndarray
    D_hi: np.ndarray
    d_lo: np.ndarray
    d_hi: np.ndarray
    size: int

    @classmethod
    def from_stack(
        cls,
        weights: Sequence[np.ndarray],
        biases: Sequence[np.ndarray],
        indices: Sequence[int] | np.ndarray | None = None,
    ) -> HyperNet:
        """From stacked parameters ``weights[l]`` (M, out, in), ``biases[l]`` (M, out)."""
        idx = np.arange(weights[0].shape[0]) if indices is None else np.asarray(indices)
        if len(idx) == 0:
            raise ValueError("a hyper-network needs at least one network")
        W_lo = [np.asarray(W[idx].min(0), dtype=np.float64) for W in weights]
        W_hi = [np.asarray(W[idx].max(0), dtype=np.float64) for W in weights]
        b_lo = [np.asarray(b[idx].min(0), dtype=np.float64) for b in biases]
        b_hi = [np.asarray(b[idx].max(0), dtype=np.float64) for b in biases]
        C, h = weights[-1].shape[1], weights[-1].shape[2]
        D_lo = np.full((C, C, h), np.inf)
        D_hi = np.full((C, C, h), -np.inf)
        d_lo = np.full((C, C), np.inf)
        d_hi = np.full((C, C), -np.inf)
        step = max(1, (8 << 20) // max(1, C * C * h * 8))  # ~8 MB per chunk
        for s in range(0, len(idx), step):
            sel = idx[s:s + step]
            WL = np.asarray(weights[-1][sel], dtype=np.float64)  # (k, C, h)
            bL = np.asarray(biases[-1][sel], dtype=np.float64)
            D = WL[:, :, None, :] - WL[:, None, :, :]  # (k, C, C, h), exact in float64
            d = bL[:, :, None] - bL[:, None, :]
            D_lo, D_hi = np.minimum(D_lo, D.min(0)), np.maximum(D_hi, D.max(0))
            d_lo, d_hi = np.minimum(d_lo, d.min(0)), np.maximum(d_hi, d.max(0))
        return cls(W_lo, W_hi, b_lo, b_hi, D_lo, D_hi, d_lo, d_hi, len(idx))

    @classmethod
    def from_nets(cls, nets: Sequence[Net64]) -> HyperNet:
        L = len(nets[0].weights)
        weights = [np.stack([n.weights[i] for n in nets]) for i in range(L)]
        biases = [np.stack([n.biases[i] for n in nets]) for i in range(L)]
        return cls.from_stack(weights, biases)

    @property
    def is_point(self) -> bool:
        """True when every interval is a single value (the set's networks coincide)."""
        return all(np.array_equal(a, b) for a, b in zip(self.W_lo + self.b_lo,
                                                        self.W_hi + self.b_hi, strict=True))

    def width(self) -> float:
        """Largest interval width over all parameters."""
        return max(float(np.max(h - lo)) for lo, h in zip(self.W_lo + self.b_lo,
                                                          self.W_hi + self.b_hi, strict=True))


# --------------------------------------------------------------------------- primitives


def affine_bounds(W: np.ndarray, b: np.ndarray, lo: np.ndarray, hi: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of ``W z + b`` for ``z`` in the box ``[lo, hi]``."""
    Wp, Wn = np.maximum(W, 0.0), np.minimum(W, 0.0)
    out_lo = Wp @ lo + Wn @ hi + b
    out_hi = Wp @ hi + Wn @ lo + b
    mag = np.abs(W) @ np.maximum(np.abs(lo), np.abs(hi)) + np.abs(b)
    return _widen(out_lo, out_hi, mag)


def interval_affine_bounds(W_lo: np.ndarray, W_hi: np.ndarray, b_lo: np.ndarray,
                           b_hi: np.ndarray, lo: np.ndarray, hi: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of ``W z + b`` over ``W in [W_lo, W_hi]``, ``b in [b_lo, b_hi]``, ``z in [lo, hi]``.

    Requires ``lo >= 0`` (inputs of every layer of a ReLU network on [0, 1]^d).
    """
    if np.any(lo < 0):
        raise ValueError("interval affine bounds need non-negative inputs")
    out_lo = np.minimum(W_lo * lo, W_lo * hi).sum(1) + b_lo
    out_hi = np.maximum(W_hi * lo, W_hi * hi).sum(1) + b_hi
    mag = np.maximum(np.abs(W_lo), np.abs(W_hi)) @ hi + np.maximum(np.abs(b_lo), np.abs(b_hi))
    return _widen(out_lo, out_hi, mag)


def _interval_mul(a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Element-wise product of intervals (broadcasting)."""
    p = np.stack(np.broadcast_arrays(a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi))
    return p.min(0), p.max(0)


# --------------------------------------------------------------------------- IBP


def ibp(net: Net64, lo: np.ndarray, hi: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pre-activation bounds ``[(l, u)]`` of every layer for inputs in ``[lo, hi]``."""
    out = []
    a_lo, a_hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    for i, (W, b) in enumerate(zip(net.weights, net.biases, strict=True)):
        z_lo, z_hi = affine_bounds(W, b, a_lo, a_hi)
        out.append((z_lo, z_hi))
        if i < len(net.weights) - 1:
            a_lo, a_hi = np.maximum(z_lo, 0.0), np.maximum(z_hi, 0.0)
    return out


def ibp_hyper(h: HyperNet, lo: np.ndarray, hi: np.ndarray
              ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pre-activation bounds valid for every network abstracted by ``h``; needs ``lo >= 0``."""
    out = []
    a_lo, a_hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    L = len(h.W_lo)
    for i in range(L):
        z_lo, z_hi = interval_affine_bounds(h.W_lo[i], h.W_hi[i], h.b_lo[i], h.b_hi[i],
                                            a_lo, a_hi)
        out.append((z_lo, z_hi))
        if i < L - 1:
            a_lo, a_hi = np.maximum(z_lo, 0.0), np.maximum(z_hi, 0.0)
    return out


# --------------------------------------------------------------------------- matching neurons


@dataclass
class LayerBounds:
    """Bounds of one layer's neurons for N, the hyper-network, and their difference.

    ``n_*``: N's pre-activation; ``h_*``: the hyper-network's pre-activation
    (for every network of the set); ``dpre_*``: hyper minus N, pre-activation;
    ``dpost_*``: hyper minus N after ReLU (hidden layers; for the output layer
    equal to ``dpre_*``).
    """

    n_lo: np.ndarray
    n_hi: np.ndarray
    h_lo: np.ndarray
    h_hi: np.ndarray
    dpre_lo: np.ndarray
    dpre_hi: np.ndarray
    dpost_lo: np.ndarray
    dpost_hi: np.ndarray

    def n_post(self) -> tuple[np.ndarray, np.ndarray]:
        return np.maximum(self.n_lo, 0.0), np.maximum(self.n_hi, 0.0)

    def h_post(self) -> tuple[np.ndarray, np.ndarray]:
        return np.maximum(self.h_lo, 0.0), np.maximum(self.h_hi, 0.0)


def matched_bounds(net: Net64, hyper: HyperNet, lo: np.ndarray, hi: np.ndarray,
                   n_pre: Sequence[tuple[np.ndarray, np.ndarray]] | None = None
                   ) -> list[LayerBounds]:
    """Per-layer bounds for N, the hyper-network and the matching-neuron differences.

    ``n_pre`` may supply (tighter) pre-activation bounds for N, e.g. from LP
    tightening; they are intersected with IBP's.

    Difference of a pre-activation (LUCID Sec. 5.4), with ``z#`` the previous
    layer's output of a network in the set and ``z`` N's::

        zhat# - zhat = (b# - b) + W (z# - z) + (W# - W) z#

    with ``b# - b in [b_lo - b, b_hi - b]``, ``z# - z`` in the previous post
    difference, ``W# - W in [W_lo - W, W_hi - W]`` and ``z# >= 0`` in the
    hyper-network's previous post bounds. After ReLU (1-Lipschitz, monotone):
    ``relu(a + d) - relu(a) in [min(0, d_lo), max(0, d_hi)]``, exact
    ``[d_lo, d_hi]`` when both neurons are stably active and ``[0, 0]`` when both
    are stably inactive; always also within ``[h_lo - n_hi, h_hi - n_lo]``.
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    L = len(net.weights)
    n_ibp = ibp(net, lo, hi)
    h_ibp = ibp_hyper(hyper, lo, hi)
    out: list[LayerBounds] = []
    # previous layer: outputs of the set in [hl, hu], difference to N's in [dl, du]
    hl, hu = lo, hi
    dl = np.zeros_like(lo)
    du = np.zeros_like(lo)
    for i in range(L):
        W, b = net.weights[i], net.biases[i]
        n_lo, n_hi = n_ibp[i]
        if n_pre is not None:
            n_lo, n_hi = np.maximum(n_lo, n_pre[i][0]), np.minimum(n_hi, n_pre[i][1])
        # difference of pre-activations
        Wp, Wn = np.maximum(W, 0.0), np.minimum(W, 0.0)
        t1_lo = Wp @ dl + Wn @ du
        t1_hi = Wp @ du + Wn @ dl
        A_lo, A_hi = hyper.W_lo[i] - W, hyper.W_hi[i] - W
        t2_lo, t2_hi = _interval_mul(A_lo, A_hi, hl[None, :], hu[None, :])
        d_lo = (hyper.b_lo[i] - b) + t1_lo + t2_lo.sum(1)
        d_hi = (hyper.b_hi[i] - b) + t1_hi + t2_hi.sum(1)
        mag = (np.abs(W) @ np.maximum(np.abs(dl), np.abs(du))
               + np.maximum(np.abs(A_lo), np.abs(A_hi)) @ hu
               + np.maximum(np.abs(hyper.b_lo[i] - b), np.abs(hyper.b_hi[i] - b)))
        d_lo, d_hi = _widen(d_lo, d_hi, mag)
        # hyper-network pre-activation: IBP, intersected with N's bounds + difference
        h_lo, h_hi = h_ibp[i]
        h_lo = np.maximum(h_lo, n_lo + d_lo - EPS * (1 + np.abs(n_lo + d_lo)))
        h_hi = np.minimum(h_hi, n_hi + d_hi + EPS * (1 + np.abs(n_hi + d_hi)))
        d_lo = np.maximum(d_lo, h_lo - n_hi - EPS * (1 + np.abs(h_lo - n_hi)))
        d_hi = np.minimum(d_hi, h_hi - n_lo + EPS * (1 + np.abs(h_hi - n_lo)))
        if i < L - 1:
            nzl, nzu = np.maximum(n_lo, 0.0), np.maximum(n_hi, 0.0)
            hzl, hzu = np.maximum(h_lo, 0.0), np.maximum(h_hi, 0.0)
            p_lo, p_hi = np.minimum(d_lo, 0.0), np.maximum(d_hi, 0.0)
            both_on = (n_lo >= 0) & (h_lo >= 0)
            both_off = (n_hi <= 0) & (h_hi <= 0)
            p_lo = np.where(both_on, d_lo, np.where(both_off, 0.0, p_lo))
            p_hi = np.where(both_on, d_hi, np.where(both_off, 0.0, p_hi))
            p_lo = np.maximum(p_lo, hzl - nzu - EPS * (1 + np.abs(hzl - nzu)))
            p_hi = np.minimum(p_hi, hzu - nzl + EPS * (1 + np.abs(hzu - nzl)))
            out.append(LayerBounds(n_lo, n_hi, h_lo, h_hi, d_lo, d_hi, p_lo, p_hi))
            hl, hu, dl, du = hzl, hzu, p_lo, p_hi
        else:
            out.append(LayerBounds(n_lo, n_hi, h_lo, h_hi, d_lo, d_hi, d_lo, d_hi))
    return out


def margin_rows(net: Net64, c: int) -> tuple[np.ndarray, np.ndarray]:
    """N's logit-margin rows for class ``c``: ``z_c - z_c2 = D[c2] . a + d[c2]`` (c2 != c)."""
    W, b = net.weights[-1], net.biases[-1]
    others = [k for k in range(W.shape[0]) if k != c]
    return W[c][None, :] - W[others], b[c] - b[others]


__all__ = [
    "EPS",
    "HyperNet",
    "LayerBounds",
    "Net64",
    "affine_bounds",
    "ibp",
    "ibp_hyper",
    "interval_affine_bounds",
    "margin_rows",
    "matched_bounds",
]
