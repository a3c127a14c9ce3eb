"""Privacy and utility evaluation of unlearning, for any learner with ``scores()``.

:func:`evaluate_unlearning` is the entry point (the worker records its dict in the
``applied`` event); :mod:`jobs.learners.game.attacks` holds the attackers (also the game's
frozen ``M_A``), :mod:`jobs.learners.scoring` the plain metrics.
See docs/learners.md (Privacy evaluation)."""

from jobs.eval.unlearning import FrozenScores, evaluate_unlearning
from jobs.learners.game.attacks import AttackConfig, Attacker, pair_features
from jobs.learners.scoring import as_probabilities, mean_kl, priaa

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
