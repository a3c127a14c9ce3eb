"""The jobs' deployment settings: which learner, the guard, private mode, the worker.

Read like every layer's (OBLIVIATE_<FIELD>, :class:`ledger.env_settings.EnvSettings`);
where the ledger lives is the ledger's own (:class:`ledger.config.LedgerSettings`).
The service reads these too: the model it serves, whether it guards, private mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from ledger.env_settings import EnvSettings


@dataclass(frozen=True)
class JobSettings(EnvSettings):
    """What the worker trains and publishes, and under which guarantees it is served."""

    model_name: str = "obliviate"
    learner: str = "dare"
    guard: str = "on"  # "off" serves raw labels: a benchmark baseline, not private
    evaluate: str = "off"  # "on": the worker measures each deletion's privacy (jobs.eval)
    # "private": SISA answers by noisy vote, private in the shard seeds (jobs.adaptive)
    answers: str = "guard"
    private_epsilon: float = 0.5  # eps0 of one private answer
    seed_epsilon_budget: float = 10.0  # (eps, delta) of a seed lineage's answers
    seed_delta: float = 1e-5
    # versions superseded by a deletion are destroyed this long after it was published;
    # a serving process that could not check the registry for half of it stops answering
    destroy_grace_s: float = 30.0
    worker_metrics_port: int = 9101
