"""Networks of a user's own, for SISA's `network="tests.user_networks:<build>"` (and
`obliviate model train --network`): each `build(n_features, n_classes, **params)` returns
a torch module mapping (n, n_features) float32 rows to (n, n_classes) logits. Some that
work (an MLP with dropout, a plain ReLU MLP, one giving log-probabilities) and the mistakes
SISA must refuse; the shipped examples are in jobs/learners/networks/examples/.
See docs/learners.md (Your own network)."""

from __future__ import annotations

import torch
from torch import nn


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


def hooked_relu_mlp(n_features: int, n_classes: int) -> nn.Module:
    """A Linear/ReLU sequence whose output a forward hook changes: not what its weights say,
    so not a network the LUCID encoder may bound."""
    net = relu_mlp(n_features, n_classes)
    net[0].register_forward_hook(lambda _m, _i, out: 2 * out)
    return net
