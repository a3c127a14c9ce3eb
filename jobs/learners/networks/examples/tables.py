"""An MLP for a table with text categories that learns an embedding per categorical column.

The ledger stores a categorical column one-hot (docs/tables.md, "The encoding"), and the
network reads that block as stored: a bias-free ``Linear(width, dim)`` on a one-hot block
*is* an embedding lookup (the row of the category), and unlike looking up a category code
it stays a linear map on every point of [0, 1]^d the guard reasons about, and trains with
deterministic matrix products on the CPU and CUDA. See docs/learners.md (Your own network)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class CategoryEmbeddingMLP(nn.Module):
    """Numeric features as they are, each categorical block through its own embedding,
    all concatenated into a one-hidden-layer ReLU MLP."""

    def __init__(self, n_features: int, n_classes: int, blocks: Sequence[Sequence[int]],
                 dim: int, hidden: int) -> None:
        super().__init__()
        self.parts = _parts(n_features, blocks)  # (start, width, is a categorical block)
        self.embed = nn.ModuleList(nn.Linear(w, dim, bias=False)
                                   for _, w, cat in self.parts if cat)
        width = sum(dim if cat else w for _, w, cat in self.parts)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(),
                                 nn.Linear(hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embeds = iter(self.embed)
        cols = [next(embeds)(x[:, s:s + w]) if cat else x[:, s:s + w]
                for s, w, cat in self.parts]
        return self.mlp(torch.cat(cols, dim=1))


def _parts(n_features: int, blocks: Sequence[Sequence[int]]) -> list[tuple[int, int, bool]]:
    """The row cut into numeric runs and categorical blocks, in order; ValueError for a
    block outside the row or overlapping another."""
    parts, at = [], 0
    for start, width in sorted((int(s), int(w)) for s, w in blocks):
        if start < at or width < 1 or start + width > n_features:
            raise ValueError(f"block [{start}, {width}] is outside the {n_features} features "
                             "or overlaps another")
        if start > at:
            parts.append((at, start - at, False))
        parts.append((start, width, True))
        at = start + width
    if at < n_features:
        parts.append((at, n_features - at, False))
    return parts


def category_blocks(feature_names: Sequence[str]) -> list[list[int]]:
    """The ``blocks`` of a table from its encoded feature names (``GET /v1/schema``): each
    run of features named ``column=category`` of one column is one block."""
    blocks: list[list[int]] = []
    prev = None
    for j, name in enumerate(feature_names):
        column = name.split("=", 1)[0] if "=" in name else None
        if column is not None and column == prev:
            blocks[-1][1] += 1
        elif column is not None:
            blocks.append([j, 1])
        prev = column
    return blocks


def build(n_features: int, n_classes: int, blocks: Sequence[Sequence[int]] = (),
          dim: int = 4, hidden: int = 32) -> nn.Module:
    """The MLP; ``blocks``: ``[start, width]`` of each categorical column's one-hot block in
    the encoded row (:func:`category_blocks`; none: a plain MLP), ``dim`` the embedding
    width."""
    return CategoryEmbeddingMLP(n_features, n_classes, blocks, int(dim), int(hidden))
