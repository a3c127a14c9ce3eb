"""A small CNN for square one-channel images given as flat rows (scikit-learn's 8x8
digits: ``obliviate demo --learner sisa --dataset digits --network
jobs.learners.networks.examples.digits:build``). Every operation it uses has a
deterministic implementation on the CPU and on CUDA, as SISA's exactness needs.
See docs/learners.md (Your own network)."""

from __future__ import annotations

import math

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions with ReLU and 2x2 max-pooling, then a one-hidden-layer head."""

    def __init__(self, n_features: int, n_classes: int, channels: int, hidden: int) -> None:
        super().__init__()
        self.side = math.isqrt(n_features)
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        width = 2 * channels * (self.side // 4) ** 2
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width, hidden), nn.ReLU(),
                                  nn.Linear(hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 1, self.side, self.side)))


def build(n_features: int, n_classes: int, channels: int = 4, hidden: int = 32) -> nn.Module:
    """The CNN for ``n_features`` = side x side pixels (a ValueError otherwise)."""
    if math.isqrt(n_features) ** 2 != n_features:
        raise ValueError(f"{n_features} features are not a square image")
    return DigitsCNN(n_features, n_classes, channels, hidden)
