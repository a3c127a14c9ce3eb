"""Branch and bound: below the root bound, above every leaking input found, anytime."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jobs.guard.lucid.branch_and_bound import bab_class, compute_bounds, split
from jobs.guard.lucid.falsifier import find_leaking
from jobs.guard.lucid.solvers import gurobi_available

FAST_SEARCH = dict(n_samples=4000, n_starts=12, steps=80)


@pytest.mark.slow
def test_bab_between_found_leaks_and_root(tiny) -> None:
    loo, X, _y, _ids = tiny
    events: list[dict] = []
    rep = compute_bounds(loo, 60.0, "highs", progress=events.append)
    assert events and {"bound", "open_sets", "elapsed_s"} <= set(events[0])
    for c in range(loo.n_classes):
        cb = rep.per_class[c]
        found = find_leaking(loo, c, extra_points=X, **FAST_SEARCH).best_margin
        assert cb.stop_reason == "singleton" and cb.exact
        floor = max(m["margin"] for m in cb.milps)  # a negative bound is raised to it
        assert found - 1e-9 <= cb.beta <= max(cb.root_bound, floor) + 1e-12
        # final singletons are solved with tau = 0 and a 1e-4 gap: tight to the found leak
        assert cb.beta - max(found, floor) <= 1e-4 + 1e-3 * abs(found) + 1e-3
        w = cb.witness  # the final MILP's incumbent, re-checked on the real networks
        assert w is not None and w["n_margin"] <= cb.beta and w["loo_margin"] <= 1e-5
        bounds = [e["bound"] for e in events if e["class"] == c]
        assert all(b1 >= b2 - 1e-12 for b1, b2 in zip(bounds, bounds[1:], strict=False))
    man = rep.manifest()
    text = json.dumps(man, allow_nan=False)  # strictly JSON
    assert man["n_milps"] == sum(cb.n_milps for cb in rep.per_class.values())
    assert man["loo_hash"] == loo.content_hash() and "highs" in text
    assert set(rep.serving_beta()) == set(range(loo.n_classes))


@pytest.mark.slow
@pytest.mark.skipif(not gurobi_available(), reason="gurobipy not installed")
def test_gurobi_backend_reaches_the_same_bound(tiny) -> None:
    loo, _X, _y, _ids = tiny
    h = compute_bounds(loo, 30.0, "highs", classes=[0])
    g = compute_bounds(loo, 30.0, "gurobi", classes=[0])
    assert g.manifest()["solvers_used"] == ["gurobi"]
    assert abs(h.beta[0] - g.beta[0]) <= 2e-4 * (1 + abs(h.beta[0]))
    rec = g.manifest()["per_class"]["0"]["milps"][0]
    assert {"solver", "status", "dual_bound", "primal", "gap", "time_s"} <= set(rec)


def test_anytime_bounds_are_sound(tiny) -> None:
    loo, X, _y, _ids = tiny
    c = 0
    found = find_leaking(loo, c, extra_points=X, **FAST_SEARCH).best_margin
    tiny_budget = bab_class(loo, c, time_budget_s=1e-3, solver="highs")
    assert tiny_budget.stop_reason == "time" and not tiny_budget.exact
    assert tiny_budget.beta >= found  # +inf at worst
    one = bab_class(loo, c, time_budget_s=30.0, max_milps=1)
    assert one.stop_reason == "max_milps" and one.beta == one.root_bound >= found
    few = bab_class(loo, c, time_budget_s=30.0, max_milps=4)
    assert found <= few.beta <= one.beta + 1e-12
    auto = bab_class(loo, c, time_budget_s=30.0, max_milps=4, solver="auto")
    assert auto.beta >= found
    rep = compute_bounds(loo, 1e-3)
    json.dumps(rep.manifest(), allow_nan=False)
    assert all(b >= found or c2 != c for c2, b in rep.beta.items())


def test_a_class_no_network_can_flip_is_served_with_the_margin(tiny, monkeypatch) -> None:
    """Infeasible everywhere (-inf) is not served as a bound of 0: the class's bound is
    raised to the margin the sets owed, so tolerances are covered there too."""
    from jobs.guard.lucid import branch_and_bound as bab
    from jobs.guard.lucid.milp import SetBound

    loo = tiny[0]
    monkeypatch.setattr(bab, "bound_set", lambda *a, **k: SetBound(
        -math.inf, -math.inf, None, {}, margin=3e-4))
    cb = bab_class(loo, 0, time_budget_s=5.0)
    assert cb.stop_reason == "no leaking input" and cb.beta == 3e-4


def test_split_is_a_deterministic_partition() -> None:
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 10, (3, 5))
    P = np.concatenate([c + rng.normal(0, 0.1, (7, 5)) for c in centers])
    g1 = split(P, random_state=0)
    g2 = split(P, random_state=0)
    assert [list(a) for a in g1] == [list(b) for b in g2]
    assert sorted(np.concatenate(g1).tolist()) == list(range(len(P)))
    assert len(g1) in (2, 4, 8) and all(len(g) for g in g1)
    assert len(split(P[:1])) == 1
    assert len(split(np.zeros((5, 3)))) == 1  # identical rows: nothing to split
    two = split(P[:2])
    assert sorted(len(g) for g in two) == [1, 1]
    assert math.isfinite(float(P.sum()))
