"""Adversarial soundness of the guard, end to end (HiGHS bounds, real LOO networks).

Data sets (all min-max scaled to [0, 1]^d, MLP 2x8, 30 epochs, batch 8, seed 0):

* ``moons``  -- make_moons, 60 points, noise 0.25 (2-D, 2 classes);
* ``cancer`` -- scikit-learn breast cancer: 80 records drawn at random (seed 0)
  and the first 10 features (the "mean" measurements), scaled over the whole
  data set. The full 569 x 30 set would make the LOO set 7x larger and every
  MILP wider; 80 x 10 keeps the file well under a minute (bounds ~4 s) and
  still trains to ~94% train accuracy;
* ``blobs``  -- make_blobs, 60 points, 3 centres (2-D, 3 classes).

For each: compute bounds, then search hard for a leaking input above them
(uniform samples, the training points, points on N's and on LOO networks'
decision boundaries found by bisection, jitter around the MILP's witness, and
:func:`jobs.guard.lucid.falsifier.find_leaking`'s gradient search); check that every
query the guard answers as certain is answered identically by ALL LOO
networks; and check the mechanism's frequencies on uncertain queries through
:class:`GuardedNetwork` (chi-square). A last test does the same agreement
check for the SISA vote rule on a 5-shard ensemble.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from sklearn.datasets import load_breast_cancer, make_blobs, make_moons

from jobs.guard.label_guard import (
    cell_centres,
    clip_unit,
    grid_cells,
    mechanism_probabilities,
    top_margin,
)
from jobs.guard.lucid.branch_and_bound import BoundReport, compute_bounds
from jobs.guard.lucid.falsifier import find_leaking, margins
from jobs.guard.lucid.shard_bounds import compute_shard_bounds, train_sharded_loo
from jobs.learners.networks.loo_training import LOOSet, train_loo
from tests.bench.guarded_network import SOUND, GuardedNetwork

# LOO sets trained and bounded for three tables, then attacked: minutes together
pytestmark = pytest.mark.slow

torch.set_num_threads(1)

KW = dict(hidden=(8, 8), epochs=30, batch_size=8, seed=0)
BUDGET_S = 120.0  # generous; these bounds take 2-5 s here


def _scale(X: np.ndarray) -> np.ndarray:
    return (X - X.min(0)) / (X.max(0) - X.min(0))


def dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name == "moons":
        X, y = make_moons(60, noise=0.25, random_state=0)
        return _scale(X), y
    if name == "blobs":
        X, y = make_blobs(60, centers=3, cluster_std=1.5, random_state=0)
        return _scale(X), y
    d = load_breast_cancer()
    idx = np.random.default_rng(0).choice(len(d.target), 80, replace=False)
    return _scale(d.data)[idx][:, :10], d.target[idx]


_CACHE: dict[str, tuple[LOOSet, BoundReport, np.ndarray, np.ndarray]] = {}


def trained(name: str) -> tuple[LOOSet, BoundReport, np.ndarray, np.ndarray]:
    if name not in _CACHE:
        X, y = dataset(name)
        ids = [f"{name}{i:03d}" for i in range(len(y))]
        loo = train_loo(X, y, ids, **KW)
        _CACHE[name] = (loo, compute_bounds(loo, BUDGET_S, "highs"), X, y)
    return _CACHE[name]


def bisect(loo: LOOSet, net: np.ndarray, A: np.ndarray, B: np.ndarray, steps: int = 30
           ) -> np.ndarray:
    """Both ends of the segment [a, b] after bisecting on network ``net[k]``'s label."""
    a, b = A.copy(), B.copy()
    la = np.array([loo.logits(a[k:k + 1], [net[k]])[0, 0].argmax() for k in range(len(a))])
    for _ in range(steps):
        m = (a + b) / 2
        lm = np.array([loo.logits(m[k:k + 1], [net[k]])[0, 0].argmax() for k in range(len(m))])
        same = lm == la
        a[same], b[~same] = m[same], m[~same]
    return np.concatenate([a, b])


def hard_points(loo: LOOSet, rep: BoundReport, X: np.ndarray, seed: int) -> np.ndarray:
    """Training points, boundary points of N and of random LOO networks, witness jitter."""
    rng = np.random.default_rng(seed)
    d = X.shape[1]
    U = rng.random((6000, d))
    lab = loo.logits(U, [0])[0].argmax(1)
    pts = [X]
    # N's boundary: pairs with different labels
    i, j = rng.integers(0, len(U), 600), rng.integers(0, len(U), 600)
    diff = lab[i] != lab[j]
    pts.append(bisect(loo, np.zeros(diff.sum(), dtype=int), U[i[diff]], U[j[diff]]))
    # LOO networks' boundaries (where one of them flips while N may be confident)
    k = min(150, len(U) // 2)
    net = rng.integers(1, loo.n_networks, k)
    lj = np.array([loo.logits(U[t:t + 1], [net[t]])[0, 0].argmax() for t in range(k)])
    partner = rng.integers(0, len(U), k)
    lp = np.array([loo.logits(U[partner[t]:partner[t] + 1], [net[t]])[0, 0].argmax()
                   for t in range(k)])
    ok = lj != lp
    pts.append(bisect(loo, net[ok], U[:k][ok], U[partner[ok]]))
    # around each class's MILP witness (the worst leaking input the solver saw)
    for cb in rep.per_class.values():
        if cb.witness is not None:
            w = np.asarray(cb.witness["x"])
            for scale in (1e-4, 1e-3, 1e-2):
                pts.append(np.clip(w + rng.normal(0, scale, (300, d)), 0, 1))
    return np.concatenate(pts)


@pytest.mark.parametrize("name", ["moons", "cancer", "blobs"])
def test_no_leaking_input_above_the_bound(name: str) -> None:
    loo, rep, X, _y = trained(name)
    extra = hard_points(loo, rep, X, seed=1)
    lg = loo.logits(extra)
    for c in range(loo.n_classes):
        cb = rep.per_class[c]
        assert cb.stop_reason in ("singleton", "no leaking input"), cb.stop_reason
        # every leaking point among the hard points is at or below beta_c
        mN = margins(lg[0], c)
        leak = margins(lg[1:], c).min(0) <= 0
        if leak.any():
            assert mN[leak].max() <= rep.beta[c]
        s = find_leaking(loo, c, n_samples=20000, n_starts=64, steps=200, seed=c,
                         extra_points=extra)
        assert s.best_margin <= rep.beta[c], (c, s.best_margin, rep.beta[c])
        if cb.exact and np.isfinite(rep.beta[c]):  # the search is not vacuous: it gets close
            assert s.best_margin >= rep.beta[c] - 1e-2 * (1 + abs(rep.beta[c]))
        if cb.witness is not None and cb.witness["leaking"]:
            assert cb.witness["n_margin"] <= rep.beta[c]


@pytest.mark.parametrize("name", ["moons", "cancer", "blobs"])
def test_certain_answers_are_the_answers_of_every_loo_network(name: str) -> None:
    loo, rep, X, _y = trained(name)
    gn = GuardedNetwork(loo, rep, epsilon=0.0, memo_size=100_000, random_state=0)
    assert gn.mode == SOUND
    rng = np.random.default_rng(2)
    Q = np.concatenate([rng.random((3000, X.shape[1])), hard_points(loo, rep, X, seed=3)[:2000],
                        rng.random((200, X.shape[1])) * 3 - 1])  # some outside the box
    answers = np.empty(len(Q), dtype=np.int64)
    certain = np.zeros(len(Q), dtype=bool)
    for i, q in enumerate(Q):  # one query at a time: the counter says how it was answered
        before = gn.counters()["certain"]
        answers[i] = gn.predict(q)[0]
        certain[i] = gn.counters()["certain"] == before + 1
    assert certain.sum() >= 1000, certain.sum()
    every = loo.logits(clip_unit(Q[certain])).argmax(2)  # (networks, n_certain)
    assert (every == answers[certain][None, :]).all()


@pytest.mark.parametrize(("name", "epsilon"), [("moons", 1.0), ("blobs", 0.2), ("cancer", 1.0)])
def test_mechanism_frequencies_on_uncertain_queries(name: str, epsilon: float) -> None:
    loo, rep, X, _y = trained(name)
    gn = GuardedNetwork(loo, rep, epsilon=epsilon, random_state=5)
    rng = np.random.default_rng(4)
    Q = np.concatenate([hard_points(loo, rep, X, seed=6), rng.random((20000, X.shape[1]))])
    labels, marg = top_margin(gn._state.logits(clip_unit(Q)))  # white-box: pick uncertain ones
    Q = Q[marg <= np.asarray(gn.bound.beta)[labels]]
    _, first = np.unique(grid_cells(clip_unit(Q)), axis=0, return_index=True)  # one per cell
    Q = Q[np.sort(first)][:4000]
    # a noised answer is drawn for the label at its cell's centre
    labels = gn._state.logits(cell_centres(grid_cells(clip_unit(Q)))).argmax(1)
    assert len(Q) >= 1000, len(Q)
    out = gn.predict(Q)
    cnt = gn.counters()
    assert cnt["certain"] == 0 and cnt["noised"] == len(Q) and cnt["memo_hits"] == 0
    C = loo.n_classes
    offset = (out - labels) % C  # 0: the network's label; every other offset equally likely
    observed = np.bincount(offset, minlength=C)
    expected = mechanism_probabilities(0, C, epsilon) * len(Q)
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)
    assert (gn.predict(Q) == out).all()  # replayed from the memo


def test_sisa_rule_is_sound_against_every_single_deletion() -> None:
    """5 shards of make_moons(120): where the SISA rule says certain, replacing any one
    shard's network by any of its LOO networks leaves the majority vote unchanged."""
    X, y = make_moons(120, noise=0.25, random_state=1)
    X = _scale(X)
    ids = [f"s{i:03d}" for i in range(len(y))]
    sh = train_sharded_loo(X, y, ids, n_shards=5, seed=0, hidden=(8, 8), epochs=30,
                           batch_size=8)
    compute_shard_bounds(sh, BUDGET_S / 5, "highs")
    Q = np.random.default_rng(7).random((3000, 2))
    winner, certain = sh.certain(Q, "sisa")
    w2, naive = sh.certain(Q, "naive")
    assert (winner == w2).all() and not (naive & ~certain).any()  # naive is stricter
    assert certain.sum() > naive.sum() and certain.sum() > 300
    votes = np.zeros((len(Q), 2), dtype=np.int64)
    shard_labels = [loo.logits(Q, [0])[0].argmax(1) for loo in sh.shards]
    for lab in shard_labels:
        np.add.at(votes, (np.arange(len(Q)), lab), 1)
    for s, loo in enumerate(sh.shards):
        all_labels = loo.logits(Q[certain]).argmax(2)  # (M_s, n_certain)
        for lab in all_labels:
            v = votes[certain].copy()
            v[np.arange(len(v)), shard_labels[s][certain]] -= 1
            v[np.arange(len(v)), lab] += 1
            assert (v.argmax(1) == winner[certain]).all()
