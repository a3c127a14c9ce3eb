"""Per-shard bounds for the SERVED SISA ensemble (schedule "loo", one slice or sliced).

(a) each shard's rebuilt LOO set has the served shard network as its base, bit for bit;
(b) its N_{-x} is the shard model after ``ensemble.delete([x])``, bit for bit (both
    when the batch count B changes with the deletion and when it does not);
(c) ``sisa_certain`` with those bounds certifies only queries on which every single
    per-shard LOO swap leaves the vote unchanged (brute force, float32 serving path),
    and certifies strictly more than the bound-free rule (betas = +inf).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sklearn.datasets import make_moons

from jobs.guard.label_guard import sisa_certain
from jobs.guard.lucid.branch_and_bound import BoundReport
from jobs.guard.lucid.shard_bounds import (
    ShardMismatchError,
    ensemble_loo_set,
    naive_certain,
    shard_bounds,
)
from jobs.learners.networks.loo_training import LOOSet, MLPParams
from jobs.learners.networks.torch_nets import mlp_state, n_batches, states_equal
from jobs.learners.sisa.ensemble import SISAEnsemble

S = 3
KW = dict(
    n_shards=S,
    n_slices=1,
    model="mlp",
    hidden=(8,),
    epochs_per_slice=30,
    min_steps=0,
    batch_size=4,
    lr=0.1,
    weight_decay=1e-5,
    device="cpu",
    random_state=0,
)
BUDGET_S = 5.0  # per shard; the MILPs of these tiny shards close in about a second


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _data(n: int = 60) -> tuple[np.ndarray, np.ndarray, list[str]]:
    X, y = make_moons(n, noise=0.25, random_state=1)
    X = (X - X.min(0)) / (X.max(0) - X.min(0))
    return X, y, [f"r{i:03d}" for i in range(n)]


_CACHE: dict[str, object] = {}


def _fitted() -> tuple[SISAEnsemble, list[LOOSet], np.ndarray, dict]:
    """One ensemble, its per-shard LOO sets and bounds (computed once per session)."""
    if not _CACHE:
        X, y, ids = _data()
        ens = SISAEnsemble(**KW).fit(X, y, record_ids=ids)
        assert ens.config_["schedule"] == "loo"
        loos = [ensemble_loo_set(ens, s) for s in range(S)]
        reports: dict[int, BoundReport | None] = {}
        bounds = shard_bounds(ens, time_budget_s=BUDGET_S, reports=reports)
        _CACHE.update(ens=ens, loos=loos, bounds=bounds, reports=reports)
    c = _CACHE
    return c["ens"], c["loos"], c["bounds"], c["reports"]  # type: ignore[return-value]


def _state(p: MLPParams) -> dict[str, torch.Tensor]:
    return mlp_state(p.weights, p.biases)


def _served_logits(p: MLPParams, Q: np.ndarray) -> np.ndarray:
    """Float32 logits through the serving path (an MLP module), as shard_logits does."""
    with torch.inference_mode():
        return p.to_module()(torch.from_numpy(Q.astype(np.float32))).numpy()


# --------------------------------------------------------------------------- (a), (b)


@pytest.mark.slow
def test_loo_base_network_is_the_served_shard_network() -> None:
    ens, loos, _, _ = _fitted()
    for s in range(S):
        loo = loos[s]
        assert loo is not None and loo.n_records == ens.shard_sizes_[s]
        assert states_equal(_state(loo.full()), ens.shard_state(s)), s
        ids, _, _ = ens.shard_records(s)
        assert loo.record_ids.tolist() == ids


def test_loo_network_is_the_shard_after_deleting_the_record() -> None:
    ens, loos, _, _ = _fitted()
    sizes = ens.shard_sizes_.tolist()
    changes_b = [n_batches(n, 4) != n_batches(n - 1, 4) for n in sizes]
    assert any(changes_b) and not all(changes_b), sizes  # both code paths are exercised
    for s in range(S):
        ids = loos[s].record_ids.tolist()
        for rid in (ids[0], ids[len(ids) // 2], ids[-1]):
            e2 = copy.deepcopy(ens)
            rep = e2.delete([rid])
            assert rep.retrained["shards"] == [s]
            assert states_equal(_state(loos[s].loo(rid)), e2.shard_state(s)), (s, rid)
            for k in set(range(S)) - {s}:
                assert states_equal(e2.shard_state(k), ens.shard_state(k))
    # and the LOO networks are not all the base network
    assert not loos[0].loo(loos[0].record_ids[0]).equal(loos[0].full())


# --------------------------------------------------------------------------- (c)


def _brute_force_stable(ens: SISAEnsemble, loos: list[LOOSet], Q: np.ndarray) -> np.ndarray:
    """Queries whose vote winner survives every single deletion (swap or removal)."""
    L = ens.shard_logits(Q)
    active = ens.active_shards_
    labels = L.argmax(2)
    votes = np.zeros((len(Q), L.shape[2]), dtype=np.int64)
    for s in np.flatnonzero(active):
        np.add.at(votes, (np.arange(len(Q)), labels[s]), 1)
    winner = votes.argmax(1)
    stable = np.ones(len(Q), dtype=bool)
    for s in np.flatnonzero(active):
        base = votes.copy()
        base[np.arange(len(Q)), labels[s]] -= 1
        if loos[s].n_records == 1:  # the shard empties: its vote goes
            stable &= base.argmax(1) == winner
            continue
        for i in range(1, loos[s].n_networks):
            lab = _served_logits(loos[s].network(i), Q).argmax(1)
            v = base.copy()
            v[np.arange(len(Q)), lab] += 1
            stable &= v.argmax(1) == winner
    return stable


def test_per_shard_bounds_are_sound_and_certify_more_than_the_bound_free_rule() -> None:
    ens, loos, bounds, reports = _fitted()
    betas = bounds.for_ensemble(ens)
    assert betas.shape == (S, 2) and np.isfinite(betas).all() and (betas >= 0).all()
    assert all(isinstance(r, BoundReport) for r in reports.values()) and len(reports) == S
    for s, r in reports.items():
        assert r.loo_hash == loos[s].content_hash()
    Q = np.random.default_rng(7).random((3000, 2)).astype(np.float32)
    L = ens.shard_logits(Q)
    winner, certain = sisa_certain(L, betas, ens.active_shards_)
    w_inf, certain_inf = sisa_certain(L, np.full_like(betas, np.inf), ens.active_shards_)
    _, certain_naive = naive_certain(L, betas, ens.active_shards_)
    assert (winner == w_inf).all()
    np.testing.assert_array_equal(ens.classes_[winner], ens.predict(Q))
    stable = _brute_force_stable(ens, loos, Q)
    assert not (certain & ~stable).any(), int((certain & ~stable).sum())
    assert not (certain_inf & ~certain).any()  # the bounds only add certain answers
    assert certain.sum() > certain_inf.sum() + 100, (certain.sum(), certain_inf.sum())
    assert not (certain_naive & ~certain).any()


@pytest.mark.slow
def test_recompute_only_the_touched_shard_after_a_deletion() -> None:
    ens, _, bounds, _ = _fitted()
    betas = bounds.for_ensemble(ens)
    e2 = copy.deepcopy(ens)
    rid = e2.shard_records(1)[0][3]
    (s,), _ = e2.locate([rid])
    e2.delete([rid])
    reports: dict[int, BoundReport | None] = {}
    # the touched shard's network changed: its old bound is refused, the others' kept
    stale = bounds.for_ensemble(e2)
    assert np.isinf(stale[s]).all() and list(bounds.current(e2)).count(False) == 1
    new = shard_bounds(e2, [int(s)], previous=bounds, time_budget_s=BUDGET_S,
                       reports=reports)
    assert list(reports) == [int(s)] and new.current(e2).all()
    keep = [k for k in range(S) if k != s]
    new = new.for_ensemble(e2)
    np.testing.assert_array_equal(new[keep], betas[keep])
    assert np.isfinite(new[s]).all()
    loos = [ensemble_loo_set(e2, k) for k in range(S)]
    assert reports[int(s)].loo_hash == loos[s].content_hash()
    Q = np.random.default_rng(8).random((1500, 2)).astype(np.float32)
    _, certain = sisa_certain(e2.shard_logits(Q), new, e2.active_shards_)
    assert not (certain & ~_brute_force_stable(e2, loos, Q)).any()
    # without the previous bounds, the other rows are +inf (sound, bound-free)
    alone = shard_bounds(e2, [int(s)], time_budget_s=1.0)  # anytime: sound at any budget
    assert np.isinf(alone.for_ensemble(e2)[keep]).all()


# --------------------------------------------------------------------------- edges


@pytest.mark.slow
def test_tiny_shards_sliced_ensembles_and_tampering() -> None:
    X, y, ids = _data(12)
    ens = SISAEnsemble(**{**KW, "n_shards": 6}).fit(X, y, record_ids=ids)
    sizes = ens.shard_sizes_
    assert (sizes <= 1).any(), sizes  # some shard holds one record or none
    bounds = shard_bounds(ens, time_budget_s=2.0)
    assert np.isinf(bounds.for_ensemble(ens)[sizes <= 1]).all()
    for s in np.flatnonzero(sizes == 0):
        assert ensemble_loo_set(ens, int(s)) is None
    with pytest.raises(ValueError, match="out of range"):
        shard_bounds(ens, [6])
    sliced = SISAEnsemble(**{**KW, "n_slices": 2}).fit(X, y, record_ids=ids)
    assert sliced.config_["schedule"] == "adam"  # Adam stages: no LOO schedule, no bounds
    with pytest.raises(ValueError, match="schedule"):
        shard_bounds(sliced)
    s = int(np.argmax(sizes))
    assert np.isfinite(bounds.for_ensemble(ens)[s]).all()
    with torch.no_grad():
        next(ens.state_.nets[s].parameters()).view(-1)[0] += 1e-6
    with pytest.raises(ShardMismatchError):
        ensemble_loo_set(ens, s)
    # a bound never covers a network other than the one it was computed on
    assert np.isinf(bounds.for_ensemble(ens)[s]).all()


# --------------------------------------------------------------------------- sliced


@pytest.mark.slow
def test_sliced_shards_loo_sets_are_the_deletions_and_their_bounds_are_sound() -> None:
    """Sliced shards under the LOO schedule: after deletions from several slices (their
    tombstones stay in their slices' stages) and an addition, each shard's LOO set has
    the served network as its base and, for records of every slice, N_{-x} = the shard
    after delete([x]) bit for bit; the bounds computed on it certify only answers that
    every single deletion leaves unchanged, and more than the bound-free rule."""
    X, y, ids = _data(90)
    ens = SISAEnsemble(**{**KW, "n_shards": 2, "n_slices": 3, "schedule": "loo",
                          "epochs_per_slice": 12}).fit(X[:80], y[:80], record_ids=ids[:80])
    gone = [ids[0], ids[7], ids[33]]
    gone_slices = ens.slice_of_[np.searchsorted(ens.record_ids_, gone)]
    ens.delete(gone)
    ens.add(ids[80:84], X[80:84], y[80:84])
    kept = np.concatenate(list(ens.tombstone_slices_.values()))
    assert sorted(kept.tolist()) == sorted(gone_slices.tolist())
    assert ens.verify().exact
    loos = [ensemble_loo_set(ens, s) for s in range(2)]
    for s in range(2):
        slices = ens.shard_slices(s)
        rids = loos[s].record_ids.tolist()
        assert set(slices.tolist()) == {0, 1, 2}
        for r in range(3):  # a record of each slice
            rid = rids[int(np.flatnonzero(slices == r)[0])]
            e2 = copy.deepcopy(ens)
            rep = e2.delete([rid])
            assert rep.retrained["from_slice"] == {s: r}
            assert states_equal(_state(loos[s].loo(rid)), e2.shard_state(s)), (s, rid)
            for k in range(r):  # the checkpoints before the record's slice are kept
                assert e2.checkpoint_hash(s, k) == ens.checkpoint_hash(s, k)
    reports: dict[int, BoundReport | None] = {}
    bounds = shard_bounds(ens, time_budget_s=BUDGET_S, reports=reports)
    betas = bounds.for_ensemble(ens)
    assert np.isfinite(betas).all()
    for s, rep_s in reports.items():
        assert rep_s is not None and rep_s.loo_hash == loos[s].content_hash()
    rng = np.random.default_rng(9)
    Q = np.concatenate([rng.random((2500, 2)),  # and points near the shards' boundaries
                        X[:80] + rng.normal(0, 0.02, (80, 2))]).astype(np.float32)
    L = ens.shard_logits(Q)
    _, certain = sisa_certain(L, betas, ens.active_shards_)
    _, certain_inf = sisa_certain(L, np.full_like(betas, np.inf), ens.active_shards_)
    assert not (certain & ~_brute_force_stable(ens, loos, Q)).any()
    assert certain.sum() > certain_inf.sum()
