"""Adaptive deletions: the composition of private answers, the noisy vote, the attack."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import chisquare

from jobs.adaptive.attack import run_trial, shard_guesses, wilson_interval
from jobs.adaptive.composition import (
    advanced_epsilon,
    answers_allowed,
    basic_epsilon,
    epsilon_spent,
    gupta_answers,
    kov_delta,
)
from jobs.adaptive.private_vote import private_vote, vote_probabilities


def _kov_delta_by_hand(k: int, i: int, eps0: float) -> float:
    """Kairouz-Oh-Viswanath's sum, term by term."""
    return sum(math.comb(k, j) * (math.exp((k - j) * eps0) - math.exp((k - 2 * i + j) * eps0))
               for j in range(i)) / (1 + math.exp(eps0)) ** k


def test_two_answers_by_hand() -> None:
    # k = 2, eps0 = 1: (2, 0)-DP, or (0, (e-1)/(e+1))-DP
    assert kov_delta(2, 1, 1.0) == pytest.approx((math.e - 1) / (math.e + 1), rel=1e-12)
    assert epsilon_spent(2, 1.0, 0.5) == 0.0
    assert epsilon_spent(2, 1.0, 0.1) == 2.0
    assert epsilon_spent(1, 0.3, 1e-6) == pytest.approx(0.3)
    assert epsilon_spent(0, 0.3, 1e-6) == 0.0


@pytest.mark.parametrize(("k", "eps0"), [(5, 0.5), (20, 0.1), (40, 1.0), (101, 0.05)])
def test_binomial_form_equals_the_sum(k: int, eps0: float) -> None:
    for i in range(k // 2 + 1):
        assert kov_delta(k, i, eps0) == pytest.approx(_kov_delta_by_hand(k, i, eps0),
                                                      rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("eps0", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("delta", [1e-3, 1e-6])
def test_optimal_composition_never_exceeds_the_classical_bounds(eps0: float, delta: float
                                                                 ) -> None:
    for k in [1, 2, 3, 10, 57, 100, 1000, 5000]:
        eps = epsilon_spent(k, eps0, delta)
        assert eps <= basic_epsilon(k, eps0) + 1e-12
        assert eps <= advanced_epsilon(k, eps0, delta) + 2 * eps0  # grid of step 2 eps0
        # and it is the guarantee of the largest i whose delta_i fits
        i = round((k - eps / eps0) / 2)
        assert kov_delta(k, i, eps0) <= delta
        if i + 1 <= k // 2:
            assert kov_delta(k, i + 1, eps0) > delta


def test_answers_allowed_is_the_last_count_within_budget() -> None:
    for budget, eps0, delta in [(1.0, 0.01, 1e-6), (5.0, 0.1, 1e-5), (0.25, 0.3, 1e-5)]:
        n = answers_allowed(budget, eps0, delta)
        assert epsilon_spent(n, eps0, delta) <= budget < epsilon_spent(n + 1, eps0, delta)
        assert n >= gupta_answers(budget, eps0, delta)  # the paper's count is looser
    assert answers_allowed(0.0, 0.5, 1e-5) == 0


@pytest.mark.parametrize("bad", [dict(k=-1), dict(eps0=0.0), dict(delta=1.0), dict(k=1.5)])
def test_bad_accounting_arguments_are_refused(bad: dict) -> None:
    args = {"k": 3, "eps0": 0.1, "delta": 1e-5, **bad}
    with pytest.raises(ValueError):
        epsilon_spent(args["k"], args["eps0"], args["delta"])


def test_noisy_vote_is_eps_dp_in_one_shards_vote() -> None:
    """Moving one shard's vote changes no answer's probability by more than e^eps."""
    for S, C, eps in [(3, 2, 1.0), (4, 3, 0.5), (5, 4, 2.0)]:
        for labels in itertools.product(range(C), repeat=S):
            v = np.bincount(labels, minlength=C)
            p = vote_probabilities(v, eps)[0]
            for s, b in itertools.product(range(S), range(C)):
                w = v.copy()
                w[labels[s]] -= 1
                w[b] += 1
                q = vote_probabilities(w, eps)[0]
                assert (p / q <= math.exp(eps) * (1 + 1e-12)).all()


def test_noisy_vote_frequencies_match_the_formula() -> None:
    votes = np.array([[4, 1, 0, 1]])
    rng = np.random.default_rng(0)
    draws = private_vote(np.repeat(votes, 20_000, axis=0), 0.8, rng)
    expected = vote_probabilities(votes, 0.8)[0] * len(draws)
    assert chisquare(np.bincount(draws, minlength=4), expected).pvalue > 1e-3
    assert np.allclose(vote_probabilities(votes, 0.0), 0.25)
    with pytest.raises(ValueError):
        vote_probabilities(votes, -1.0)


def test_wilson_interval_by_hand() -> None:
    lo, hi = wilson_interval(85, 100)
    assert (round(lo, 3), round(hi, 3)) == (0.767, 0.907)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_attacker_guesses_the_most_confident_shard() -> None:
    logits = np.zeros((3, 2, 2))
    logits[1, 0, 1] = 5.0  # shard 1 is sure record 0 has label 1
    logits[2, 1, 0] = 5.0  # shard 2 is sure record 1 has label 0
    assert shard_guesses(logits, np.array([1, 0])).tolist() == [1, 2]


def test_a_trial_runs_in_both_modes() -> None:
    rng = np.random.default_rng(0)
    X = rng.random((120, 4))
    y = (X[:, 0] > 0.5).astype(int)
    ids = np.array([f"r{i}" for i in range(120)], dtype=object)
    params = {"model": "mlp", "hidden": (8,), "epochs_per_slice": 3, "min_steps": 0,
              "n_shards": 4, "device": "cpu"}
    for mode in ("plain", "private"):
        r = run_trial(params, ids[:90], X[:90], y[:90], X[90:], y[90:], mode=mode, seed=1)
        assert r.statistic in (0, 1) and 0 <= r.accuracy <= 1 and 0 <= r.vote_accuracy <= 1
        assert 0 <= r.deleted <= 90
    with pytest.raises(ValueError, match="mode"):
        run_trial(params, ids, X, y, X, y, mode="oracle", seed=0)
