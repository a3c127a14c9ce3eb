"""What a network learner's networks train under (:class:`TrainingSpec`): fixed at ``fit``,
saved with the model, and part of what the trained bits depend on.
See docs/DESIGN.md (Training as a function of the SET of records)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from jobs.learners.networks.torch_nets import torch_threads
from jobs.learners.networks.user_network import UserNetwork


@dataclass(frozen=True, eq=False)
class TrainingSpec:
    """The resolved configuration (the estimator's ``config_``), the seed, the label set,
    the input width, the device and the user's network, if it has one
    (``config["network"]`` records it)."""

    config: dict[str, Any]
    seed: int
    classes: np.ndarray
    n_features: int
    device: torch.device
    network: UserNetwork | None = None

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def threads(self) -> Any:
        """The CPU thread count fixed while training and predicting (part of the bits)."""
        return torch_threads(self.config["cpu_threads"] if self.device.type == "cpu" else None)

    def platform(self) -> dict[str, Any]:
        """What the bits are reproducible on: device type, torch build, CPU threads."""
        return {"device_type": self.device.type, "torch": torch.__version__,
                "cpu_threads": self.config["cpu_threads"]}
