"""Guarded answers: a published version bound to its own label guard, and what answering costs.

Which answers are certain, the noise of the others, private mode's reservations and the
count of what each call spent are the guard's business, not HTTP's: a serving process binds
every version it installs (:meth:`GuardedAnswers.bind`, a fresh :class:`LabelGuard` each,
so noised answers of one training set are never replayed for another) and answers with it.
See docs/DESIGN.md (What each answer promises)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jobs.adaptive.budget import BudgetExhausted, LineageBudget, SeedBudgets
from jobs.guard.label_guard import LabelGuard, clip_unit

if TYPE_CHECKING:
    from jobs.orchestration.registry import ModelVersion
    from jobs.orchestration.served_model import ServedModel


@dataclass(frozen=True)
class GuardedVersion:
    """One installed version; immutable except for its guard's memo and counters."""

    version: ModelVersion
    model: ServedModel
    guard: LabelGuard
    lock: threading.Lock = field(default_factory=threading.Lock)
    private: bool = False  # private prediction mode: noisy votes under the seeds' budget
    budget: LineageBudget | None = None  # its seed lineage as it was when installed

    @property
    def mode(self) -> str:
        if self.private:
            return "private"
        if not self.model.guarded:
            return "unguarded"  # the game learner: plain labels, approximate or exact
        return "sound" if self.guard.sound else "noise-all"

    @property
    def refit_pending(self) -> bool:
        """Noise-all only until the worker refits the guard (not by design: a learner
        without a guard, and private prediction mode, which noises every answer)."""
        by_design = (self.private or not self.model.guarded
                     or self.version.manifest["guard"]["rule"] == "noise-all")
        return not (self.guard.sound or by_design)

    def bounds(self) -> list[float]:
        """The guard's bound per class (0 while it does not certify answers)."""
        bounds = self.model.class_bounds() or [0.0] * len(self.model.classes)
        return [b if self.guard.sound else 0.0 for b in bounds]


PROMISES = ("certified", "noised", "exact", "approximate")


@dataclass(frozen=True)
class AnswerCost:
    """What one call spent: answers certain and noised (memo replays included), the
    noised ones drawn fresh (each spends epsilon), and memo entries evicted; and what each
    answer promises (one of PROMISES, in query order: docs/guard.md, "What each answer
    promises")."""

    certain: int = 0
    noised: int = 0
    fresh: int = 0
    epsilon_spent: float = 0.0
    evicted: int = 0
    promises: tuple[str, ...] = ()

    @property
    def answers(self) -> int:
        return self.certain + self.noised


class SeedReservations:
    """Private answers this process reserved per seed lineage and has not given yet,
    topped up in blocks from the lineage's budget in the database (one round trip per
    block, not per answer)."""

    def __init__(self, budgets: SeedBudgets, block: int) -> None:
        self.budgets = budgets
        self.block = block
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, lineage: str, n: int) -> None:
        """Take `n` answers; BudgetExhausted when the lineage's budget cannot give them."""
        with self._lock:
            have = self._reserved.get(lineage, 0)
            if have < n:
                have += self.budgets.reserve(lineage, max(n - have, self.block))
            if have < n:
                self._reserved[lineage] = have
                raise BudgetExhausted("the privacy budget of this model's seeds is spent; "
                                      "a retrain with fresh seeds is on its way")
            self._reserved[lineage] = have - n


class GuardedAnswers:
    """One serving process's guard settings: binds versions and answers queries with them.

    `budgets` set: private prediction mode (:mod:`jobs.adaptive`), every answer a noisy
    vote reserved against its seed lineage's budget. `noise_secret` keys every noised
    draw, so every serving process with it answers a cell alike (None: a random one per
    version). `guarded` False answers plain labels (a benchmark's baseline, not private).
    """

    def __init__(self, *, epsilon: float = 1.0, memo_size: int = 100_000,
                 guarded: bool = True, budgets: SeedBudgets | None = None,
                 reserve_block: int = 32, noise_secret: bytes | None = None) -> None:
        self.epsilon = epsilon
        self.memo_size = memo_size
        self.guarded = guarded
        self.budgets = budgets
        self.noise_secret = noise_secret
        self.reservations = None if budgets is None else SeedReservations(budgets,
                                                                           reserve_block)

    def bind(self, version: ModelVersion, model: ServedModel) -> GuardedVersion:
        """`model` (the files of `version`) with a fresh guard bound to it."""
        guard = LabelGuard(len(model.classes), epsilon=self.epsilon, memo_size=self.memo_size,
                           secret=self.noise_secret)
        guard.bind(version.version, sound=(model.guard_ready and not model.noise_all
                                           and self.budgets is None))
        budget = None
        if self.budgets is not None and version.manifest.get("seed_lineage"):
            budget = self.budgets.get(version.manifest["seed_lineage"])
        return GuardedVersion(version, model, guard, private=self.budgets is not None,
                              budget=budget)

    def answer(self, served: GuardedVersion, X: np.ndarray) -> tuple[np.ndarray, AnswerCost]:
        """Published labels for validated queries, and what answering them spent."""
        Xq = clip_unit(np.asarray(X, dtype=np.float64))
        if served.private:
            return self._answer_private(served, Xq)
        if not (self.guarded and served.model.guarded):
            # plain labels: they promise what the model's forgetting is, no more
            return (served.model.classes[served.model.plain_labels(Xq)],
                    AnswerCost(promises=(served.model.forgetting,) * len(Xq)))
        labels, certain = served.model.certain(Xq)
        with served.lock:
            before = _counters(served.guard)
            idx = served.guard.answer(Xq, labels, certain,
                                      lambda C: served.model.certain(C)[0])
            cost = _spent(before, _counters(served.guard), self.epsilon)
        kept = np.asarray(certain, dtype=bool) & served.guard.sound  # as the guard decided
        promises = tuple(np.where(kept, "certified", "noised").tolist())
        return served.model.classes[idx], dataclasses.replace(cost, promises=promises)

    def _answer_private(self, served: GuardedVersion, Xq: np.ndarray
                        ) -> tuple[np.ndarray, AnswerCost]:
        """Noisy votes, each fresh cell taken from this process's reservation first."""
        if served.budget is None:
            raise BudgetExhausted(f"{served.version.version} has no seed lineage: the worker "
                                  "retrains on fresh seeds for private prediction mode")
        lineage, epsilon = served.budget.lineage, served.budget.epsilon_per_answer
        assert self.reservations is not None  # private: made with budgets
        with served.lock:
            before = _counters(served.guard)
            idx = served.guard.answer_votes(
                Xq, served.model.vote_counts, epsilon,
                spend=lambda n: self.reservations.take(lineage, n))
            cost = _spent(before, _counters(served.guard), epsilon)
        return (served.model.classes[idx],
                dataclasses.replace(cost, promises=("noised",) * len(idx)))


def _counters(guard: LabelGuard) -> tuple[int, int, int, int]:
    c = guard.counts
    return c.certain, c.noised, c.memo_hits, guard.memo.evictions


def _spent(before: tuple[int, int, int, int], after: tuple[int, int, int, int],
           epsilon: float) -> AnswerCost:
    certain, noised, hits, evicted = (a - b for a, b in zip(after, before, strict=True))
    return AnswerCost(certain, noised, noised - hits, epsilon * (noised - hits), evicted)
