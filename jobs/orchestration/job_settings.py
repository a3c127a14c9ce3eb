"""The jobs' deployment settings: which learner, the guard, private mode, the worker.

Read like every layer's (OBLIVIATE_<FIELD>, :class:`ledger.env_settings.EnvSettings`);
where the ledger lives is the ledger's own (:class:`ledger.config.LedgerSettings`).
The service reads these too: the model it serves, whether it guards, private mode.
See docs/operations.md (Worker settings)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ledger.config import STATE_DIR
from ledger.env_settings import EnvSettings

if TYPE_CHECKING:  # SciPy loads only with private mode, not with the command line
    from jobs.adaptive.budget import BudgetPolicy


@dataclass(frozen=True)
class JobSettings(EnvSettings):
    """What the worker trains and publishes, and under which guarantees it is served."""

    model_name: str = "obliviate"
    # where versions' files go, each ledger's under its identity (jobs.orchestration.
    # model_store); "bentoml": $BENTOML_HOME/models, where they went before
    model_store: str = str(STATE_DIR / "models")
    learner: str = "dare"
    # a SISA network of the user's, "package.module:build" (empty: the built-in networks)
    network: str = ""
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
    # where new models train (sisa, mlp): auto (CUDA when there is one), cpu, cuda, cuda:N;
    # a version keeps the device it was trained on (its bits depend on it)
    device: str = "auto"
    # the share of the CUDA device's memory this process may take (1: no cap)
    cuda_memory_fraction: float = 1.0

    def training_device(self) -> str:
        """OBLIVIATE_DEVICE, checked, with OBLIVIATE_CUDA_MEMORY_FRACTION applied to it when
        it is a CUDA device (torch.cuda.set_per_process_memory_fraction; idempotent): the
        device a command trains new models on. ValueError naming the variable."""
        if re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is None:
            raise ValueError("OBLIVIATE_DEVICE must be auto, cpu, cuda or cuda:N; got "
                             f"{self.device!r}")
        fraction = self.cuda_memory_fraction
        if not 0.0 < fraction <= 1.0:
            raise ValueError("OBLIVIATE_CUDA_MEMORY_FRACTION must be in (0, 1]; got "
                             f"{fraction!r}")
        import torch  # only the commands that train load torch

        if self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available()):
            return self.device
        if not torch.cuda.is_available():
            raise ValueError(f"OBLIVIATE_DEVICE={self.device}, but torch sees no CUDA device "
                             "(a CPU build of torch, or no driver)")
        dev = torch.device("cuda" if self.device == "auto" else self.device)
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"OBLIVIATE_DEVICE={self.device}: torch sees "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        if fraction < 1.0:
            torch.cuda.set_per_process_memory_fraction(fraction, index)
        return self.device

    def budget_policy(self) -> BudgetPolicy | None:
        """The deployment's policy in private prediction mode; None in guard mode."""
        if self.choice("answers", ("guard", "private")) == "guard":
            return None
        from jobs.adaptive.budget import BudgetPolicy

        if self.learner != "sisa":
            raise ValueError("OBLIVIATE_ANSWERS=private needs OBLIVIATE_LEARNER=sisa: the "
                             "answers are noisy votes over shards (got learner "
                             f"{self.learner!r})")
        return BudgetPolicy(epsilon_per_answer=self.private_epsilon,
                            epsilon_budget=self.seed_epsilon_budget, delta=self.seed_delta)
