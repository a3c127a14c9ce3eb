"""GuardedNetwork: strict ">" at the bound, noise-all without a matching bound, the
swap-in of N_{-x} after a deletion and the recompute that makes the guard sound again,
the memo and the counters. Data: the 40-point sets of conftest.py (hidden 8x8)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from jobs.guard.label_guard import cell_centres, clip_unit, grid_cells, top_margin
from jobs.guard.lucid.binding import BoundBinding
from jobs.guard.lucid.branch_and_bound import BoundReport, compute_bounds
from jobs.learners.networks.loo_training import LOOSet, schedule_keys, train_loo, train_single
from tests.bench.guarded_network import NOISE_ALL, SOUND, GuardedNetwork

from ..leaks import traces_found
from .conftest import TINY, tiny_loo

torch.set_num_threads(1)

_REPORTS: dict[int, BoundReport] = {}


def loo_and_report(n_classes: int) -> tuple[LOOSet, BoundReport, np.ndarray, np.ndarray, list]:
    loo, X, y, ids = tiny_loo(n_classes)
    if n_classes not in _REPORTS:
        _REPORTS[n_classes] = compute_bounds(loo, 60.0, "highs")
    return loo, _REPORTS[n_classes], X, y, ids


def served_margins(gn: GuardedNetwork, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """White-box: the guard's own float64 logits on the clipped query (same code path)."""
    return top_margin(gn._state.logits(clip_unit(X)))


def queries(n: int, d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, d)).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("n_classes", [2, 3])
def test_certain_iff_margin_strictly_above_beta(n_classes: int) -> None:
    loo, rep, _X, _y, _ids = loo_and_report(n_classes)
    gn = GuardedNetwork(loo, rep, epsilon=0.0, random_state=0)
    assert gn.mode == SOUND and gn.bound.beta == tuple(rep.serving_beta()[c]
                                                         for c in range(n_classes))
    Q = queries(3000, 2)
    labels, margins = served_margins(gn, Q)
    gn.predict(Q)
    expect = int((margins > np.asarray(gn.bound.beta)[labels]).sum())
    assert gn.counters()["certain"] == expect and 0 < expect < len(Q)
    # a bound exactly equal to a query's margin: that query is noised; one ulp lower: certain
    # (the margin of the query alone: BLAS may round a 1-row product differently)
    i = int(np.argmax(margins))
    one, m1 = served_margins(gn, Q[i:i + 1])
    c, m_i = int(one[0]), m1[0]
    for beta_c, certain in ((m_i, False), (np.nextafter(m_i, -np.inf), True)):
        beta = list(gn.bound.beta)
        beta[c] = float(beta_c)
        g2 = GuardedNetwork(loo, dataclasses.replace(gn.bound, beta=tuple(beta)), epsilon=0.0)
        assert g2.mode == SOUND
        g2.predict(Q[i:i + 1])
        assert g2.counters()["certain"] == int(certain)
        assert g2.counters()["noised"] == int(not certain)
    # certain answers are the network's labels
    g3 = GuardedNetwork(loo, rep, epsilon=0.0, random_state=1)
    out = np.array([g3.predict(q)[0] for q in Q[:300]])
    cert = margins[:300] > np.asarray(g3.bound.beta)[labels[:300]]
    assert (out[cert] == labels[:300][cert]).all()


def test_noise_all_until_a_bound_for_the_served_network() -> None:
    loo, rep, _X, _y, _ids = loo_and_report(2)
    _loo3, rep3, _, _, _ = loo_and_report(3)
    gn = GuardedNetwork(loo, epsilon=0.0, random_state=0)
    assert gn.mode == NOISE_ALL and gn.bound is None
    Q = queries(2000, 2, seed=1)
    labels, _ = served_margins(gn, Q)
    out = gn.predict(Q)
    cnt = gn.counters()
    assert cnt["certain"] == 0 and cnt["noised"] == 2000 and cnt["mode"] == NOISE_ALL
    assert 0.4 < (out == labels).mean() < 0.6  # eps = 0: a fair coin
    # a report for another LOO set, or a binding for another network: not adopted
    assert gn.set_bound(rep3) is False and gn.mode == NOISE_ALL
    wrong_net = BoundBinding(loo.loo(loo.record_ids[0]).content_hash(), loo.content_hash(),
                             (0.0, 0.0))
    assert gn.set_bound(wrong_net) is False and gn.mode == NOISE_ALL
    wrong_set = BoundBinding(loo.full().content_hash(), "0" * 64, (0.0, 0.0))
    assert gn.set_bound(wrong_set) is False and gn.mode == NOISE_ALL
    assert GuardedNetwork(loo, rep3).mode == NOISE_ALL
    with pytest.raises(ValueError, match="computed on"):
        BoundBinding.from_report(rep3, loo)
    # the matching bound: sound, and confident queries get their label
    assert gn.set_bound(rep) is True and gn.mode == SOUND
    gn.predict(Q)
    assert gn.counters()["certain"] > 0


@pytest.mark.slow
def test_swap_in_loo_then_recompute_restores_a_sound_guard(tmp_path) -> None:
    loo, rep, X, y, ids = loo_and_report(2)
    x = ids[17]
    gn = GuardedNetwork(loo, rep, epsilon=50.0, random_state=0)  # eps 50: noise ~ 1e-11
    Q = queries(1500, 2, seed=2)
    gn.predict(Q)
    assert gn.counters()["memo_entries"] > 0 and gn.counters()["certain"] > 0
    before = gn.counters()

    gn.swap_in_loo(x)
    assert gn.mode == NOISE_ALL and gn.bound is None and gn.pending_deletion == x
    assert gn.served_hash == loo.loo(x).content_hash() != loo.full().content_hash()
    assert gn.counters()["memo_entries"] == 0  # N's noised answers are never replayed
    out = gn.predict(Q)
    centres = cell_centres(grid_cells(clip_unit(Q)))  # a noised answer is its cell's
    want = loo.logits(centres, [loo.index_of(x)])[0].argmax(1)
    assert (out == want).all()  # N_{-x} is served (noise-all, but eps 50 keeps the label)
    after = gn.counters()
    assert after["certain"] == before["certain"] and after["noised"] == before["noised"] + len(Q)
    # N's bound is never used for N_{-x}; no second swap before the recompute
    assert gn.set_bound(rep) is False and gn.mode == NOISE_ALL
    with pytest.raises(RuntimeError, match="recompute"):
        gn.swap_in_loo(ids[3])

    keep = [i for i, r in enumerate(ids) if r != x]
    rest = [ids[i] for i in keep]
    with pytest.raises(ValueError, match="exactly the records"):
        gn.retrain(X, y, ids)  # the deleted record must be gone
    new_rep = gn.recompute_bounds(X[keep], y[keep], rest, time_budget_s=60.0)
    assert gn.mode == SOUND and gn.pending_deletion is None
    assert gn.served_hash == loo.loo(x).content_hash()  # still the old N_{-x}, bit for bit
    assert new_rep.loo_hash == gn.loo_hash != loo.content_hash()
    assert gn.bound.beta == tuple(new_rep.serving_beta()[c] for c in range(2))
    # a recompute on the same data reproduces the same LOO set (x's key as a tombstone,
    # frozen B); saved, it holds no trace of x (id or features), only live records' ids
    new = gn.retrain(X[keep], y[keep], rest)
    assert new.content_hash() == gn.loo_hash and x not in set(new.record_ids.tolist())
    assert new.meta["tombstones"] == schedule_keys(loo.config.seed, [x]).tolist()
    assert new.config.n_batches == loo.config.n_batches
    assert new.full().equal(loo.loo(x))
    new.save(tmp_path / "loo.npz")
    assert traces_found(tmp_path / "loo.npz", [x], X[ids.index(x)][None]) == set()
    kept = traces_found(tmp_path / "loo.npz", rest[:1], np.zeros((1, 1)))
    assert any(t.startswith("id ") for _, t in kept)  # the scan does see a live id
    # ... whose LOO networks are the two-deletion retrains
    z = rest[5]
    assert new.loo(z).equal(train_single(X, y, ids, exclude=[x, z], **TINY))
    # sound again: certain answers agree with every LOO network of the new data
    labels, margins = top_margin(new.logits(clip_unit(Q), [0])[0])
    cert = margins > np.asarray(gn.bound.beta)[labels]
    assert cert.any()
    every = new.logits(clip_unit(Q[cert])).argmax(2)
    assert (every == labels[cert][None, :]).all()
    # the next deletion can be swapped in now
    gn.swap_in_loo(z)
    assert gn.mode == NOISE_ALL and gn.served_hash == new.loo(z).content_hash()


def test_install_refuses_a_network_other_than_the_swapped_in_one() -> None:
    loo, rep, _X, _y, ids = loo_and_report(2)
    gn = GuardedNetwork(loo, rep)
    gn.swap_in_loo(ids[0])
    with pytest.raises(ValueError, match="differs"):
        gn.install(loo, rep)  # N is not N_{-x}
    assert gn.mode == NOISE_ALL and gn.served_hash == loo.loo(ids[0]).content_hash()
    # a general hot swap (no deletion pending) adopts the matching bound only
    g2 = GuardedNetwork(loo, rep)
    other = train_loo(_X, _y, ids, **{**TINY, "seed": 1})
    assert g2.install(other, rep) is False and g2.mode == NOISE_ALL
    assert g2.served_hash == other.full().content_hash()
    assert g2.install(loo, rep) is True and g2.mode == SOUND
    loo3, rep3, _, _, _ = loo_and_report(3)
    with pytest.raises(ValueError, match="classes"):
        g2.install(loo3, rep3)


def test_memo_replays_evicts_and_counts() -> None:
    loo, _rep, _X, _y, _ids = loo_and_report(3)
    gn = GuardedNetwork(loo, epsilon=0.0, memo_size=3, random_state=4)  # noise-all
    Q = queries(5, 2, seed=3)
    first = gn.predict(Q[:3])
    for _ in range(10):
        assert gn.predict(Q[:3]).tolist() == first.tolist()
    c = gn.counters()
    assert c["noised"] == 33 and c["memo_hits"] == 30 and c["memo_evictions"] == 0
    gn.predict(Q[3:5])
    c = gn.counters()
    assert c["memo_evictions"] == 2 and c["memo_entries"] == 3
    # clipping: a query outside the box is the clipped query (and shares its memo entry)
    out = gn.predict(np.array([[2.0, -1.0]]))
    assert gn.predict(np.array([[1.0, 0.0]])).tolist() == out.tolist()
    assert gn.counters()["memo_hits"] == 31
    # -0.0 is the same point as 0.0: the memo replays (no fresh noise via the sign of zero)
    gn.predict(np.array([[0.0, 0.5]]))
    gn.predict(np.array([[-0.0, 0.5]]))
    assert gn.counters()["memo_hits"] == 32
    with pytest.raises(ValueError):
        gn.predict(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        gn.predict(np.array([[np.nan, 0.5]]))
    with pytest.raises(ValueError):
        GuardedNetwork(loo, epsilon=-1.0)
    assert not any(name in dir(gn) for name in ("logits", "scores", "margins"))
