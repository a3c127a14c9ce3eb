"""Prometheus metrics of the serving processes.

BentoML runs several worker processes and aggregates their metrics through
PROMETHEUS_MULTIPROC_DIR, so every gauge states how processes combine:
the guard mode is the minimum (one process in noise-all mode shows), the
served version too (a process that has not swapped yet shows).
See docs/operations.md (Metrics and alerts)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge
from prometheus_client.core import GaugeMetricFamily

from jobs.orchestration.guarded_answers import PROMISES

if TYPE_CHECKING:
    from jobs.orchestration.guarded_answers import AnswerCost, GuardedVersion

GUARD_QUERIES = Counter(
    "obliviate_guard_queries",
    "Predictions answered by the guard, by outcome (certain label or noised).",
    ["outcome"],
)
ANSWERS = Counter(
    "obliviate_answers",
    "Predictions answered, by what each promises: certified (the guard: no one deletion "
    "changes it), noised (eps-iDP noise), exact or approximate (a learner without a guard: "
    "its version is an exact retrain, or the game's approximate update).",
    ["promise"],
)
for _promise in PROMISES:  # exported at 0, so a rate over them starts from there
    ANSWERS.labels(promise=_promise)
GUARD_EPSILON = Gauge(
    "obliviate_guard_epsilon_per_query",
    "Privacy loss (epsilon) of one noised answer.",
    multiprocess_mode="max",
)
GUARD_EPSILON_SPENT = Counter(
    "obliviate_guard_epsilon_spent",
    "Epsilon summed over fresh noised answers (memo replays cost nothing).",
)
GUARD_EPSILON_BUDGET = Gauge(
    "obliviate_guard_epsilon_budget",
    "Configured epsilon budget; an alert fires when the spent total reaches it.",
    multiprocess_mode="max",
)
GUARD_BOUND = Gauge(
    "obliviate_guard_bound",
    "The guard's bound per class of the served version (0 while in noise-all mode).",
    ["class"],
    multiprocess_mode="max",
)
GUARD_MODE = Gauge(
    "obliviate_guard_mode",
    "1 while a verified bound guards the served version, 0 in noise-all mode.",
    multiprocess_mode="min",
)
GUARD_REFIT_PENDING = Gauge(
    "obliviate_guard_refit_pending",
    "1 while the served version waits for the worker to refit its guard (noise-all until "
    "then); 0 when its rule holds as is, or noises every answer by design (the game "
    "learner, private prediction mode).",
    multiprocess_mode="max",
)
GUARD_COMPLETE = Gauge(
    "obliviate_guard_complete",
    "0 while the served version's guard is coarser than a refit (an update ran out of its "
    "--guard-grow time: sound, fewer answers certain) until the worker completes it; 1 "
    "otherwise.",
    multiprocess_mode="min",
)
MEMO_EVICTIONS = Counter(
    "obliviate_guard_memo_evictions",
    "Noised answers evicted from the memo (a repeat then costs fresh epsilon).",
)
SERVED_VERSION = Gauge(
    "obliviate_served_model_version",
    "Sequence number of the model version a serving process answers with.",
    multiprocess_mode="min",
)
MODEL_SWAPS = Counter(
    "obliviate_model_swaps",
    "Hot swaps of the in-memory model to a newly published version.",
)


class LedgerCollector:
    """Gauges read from the ledger database at scrape time.

    Pending requests and the current version are facts of the shared database,
    not of one process, so they are computed per scrape instead of being kept
    in multiprocess files.
    """

    def __init__(self, pending: Callable[[], int], unverified: Callable[[], int],
                 current_version: Callable[[], int],
                 seed_budget_spent: Callable[[], float]) -> None:
        self._pending = pending
        self._unverified = unverified
        self._current_version = current_version
        self._seed_budget_spent = seed_budget_spent

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("obliviate_requests_pending",
                                "Requests received or claimed but not yet applied.",
                                value=self._pending())
        yield GaugeMetricFamily("obliviate_requests_unverified",
                                "Requests applied to the served model whose exactness check "
                                "has not run yet (it runs after a pause in the stream, or "
                                "after --guard-max-wait under one that never pauses).",
                                value=self._unverified())
        yield GaugeMetricFamily("obliviate_model_version",
                                "Sequence number of the registry's current model version.",
                                value=self._current_version())
        yield GaugeMetricFamily("obliviate_adaptive_budget_spent_ratio",
                                "Share of the current seed lineage's privacy budget spent by "
                                "private answers (0 outside private prediction mode).",
                                value=self._seed_budget_spent())


def show_version(served: GuardedVersion) -> None:
    """The gauges of a newly installed version."""
    MODEL_SWAPS.inc()
    SERVED_VERSION.set(served.version.seq)
    GUARD_MODE.set(1 if served.guard.sound else 0)
    GUARD_REFIT_PENDING.set(1 if served.refit_pending else 0)
    GUARD_COMPLETE.set(1 if served.model.guard_complete else 0)
    for c, b in enumerate(served.bounds()):
        GUARD_BOUND.labels(**{"class": str(c)}).set(b)


def count_answers(cost: AnswerCost) -> None:
    """The counters of one call's answers."""
    if cost.certain:
        GUARD_QUERIES.labels(outcome="certain").inc(cost.certain)
    if cost.noised:
        GUARD_QUERIES.labels(outcome="noised").inc(cost.noised)
        GUARD_EPSILON_SPENT.inc(cost.epsilon_spent)
    if cost.evicted:
        MEMO_EVICTIONS.inc(cost.evicted)
    for promise in PROMISES:
        if (n := cost.promises.count(promise)):
            ANSWERS.labels(promise=promise).inc(n)
