"""Guarded inference: the mechanism's law, the memo, noise-all, and the SISA vote rule."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from jobs.adaptive.budget import BudgetExhausted, LineageBudget
from jobs.guard.label_guard import (
    LabelGuard,
    LRUMemo,
    clip_unit,
    lucid_certain,
    mechanism_probabilities,
    sisa_certain,
    top_margin,
    vote_winner,
)
from jobs.orchestration.guarded_answers import AnswerCost, GuardedAnswers
from jobs.orchestration.registry import ModelVersion

ONES = lambda C: np.ones(len(C), dtype=int)  # noqa: E731 - the model's label at the cells
ZEROS = lambda C: np.zeros(len(C), dtype=int)  # noqa: E731


@pytest.mark.parametrize(("n_classes", "epsilon"), [(2, 0.0), (2, 1.0), (3, 0.2), (5, 2.0)])
def test_mechanism_frequencies_match_the_formula(n_classes: int, epsilon: float) -> None:
    guard = LabelGuard(n_classes, epsilon=epsilon, memo_size=1, random_state=0)
    guard.bind("v1", sound=False)
    n = 20_000
    X = np.arange(n, dtype=np.float32)[:, None]  # distinct cells: no memo replay
    answers = guard.answer(X, np.ones(n, dtype=int), np.zeros(n, dtype=bool), ONES)
    observed = np.bincount(answers, minlength=n_classes)
    expected = mechanism_probabilities(1, n_classes, epsilon) * n
    assert chisquare(observed, expected).pvalue > 1e-3
    p = mechanism_probabilities(1, n_classes, epsilon)
    assert p[1] / p[0] == pytest.approx(np.exp(epsilon / 2))


def test_certain_queries_get_the_label_and_the_rest_are_memoised() -> None:
    guard = LabelGuard(3, epsilon=0.0, memo_size=10, random_state=1)
    guard.bind("v1", sound=True)
    X = clip_unit(np.array([[0.2, 0.3], [0.5, 0.5], [1.7, -3.0]]))
    assert X[2].tolist() == [1.0, 0.0]
    labels = np.array([2, 1, 0])
    first = guard.answer(X, labels, np.array([True, False, False]), ONES)
    assert first[0] == 2
    for _ in range(20):  # repeating a noised query returns the memoised answer
        assert guard.answer(X, labels, np.array([True, False, False]),
                            ONES).tolist() == first.tolist()
    assert guard.counts.certain == 21 and guard.counts.memo_hits == 40


def test_noise_all_mode_noises_even_confident_queries() -> None:
    guard = LabelGuard(2, epsilon=0.0, memo_size=10_000, random_state=2)
    guard.bind("v1", sound=False)
    X = np.random.default_rng(0).random((2000, 3)).astype(np.float32)
    answers = guard.answer(X, np.zeros(2000, dtype=int), np.ones(2000, dtype=bool), ZEROS)
    assert guard.counts.certain == 0 and guard.counts.noised == 2000
    assert 0.4 < answers.mean() < 0.6


def test_a_new_model_version_starts_a_new_memo() -> None:
    guard = LabelGuard(2, epsilon=0.0, memo_size=10, random_state=3)
    guard.bind("v1", sound=False)
    x = np.zeros((1, 2), dtype=np.float32)
    guard.answer(x, np.array([0]), np.array([False]), ZEROS)
    assert len(guard.memo) == 1
    guard.bind("v1", sound=True)
    assert len(guard.memo) == 1
    guard.bind("v2", sound=False)
    assert len(guard.memo) == 0


def test_memo_evicts_the_oldest_and_counts() -> None:
    memo = LRUMemo(2)
    memo.put(b"a", 0)
    memo.put(b"b", 1)
    assert memo.get(b"a") == 0  # a is now the newest
    memo.put(b"c", 1)
    assert memo.get(b"b") is None and memo.evictions == 1 and len(memo) == 2


def test_margin_equal_to_beta_is_not_certain() -> None:
    scores = np.array([[1.0, 0.5], [0.0, 0.75], [0.0, 0.7]])
    labels, certain = lucid_certain(scores, np.array([0.5, 0.7]))
    assert labels.tolist() == [0, 1, 1]
    assert certain.tolist() == [False, True, False]


def test_top_margin_breaks_ties_towards_the_lowest_class() -> None:
    labels, margins = top_margin(np.array([[0.3, 0.3, 0.1]]))
    assert labels.tolist() == [0] and margins.tolist() == [0.0]


def _brute_force_certain(votes_by_shard: list[int], fragile: list[bool], n_classes: int,
                         max_shards: int = 1) -> bool:
    """Every change of vote (or removal) of up to `max_shards` fragile shards at once."""
    def winner(labels: list[int | None]) -> int:
        v = np.zeros(n_classes, dtype=int)
        for a in labels:
            if a is not None:
                v[a] += 1
        return int(vote_winner(v))

    base = winner(votes_by_shard)
    weak = [s for s in range(len(votes_by_shard)) if fragile[s]]
    for m in range(1, max_shards + 1):
        for group in itertools.combinations(weak, m):
            for new in itertools.product([*range(n_classes), None], repeat=m):
                changed = list(votes_by_shard)
                for s, b in zip(group, new, strict=True):
                    changed[s] = b
                if winner(changed) != base:
                    return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4).flatmap(lambda c: st.tuples(
    st.just(c), st.lists(st.tuples(st.integers(0, c - 1), st.booleans()), min_size=1,
                         max_size=7), st.integers(1, 3))))
def test_sisa_rule_matches_brute_force(case) -> None:
    n_classes, shards, max_shards = case
    S = len(shards)
    scores = np.zeros((S, 1, n_classes))
    betas = np.zeros((S, n_classes))
    for s, (a, fragile) in enumerate(shards):
        scores[s, 0, a] = 1.0  # margin 1
        betas[s, a] = 1.0 if fragile else 0.5
    winner, certain = sisa_certain(scores, betas, max_shards=max_shards)
    labels = [a for a, _ in shards]
    assert winner[0] == vote_winner(np.bincount(labels, minlength=n_classes))
    assert certain[0] == _brute_force_certain(labels, [f for _, f in shards], n_classes,
                                              max_shards)


def test_sisa_rule_ignores_inactive_shards_and_is_less_noisy_than_one_network() -> None:
    rng = np.random.default_rng(0)
    S, n, C = 7, 500, 3
    scores = rng.normal(size=(S, n, C))
    scores[:, :, 0] += 1.0
    betas = np.full((S, C), 0.8)
    winner, certain = sisa_certain(scores, betas)
    assert certain.mean() > 0.3
    # an inactive shard's vote does not count
    w2, _ = sisa_certain(scores, betas, active=np.array([True] * 6 + [False]))
    votes = np.zeros((n, C), dtype=int)
    for s in range(6):
        np.add.at(votes, (np.arange(n), np.argmax(scores[s], axis=1)), 1)
    assert (w2 == vote_winner(votes)).all()
    # a unanimous, all-fragile ensemble of 7 is still certain: one flip cannot win
    unanimous = np.zeros((S, 1, C))
    unanimous[:, 0, 1] = 1.0
    assert sisa_certain(unanimous, np.full((S, C), 5.0))[1].tolist() == [True]


def test_sisa_rule_two_shards_split_depends_on_the_tie_break() -> None:
    """Votes 1:1 go to class 0; only the shard voting 0 can change that by flipping."""
    scores = np.zeros((2, 1, 2))
    scores[0, 0, 0] = scores[1, 0, 1] = 1.0
    for fragile in itertools.product([False, True], repeat=2):
        betas = np.array([[2.0 if fragile[0] else 0.0] * 2, [2.0 if fragile[1] else 0.0] * 2])
        _, certain = sisa_certain(scores, betas)
        assert certain[0] == (not fragile[0])


def test_negative_zero_does_not_buy_fresh_noise() -> None:
    guard = LabelGuard(2, epsilon=0.0, memo_size=10, random_state=4)
    guard.bind("v1", sound=False)
    X = clip_unit(np.array([[0.0, 0.5], [-0.0, 0.5], [-1e-9, 0.5]]))
    guard.answer(X, np.zeros(3, dtype=int), np.zeros(3, dtype=bool), ZEROS)
    assert len(guard.memo) == 1 and guard.counts.memo_hits == 2


def test_near_duplicates_of_an_uncertain_query_get_one_answer() -> None:
    """Averaging away the noise with q, q + 1 ulp, q + 2 ulp, ...: all in one cell, one
    draw; the same draw in another serving process (same secret) and after the memo
    forgot it, and the epsilon counted once per cell (fresh = noised - memo hits)."""
    rng = np.random.default_rng(5)
    q = clip_unit(rng.random((1, 6)) * 0.9 + 0.05)
    copies = np.repeat(q, 1000, axis=0)
    for k in range(1, 1000):
        copies[k] = np.nextafter(copies[k - 1], np.float32(1.0))  # one more ulp each time
    copies = np.vstack([copies, np.nextafter(q, np.float32(0.0))])
    label_at = lambda C: np.ones(len(C), dtype=int)  # noqa: E731
    answers = []
    for _process in range(2):
        guard = LabelGuard(4, epsilon=0.1, memo_size=2, secret=b"deployment")
        guard.bind("v7", sound=True)
        out = guard.answer(copies, np.ones(len(copies), int), np.zeros(len(copies), bool),
                           label_at)
        assert len(set(out.tolist())) == 1
        fresh = guard.counts.noised - guard.counts.memo_hits
        assert fresh == 1, fresh  # one cell: one draw, one epsilon
        guard.answer(rng.random((5, 6)), np.ones(5, int), np.zeros(5, bool), label_at)
        assert guard.answer(q, np.ones(1, int), np.zeros(1, bool),
                            label_at)[0] == out[0]  # evicted, drawn again: the same answer
        answers.append(int(out[0]))
    assert answers[0] == answers[1]  # both processes
    other = LabelGuard(4, epsilon=0.1, memo_size=2, secret=b"deployment")
    draws = set()
    for v in range(50):  # each new version draws afresh for the same cell
        other.bind(f"v{v}", sound=True)
        draws.add(int(other.answer(q, np.ones(1, int), np.zeros(1, bool), label_at)[0]))
    assert len(draws) > 1


def test_a_cell_is_answered_with_the_label_at_its_centre() -> None:
    """The mechanism takes the label at the cell's centre, not each query's own: queries
    of one cell share a draw, and must share the label it was drawn for."""
    guard = LabelGuard(2, epsilon=50.0, memo_size=10, secret=b"s")  # eps 50: no flips
    guard.bind("v1", sound=False)
    X = np.array([[0.5001, 0.5001], [0.5029, 0.5029]], dtype=np.float32)  # one cell
    seen = []

    def label_at(C: np.ndarray) -> np.ndarray:
        seen.append(C.copy())
        return np.ones(len(C), dtype=int)

    out = guard.answer(X, np.array([0, 0]), np.zeros(2, bool), label_at)
    assert out.tolist() == [1, 1] and len(seen) == 1 and len(seen[0]) == 1
    assert np.allclose(seen[0][0], (np.floor(X[0] * 256) + 0.5) / 256)


# ---------------------------------------------------------------------------- guarded answers
class _Model:
    """What GuardedAnswers asks of a served model: three classes, certain where x0 > 0.5."""

    classes = np.array([10, 20, 30])
    guard_ready, noise_all, guard_complete = True, False, True
    guarded, forgetting = True, "exact"

    def certain(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.full(len(X), 2), X[:, 0] > 0.5

    def class_bounds(self) -> list[float]:
        return [0.1, 0.2, 0.3]

    def plain_labels(self, X: np.ndarray) -> np.ndarray:
        return np.zeros(len(X), dtype=int)

    def vote_counts(self, X: np.ndarray) -> np.ndarray:
        return np.tile([1, 0, 4], (len(X), 1))


class _Budgets:
    """Seed budgets of `allowed` answers per lineage, recording every reservation."""

    def __init__(self, allowed: int) -> None:
        self.left, self.asked = allowed, []

    def get(self, lineage: str) -> LineageBudget:
        return LineageBudget(lineage, 0.5, 1e-5, 10.0, 100, 0)

    def reserve(self, lineage: str, n: int) -> int:
        self.asked.append(n)
        got = min(n, self.left)
        self.left -= got
        return got


def _version(rule: str = "forest-loo", lineage: str | None = None) -> ModelVersion:
    manifest = {"guard": {"rule": rule}, **({"seed_lineage": lineage} if lineage else {})}
    return ModelVersion(name="m", version="v000001", seq=1, manifest=manifest,
                        created_at=datetime.now(UTC))


def _cells(n: int) -> np.ndarray:
    """n queries in n different noise cells, all uncertain (x0 <= 0.5)."""
    return np.column_stack([(np.arange(n) + 0.5) / 256, np.zeros(n)])


def test_guarded_answers_count_what_each_call_spent() -> None:
    answers = GuardedAnswers(epsilon=0.5, noise_secret=b"k" * 32)
    served = answers.bind(_version(), _Model())
    assert served.mode == "sound" and not served.refit_pending
    assert served.bounds() == [0.1, 0.2, 0.3]
    X = np.vstack([_cells(4), [[0.9, 0.0], [0.8, 0.0]]])  # four uncertain, two certain
    labels, cost = answers.answer(served, X)
    assert labels[4:].tolist() == [30, 30] and set(labels[:4].tolist()) <= {10, 20, 30}
    promises = ("noised",) * 4 + ("certified",) * 2  # per answer, in query order
    assert cost == AnswerCost(certain=2, noised=4, fresh=4, epsilon_spent=2.0, evicted=0,
                              promises=promises)
    again, replayed = answers.answer(served, X)  # the memo: same answers, no fresh epsilon
    assert again.tolist() == labels.tolist()
    assert replayed == AnswerCost(certain=2, noised=4, fresh=0, epsilon_spent=0.0,
                                  promises=promises)


def test_a_version_without_a_sound_guard_is_noise_all_until_refitted() -> None:
    model = _Model()
    model.guard_ready = False
    answers = GuardedAnswers()
    served = answers.bind(_version(), model)
    assert served.mode == "noise-all" and served.refit_pending
    assert served.bounds() == [0.0, 0.0, 0.0]
    cost = answers.answer(served, [[0.9, 0.0]])[1]
    assert cost.noised == 1 and cost.promises == ("noised",)  # certain, yet noised
    by_design = answers.bind(_version(rule="noise-all"), model)  # the game, before issue 30
    assert by_design.mode == "noise-all" and not by_design.refit_pending


def test_a_model_without_a_guard_answers_plain_labels_saying_what_it_forgot() -> None:
    """The game learner: no guard certifies or noises its answers; each says whether the
    version is an approximate update or an exact retrain, and no epsilon is spent."""
    model = _Model()
    model.guarded, model.guard_ready, model.forgetting = False, False, "approximate"
    answers = GuardedAnswers()
    served = answers.bind(_version(rule="none"), model)
    assert served.mode == "unguarded" and not served.refit_pending
    labels, cost = answers.answer(served, [[0.9, 0.0], [0.1, 0.0]])
    assert labels.tolist() == [10, 10]  # the plain labels, never noised
    assert cost == AnswerCost(promises=("approximate", "approximate")) and cost.answers == 0
    model.forgetting = "exact"
    assert answers.answer(served, [[0.9, 0.0]])[1].promises == ("exact",)


def test_unguarded_answers_are_plain_labels_and_cost_nothing() -> None:
    answers = GuardedAnswers(guarded=False)
    labels, cost = answers.answer(answers.bind(_version(), _Model()), _cells(3))
    assert labels.tolist() == [10, 10, 10] and cost.answers == 0
    assert cost == AnswerCost(promises=("exact",) * 3)  # an exact model's plain labels


def test_private_answers_are_reserved_in_blocks_until_the_budget_is_spent() -> None:
    budgets = _Budgets(allowed=6)
    answers = GuardedAnswers(budgets=budgets, reserve_block=4)
    served = answers.bind(_version(lineage="L1"), _Model())
    assert served.mode == "private" and served.private and not served.refit_pending
    _, cost = answers.answer(served, _cells(1))
    assert budgets.asked == [4] and cost == AnswerCost(noised=1, fresh=1, epsilon_spent=0.5,
                                                      promises=("noised",))
    answers.answer(served, _cells(4))  # three fresh cells, from the reservation
    assert budgets.asked == [4]
    _, cost = answers.answer(served, _cells(6))  # two fresh: the last two of the budget
    assert budgets.asked == [4, 4] and cost.fresh == 2
    with pytest.raises(BudgetExhausted, match="budget of this model's seeds is spent"):
        answers.answer(served, _cells(7))
    assert served.guard.counts.noised == 11  # the refused call answered nothing


def test_private_mode_refuses_a_version_without_a_seed_lineage() -> None:
    answers = GuardedAnswers(budgets=_Budgets(allowed=10))
    served = answers.bind(_version(), _Model())
    with pytest.raises(BudgetExhausted, match="has no seed lineage"):
        answers.answer(served, _cells(1))
