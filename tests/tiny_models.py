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


class BigTable(torch.nn.Module):
    """One big embedding table and two small linears: nearly all of its optimizer state is
    the table's, so a memory limit can bind on that one parameter alone."""

    def __init__(self, vocab: int = 4096, hidden: int = 64, classes: int = 8) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(self.emb(tokens)))).mean(dim=1)


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Stack(torch.nn.Module):
    """An input projection (so every block's input needs a gradient: they fold) and ``n`` blocks."""

    def __init__(self, d: int, n: int = 2) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, d, bias=False)
        self.layers = torch.nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x
