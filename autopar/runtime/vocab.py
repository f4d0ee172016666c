"""A lookup in a table split by its rows: what ``self.vocab_embedding(...)`` calls in per-rank programs run.

``self.vocab_embedding('S(0)R', weight, indices, padding_idx, scale_grad_by_freq, sparse)`` is
``aten.embedding`` on this rank's rows of the table (the vocabulary split over the mesh dims its
placements shard dim 0 on, as Megatron-LM's ``VocabParallelEmbedding`` and torchtitan's
``RowwiseParallel`` embedding do): an index this rank holds is looked up at its local row, any other
gives a zero row, so the ranks' outputs sum to the whole lookup (a Partial output). Backward follows:
only the rows this rank looked up get gradient (a zeroed row's gradient is zero), and the padding row
keeps none where this rank holds it.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.rules.strategy import parse_placements, shard_dim, split_factor

aten = torch.ops.aten


class VocabEmbedding(nn.Module):
    """Row-split table lookups for one rank at ``coordinate`` of a mesh of ``mesh_shape``."""

    def __init__(self, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        super().__init__()
        self.mesh_shape = tuple(mesh_shape)
        self.coordinate = tuple(coordinate)

    def first_row(self, where: str, rows: int) -> int:
        """The table row this rank's ``rows`` start at: its chunk of dim 0, cut by the mesh dims that shard
        it, mesh dim 0 outermost (DTensor's order)."""
        chunk = 0
        for p, n, c in zip(parse_placements(where), self.mesh_shape, self.coordinate):
            if shard_dim(p) == 0:
                if split_factor(p) != 1:  # the rule offers contiguous rows only
                    raise ValueError(f"a vocabulary-parallel lookup needs contiguous rows, not {where}")
                chunk = chunk * n + c
        return chunk * rows

    def forward(self, where: str, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
        rows = weight.shape[0]
        local = indices - self.first_row(where, rows)
        outside = (local < 0) | (local >= rows)
        pad = padding_idx - self.first_row(where, rows) if padding_idx >= 0 else -1
        pad = pad if 0 <= pad < rows else -1
        out = aten.embedding.default(weight, local.masked_fill(outside, 0), pad, scale_grad_by_freq, sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0)
