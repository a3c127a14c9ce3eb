"""The MILP bound is sound: >= every leaking input that sampling or gradient search finds."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from jobs.guard.lucid import solvers
from jobs.guard.lucid.falsifier import find_leaking, margins
from jobs.guard.lucid.interval_bounds import HyperNet, Net64
from jobs.guard.lucid.milp import bound_set, encode, serving_margin, tighten_lp
from jobs.guard.lucid.solvers import MILP, gurobi_available, solve

FAST_SEARCH = dict(n_samples=4000, n_starts=12, steps=80)
SLACK = 1e-9  # the bound includes a 1e-4 safety margin; found margins must not exceed it


def everyone(loo) -> HyperNet:
    return HyperNet.from_stack(loo.weights, loo.biases, np.arange(1, loo.n_networks))


def single(loo, i: int) -> HyperNet:
    return HyperNet.from_stack(loo.weights, loo.biases, [i])


@pytest.mark.slow
def test_root_and_singleton_bounds_cover_found_leaks(tiny) -> None:
    loo, X, _y, _ids = tiny
    N = Net64.from_params(loo.full())
    n_pre = tighten_lp(N)
    for c in range(loo.n_classes):
        found = find_leaking(loo, c, extra_points=X, **FAST_SEARCH)
        assert found.best_margin > -math.inf
        for pre in (None, n_pre):
            root = bound_set(N, everyone(loo), c, n_pre=pre)
            assert root.bound >= found.best_margin - SLACK
            assert root.result is not None and root.result.status == "Optimal"
        # the network that disagrees at the best found input: its singleton covers it
        j = found.best_network
        s = bound_set(N, single(loo, j), c, tau=0.0, mip_gap=1e-6, n_pre=n_pre)
        assert s.bound >= found.best_margin - SLACK
        assert s.bound <= root.bound + 1e-6


@pytest.mark.slow
def test_singleton_without_relaxation_is_exact(tiny) -> None:
    """tau = 0, tiny gap: the incumbent is a genuine leaking input at the bound."""
    loo, X, _y, _ids = tiny
    N = Net64.from_params(loo.full())
    c = 0
    j = find_leaking(loo, c, extra_points=X, **FAST_SEARCH).best_network
    s = bound_set(N, single(loo, j), c, tau=0.0, mip_gap=1e-7)
    assert s.x is not None
    z = loo.logits(s.x[None, :], [0, j])
    mN, mJ = margins(z[0], c)[0], margins(z[1], c)[0]
    assert mJ <= 1e-5  # the LOO network disagrees (within solver tolerance)
    assert abs((s.bound - s.margin) - mN) <= 1e-5  # and N's confidence is the bound


@pytest.mark.skipif(not gurobi_available(), reason="gurobipy not installed")
def test_highs_and_gurobi_agree(tiny) -> None:
    loo, _X, _y, _ids = tiny
    N = Net64.from_params(loo.full())
    for c in range(loo.n_classes):
        for hyper in (everyone(loo), single(loo, 5)):
            enc = encode(N, hyper, c, tau=0.01)
            assert enc.milp is not None and enc.milp.fits_gurobi_pip()
            h = solve(enc.milp, solver="highs", mip_gap=1e-7)
            g = solve(enc.milp, solver="gurobi", mip_gap=1e-7)
            assert g.solver == "gurobi", g.note
            assert h.status == g.status == "Optimal"
            assert abs(h.dual_bound - g.dual_bound) <= 1e-5 * (1 + abs(h.dual_bound))


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["highs", "gurobi", "auto"])
def test_tiny_time_limit_still_sound(tiny, solver: str) -> None:
    loo, X, _y, _ids = tiny
    N = Net64.from_params(loo.full())
    for c in range(loo.n_classes):
        found = find_leaking(loo, c, extra_points=X, **FAST_SEARCH)
        sb = bound_set(N, everyone(loo), c, solver=solver, time_limit=1e-3, tau=0.0)
        assert sb.bound >= found.best_margin - SLACK  # +inf is allowed (and sound)


def constant_net(bias: list[float], d: int = 2, h: int = 3) -> Net64:
    C = len(bias)
    return Net64([np.zeros((h, d)), np.zeros((C, h))], [np.zeros(h), np.asarray(bias, float)])


def test_no_possible_flip_gives_minus_inf_and_always_flip_gives_max_margin() -> None:
    N = constant_net([1.0, 0.0])
    H = HyperNet.from_nets([constant_net([1.0, 0.0]), constant_net([0.9, 0.0])])
    assert bound_set(N, H, 0).bound == -math.inf  # nobody ever disagrees about class 0
    b1 = bound_set(N, H, 1)  # class 1: every member disagrees everywhere; N's margin is -1
    assert b1.margin >= 1e-4 and abs(b1.bound - (-1.0 + b1.margin)) <= 1e-6


def test_the_margin_grows_with_the_numbers_in_play() -> None:
    """Solver tolerances and float32 serving act relative to the magnitudes of the logits
    and the MILP's constants: the margin on top of a dual bound grows with them."""
    small = bound_set(constant_net([1.0, 0.0]),
                      HyperNet.from_nets([constant_net([0.9, 0.0])]), 1)
    big = bound_set(constant_net([1000.0, 0.0]),
                    HyperNet.from_nets([constant_net([900.0, 0.0])]), 1)
    assert small.margin >= 1e-4 and big.margin >= 1e-4 + 1e-5 * 1000 - 1e-12
    assert big.bound >= big.dual_bound + big.margin - 1e-9
    assert serving_margin(None, -math.inf, 1e-4) >= 1e-4  # infeasible: still owed


def test_gurobi_size_limit_and_licence_refusal_fall_back(monkeypatch) -> None:
    n = 2001  # over the pip licence
    big = MILP(np.ones(n), np.zeros(n), np.ones(n), np.zeros(n, bool),
               sp.csr_matrix(np.ones((1, n))), np.array([-np.inf]), np.array([3.0]))
    r = solve(big, solver="gurobi")
    assert r.solver == "highs" and abs(r.dual_bound - 3.0) <= 1e-6 and r.note
    small = MILP(np.ones(2), np.zeros(2), np.ones(2), np.array([True, False]),
                 sp.csr_matrix(np.ones((1, 2))), np.array([-np.inf]), np.array([1.5]))

    def refuse(*_a, **_k):
        raise solvers.LicenceRefused("size-limited licence")

    monkeypatch.setattr(solvers, "_solve_gurobi", refuse)
    r = solve(small, solver="auto")
    assert r.solver == "highs" and "licence" in r.note and abs(r.dual_bound - 1.5) <= 1e-6


def test_infeasible_milp_reports_minus_inf() -> None:
    m = MILP(np.ones(1), np.zeros(1), np.ones(1), np.array([True]),
             sp.csr_matrix(np.ones((1, 1))), np.array([0.2]), np.array([0.8]))
    for name in ("highs", "gurobi"):
        r = solve(m, solver=name)
        assert r.dual_bound == -math.inf and r.status == "Infeasible"


def test_missing_solvers_say_what_to_install(monkeypatch) -> None:
    """gurobipy is an extra (`gurobi`) and highspy a dependency an environment may still
    lack: without them the bound says what to install, or which solver it used instead."""
    small = MILP(np.ones(2), np.zeros(2), np.ones(2), np.array([True, False]),
                 sp.csr_matrix(np.ones((1, 2))), np.array([-np.inf]), np.array([1.5]))
    monkeypatch.setitem(sys.modules, "gurobipy", None)  # import gurobipy fails
    r = solve(small, solver="gurobi")
    assert r.solver == "highs" and "pip install 'obliviate[gurobi]'" in r.note
    monkeypatch.setitem(sys.modules, "highspy", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install highspy"):
        solve(small, solver="highs")
