"""Small models shared by tests that need a particular graph shape."""

from __future__ import annotations

import torch


class PairwiseBatch(torch.nn.Module):
    """Splits its batch in two halves and combines them: the split of dim 0 stays local
    only if each rank holds a slice of both halves (a strided batch shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=0)
        return (self.lin(a) * self.lin(b)).sum()
