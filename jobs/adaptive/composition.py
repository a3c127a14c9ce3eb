"""Privacy loss of k answers, each eps0-DP in the shard seeds: the optimal composition.

Kairouz, Oh and Viswanath (ICML 2015, Thm 3.3) in closed form as binomial tails, evaluated
in log space; rounding can only make the reported loss larger. The basic and advanced
composition bounds are reported beside it.
See docs/guard.md (Private prediction mode)."""

from __future__ import annotations

import math

from scipy.stats import binom

_REL, _ABS = 1e-9, 1e-15


def _check(k: int, eps0: float, delta: float) -> None:
    if isinstance(k, bool) or int(k) != k or k < 0:
        raise ValueError(f"the number of answers must be an integer >= 0, got {k!r}")
    if not (math.isfinite(eps0) and eps0 > 0):
        raise ValueError(f"epsilon per answer must be a positive number, got {eps0!r}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")


def kov_delta(k: int, i: int, eps0: float) -> float:
    """delta_i of the optimal composition of ``k`` eps0-DP answers at eps_i = (k-2i) eps0."""
    if i <= 0:
        return 0.0
    p = math.exp(eps0) / (1.0 + math.exp(eps0)) if eps0 < 700 else 1.0
    first = binom.logcdf(i - 1, k, 1.0 - p)
    second = (k - 2 * i) * eps0 + binom.logcdf(i - 1, k, p)
    return max(0.0, math.exp(first) - math.exp(second)) if second < 700 else 0.0


def epsilon_spent(k: int, eps0: float, delta: float) -> float:
    """The smallest eps with k adaptively chosen eps0-DP answers (eps, delta)-DP (optimal)."""
    _check(k, eps0, delta)
    if k == 0:
        return 0.0
    lo, hi = 0, k // 2  # delta_lo <= delta always (delta_0 = 0); find the largest such i
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kov_delta(k, mid, eps0) * (1 + _REL) + _ABS <= delta:
            lo = mid
        else:
            hi = mid - 1
    return (k - 2 * lo) * eps0


def basic_epsilon(k: int, eps0: float) -> float:
    """k eps0: the basic composition (delta 0)."""
    return k * eps0


def advanced_epsilon(k: int, eps0: float, delta: float) -> float:
    """sqrt(2 k ln(1/delta)) eps0 + k eps0 (e^eps0 - 1): the advanced composition bound."""
    _check(k, eps0, delta)
    return math.sqrt(2 * k * math.log(1 / delta)) * eps0 + k * eps0 * math.expm1(eps0)


def answers_allowed(budget: float, eps0: float, delta: float, cap: int = 10**9) -> int:
    """The most answers whose optimal composition stays within ``(budget, delta)``."""
    _check(0, eps0, delta)
    if not (math.isfinite(budget) and budget >= 0):
        raise ValueError(f"the epsilon budget must be a number >= 0, got {budget!r}")
    lo, hi = 0, 1
    while hi < cap and epsilon_spent(hi, eps0, delta) <= budget:
        lo, hi = hi, min(2 * hi, cap)
    if hi == cap and epsilon_spent(hi, eps0, delta) <= budget:
        return cap
    while hi - lo > 1:  # epsilon_spent(lo) <= budget < epsilon_spent(hi)
        mid = (lo + hi) // 2
        if epsilon_spent(mid, eps0, delta) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def gupta_answers(budget: float, eps0: float, delta: float) -> int:
    """floor(eps^2 / (8 eps0^2 ln(1/delta))): the paper's count before a full retrain."""
    return math.floor(budget**2 / (8 * eps0**2 * math.log(1 / delta)))
