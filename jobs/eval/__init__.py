"""Privacy and utility evaluation of unlearning, for any learner with ``scores()``.

:func:`evaluate_unlearning` is the entry point (the worker records its dict in the
``applied`` event); :mod:`jobs.eval.attacks` holds the attackers (also the game's
frozen ``M_A``), :mod:`jobs.eval.metrics` the plain metrics.
"""

from jobs.eval.attacks import AttackConfig, Attacker, pair_features
from jobs.eval.metrics import as_probabilities, mean_kl, priaa
from jobs.eval.unlearning import FrozenScores, evaluate_unlearning

__all__ = [
    "AttackConfig",
    "Attacker",
    "FrozenScores",
    "as_probabilities",
    "evaluate_unlearning",
    "mean_kl",
    "pair_features",
    "priaa",
]
