"""IBP bounds contain sampled activations (networks, hyper-networks, differences)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.guard.lucid.interval_bounds import (
    HyperNet,
    Net64,
    ibp,
    ibp_hyper,
    interval_affine_bounds,
    matched_bounds,
)
from jobs.guard.lucid.milp import tighten_lp

TOL = 1e-12


def random_net(rng: np.random.Generator, widths: list[int], scale: float = 1.0) -> Net64:
    Ws = [rng.normal(0, scale, (o, i)).astype(np.float32).astype(np.float64)
          for i, o in zip(widths[:-1], widths[1:], strict=True)]
    bs = [rng.normal(0, scale, o).astype(np.float32).astype(np.float64) for o in widths[1:]]
    return Net64(Ws, bs)


def perturbed(rng: np.random.Generator, net: Net64, eps: float) -> Net64:
    return Net64([W + rng.normal(0, eps, W.shape) for W in net.weights],
                 [b + rng.normal(0, eps, b.shape) for b in net.biases])


nets = st.builds(
    lambda seed, d, hidden, C: (seed, [d, *hidden, C]),
    st.integers(0, 2**31 - 1),
    st.integers(1, 3),
    st.lists(st.integers(1, 6), min_size=0, max_size=3),
    st.integers(2, 3),
)


def sub_box(rng: np.random.Generator, d: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = rng.random(d), rng.random(d)
    return np.minimum(a, b), np.maximum(a, b)


def inside(v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> bool:
    return bool(np.all(v >= lo - TOL) and np.all(v <= hi + TOL))


@settings(max_examples=60, deadline=None)
@given(nets)
def test_ibp_contains_sampled_activations(spec) -> None:
    seed, widths = spec
    rng = np.random.default_rng(seed)
    net = random_net(rng, widths)
    lo, hi = sub_box(rng, widths[0])
    bounds = ibp(net, lo, hi)
    X = lo + (hi - lo) * rng.random((200, widths[0]))
    X[:2] = [lo, hi]  # corners too
    for z, (lo_, hi_) in zip(net.forward(X), bounds, strict=True):
        assert inside(z, lo_, hi_)


@settings(max_examples=60, deadline=None)
@given(nets, st.integers(1, 5), st.sampled_from([0.0, 1e-3, 0.1, 1.0]))
def test_hyper_and_matching_bounds_contain_every_member(spec, k, eps) -> None:
    seed, widths = spec
    rng = np.random.default_rng(seed)
    N = random_net(rng, widths)
    members = [perturbed(rng, N, eps) for _ in range(k)]
    H = HyperNet.from_nets(members)
    lo, hi = sub_box(rng, widths[0])
    X = lo + (hi - lo) * rng.random((100, widths[0]))
    hb = ibp_hyper(H, lo, hi)
    mb = matched_bounds(N, H, lo, hi)
    zN = N.forward(X)
    for m in members:
        zm = m.forward(X)
        for i, (z, (lo_, hi_)) in enumerate(zip(zm, hb, strict=True)):
            assert inside(z, lo_, hi_)
            B = mb[i]
            assert inside(z, B.h_lo, B.h_hi)
            assert inside(zN[i], B.n_lo, B.n_hi)
            assert inside(z - zN[i], B.dpre_lo, B.dpre_hi)
            post = np.maximum(z, 0) - np.maximum(zN[i], 0)
            if i < len(zm) - 1:
                assert inside(post, B.dpost_lo, B.dpost_hi)
        # output-row differences of the hyper-network
        WL, bL = m.weights[-1], m.biases[-1]
        D = WL[:, None, :] - WL[None, :, :]
        dd = bL[:, None] - bL[None, :]
        assert inside(D, H.D_lo, H.D_hi) and inside(dd, H.d_lo, H.d_hi)
    if eps == 0.0:
        assert H.is_point


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3), st.lists(st.integers(2, 8), min_size=2,
                                                               max_size=3))
def test_lp_tightening_is_sound_and_never_looser(seed, d, hidden) -> None:
    rng = np.random.default_rng(seed)
    net = random_net(rng, [d, *hidden, 2])
    pre = tighten_lp(net)
    base = ibp(net, np.zeros(d), np.ones(d))
    X = rng.random((300, d))
    for z, (lo_, hi_), (bl, bu) in zip(net.forward(X), pre, base, strict=True):
        assert inside(z, lo_, hi_)
        assert np.all(lo_ >= bl) and np.all(hi_ <= bu)


def test_interval_affine_needs_nonnegative_inputs() -> None:
    W = np.ones((1, 2))
    with pytest.raises(ValueError):
        interval_affine_bounds(W, W, np.zeros(1), np.zeros(1), np.array([-1.0, 0]), np.ones(2))
