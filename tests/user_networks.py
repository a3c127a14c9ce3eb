"""Networks of a user's own, for SISA's `network="tests.user_networks:<build>"` (and
`obliviate model train --network`): each `build(n_features, n_classes, **params)` returns
a torch module mapping (n, n_features) float32 rows to (n, n_classes) logits. Two that
work (a CNN for 8x8 images, an MLP with dropout) and the mistakes SISA must refuse.
See docs/learners.md (Your own network)."""

from __future__ import annotations

import math

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """A small CNN for square one-channel images given as flat rows (8x8 digits)."""

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


def digits_cnn(n_features: int, n_classes: int, channels: int = 4,
               hidden: int = 32) -> nn.Module:
    """The CNN for `n_features` = side x side pixels."""
    if math.isqrt(n_features) ** 2 != n_features:
        raise ValueError(f"{n_features} features are not a square image")
    return DigitsCNN(n_features, n_classes, channels, hidden)


def dropout_mlp(n_features: int, n_classes: int, hidden: int = 32,
                dropout: float = 0.2) -> nn.Module:
    """An MLP with dropout (random draws while training: SISA seeds them)."""
    return nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(hidden, n_classes))


def wrong_width(n_features: int, n_classes: int) -> nn.Module:
    """One logit too many."""
    return nn.Linear(n_features, n_classes + 1)


def not_a_module(n_features: int, n_classes: int) -> object:
    return [n_features, n_classes]


class _Scatter(nn.Module):
    """Uses `put_`, which has no deterministic implementation in torch."""

    def __init__(self, n_features: int, n_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_features, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out + torch.zeros_like(out).put_(torch.tensor([0]), torch.tensor([1.0]))


def nondeterministic(n_features: int, n_classes: int) -> nn.Module:
    return _Scatter(n_features, n_classes)


def relu_mlp(n_features: int, n_classes: int, hidden: tuple[int, ...] = (16,)) -> nn.Module:
    """A plain Linear/ReLU sequence: trained with the masked LOO schedule, bounded per shard."""
    layers: list[nn.Module] = []
    width = n_features
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    return nn.Sequential(*layers, nn.Linear(width, n_classes))


def log_softmax_mlp(n_features: int, n_classes: int, hidden: int = 16) -> nn.Module:
    """An MLP that outputs log-probabilities (for `loss="nll"`)."""
    return nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(),
                         nn.Linear(hidden, n_classes), nn.LogSoftmax(dim=1))
