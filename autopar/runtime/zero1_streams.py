"""Where ZeRO-1 parameters live (``autopar.runtime.zero1``): flat buffers, one per stream.

A stream (``autopar.cost.buckets.shard_buckets``) is the ZeRO-1 parameters of one mesh dim
that the step reduce-scatters (or only all-gathers), each one's local tensor padded to a
multiple of the dim's n ranks, end to end. One buffer holds a stream's weights, and the
parameters are views of it; viewed as n rows, the rank at index i owns row i: its elements
of each parameter (``Chunk``, a contiguous piece of it, empty for a parameter wholly in other
rows) are what its optimizer steps. So the all-gather of whole rows writes the parameters
themselves, and a reduce-scattered stream's gradient buffer, the parameters' ``.grad`` laid
as their weights are, is the reduce-scatter's input as it stands: as DeepSpeed's ZeRO-1/2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """This rank's elements of one ZeRO-1 parameter: those in its row of the parameter's stream."""

    param: nn.Parameter
    """The module's parameter (this rank's local tensor of it), a view of its stream's weights."""
    mesh_dim: int
    """The mesh dim its optimizer state is sharded on."""
    offset: int
    """Where its elements start in its stream."""
    columns: int
    """Elements per row of its stream."""
    index: int
    """This rank's index on ``mesh_dim``: it owns row ``index``."""

    def owned(self, index: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of the flattened parameter in row ``index`` (``lo == hi``: none)."""
        numel = self.param.numel()
        lo = min(max(index * self.columns - self.offset, 0), numel)
        return lo, max(min((index + 1) * self.columns - self.offset, numel), lo)

    @property
    def lo(self) -> int:
        """The first of its flattened elements that this rank owns."""
        return self.owned(self.index)[0]

    @property
    def hi(self) -> int:
        """One past the last (``lo == hi``: none; this rank keeps no optimizer state for it)."""
        return self.owned(self.index)[1]

    def view(self) -> torch.Tensor:
        """This rank's elements of the parameter, sharing its storage (what the optimizer steps)."""
        return self.param.detach().view(-1)[self.lo:self.hi]


class Stream:
    """One stream's buffers: ``weights`` (the parameters are views of it) and, for a
    reduce-scattered stream, each step's ``grads`` (their ``.grad``, where the dtype lets it be)."""

    def __init__(self, names: list[str], params: dict[str, nn.Parameter], mesh_dim: int, ways: int, index: int,
                 grad_dtype: torch.dtype | None) -> None:
        dtypes = {params[n].dtype for n in names}
        if len(dtypes) > 1:
            raise RuntimeError(f"ZeRO-1 parameters {names} on mesh dim {mesh_dim} mix dtypes {sorted(map(str, dtypes))}: "
                               "their all-gather buckets move one width")
        first = params[names[0]]
        sizes = [ways * math.ceil(params[n].numel() / ways) for n in names]
        self.ways, self.index, self.mesh_dim = ways, index, mesh_dim
        self.columns = sum(sizes) // ways
        """Elements per row."""
        self.weights = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        self.chunks: dict[str, Chunk] = {}
        offset = 0
        for name, size in zip(names, sizes):
            param = params[name]
            if not param.is_contiguous():
                raise RuntimeError(f"ZeRO-1 parameter {name} is not contiguous: it cannot be a view of its stream")
            region = self.weights[offset: offset + param.numel()]
            region.copy_(param.detach().reshape(-1))
            param.data = region.view(param.shape)
            self.chunks[name] = Chunk(param=param, mesh_dim=mesh_dim, offset=offset, columns=self.columns,
                                      index=index)
            offset += size
        self.pads = [(c.offset + c.param.numel(), c.offset + size) for c, size in zip(self.chunks.values(), sizes)
                     if size > c.param.numel()]
        """Stream elements past each parameter's own: zeros in every buffer."""
        self.grad_dtype = grad_dtype
        """The gradient buffer's dtype (None: a stream only all-gathered, with none)."""
        self.grads: torch.Tensor | None = None
        """This step's gradient buffer, from the first gradient backward accumulates to the
        reduce-scatter (``release``); the ``.grad`` views of it keep it until ``zero_grad``,
        so gradients live as long as backward's own would."""

    def check_views(self) -> None:
        """Raise unless every parameter is still a view of ``weights``: one whose storage was
        replaced (``module.to``, ``param.data = ...``) would miss every all-gather silently."""
        for name, chunk in self.chunks.items():
            region = self.weights[chunk.offset:]
            if chunk.param.data_ptr() != region.data_ptr() or not chunk.param.is_contiguous():
                raise RuntimeError(f"ZeRO-1 parameter {name} no longer views its stream's buffer (its storage was "
                                   "replaced after compile, e.g. by module.to or .data =): the step would not "
                                   "update it; load values with load_state_dict or copy_ instead")

    def rows(self, buffer: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Columns ``[start, stop)`` of ``buffer`` (one of this stream's) as (ways, stop - start)."""
        return buffer.view(self.ways, self.columns)[:, start:stop]

    def gradient_buffer(self) -> torch.Tensor:
        """``grads``, made for this step's gradients if none is held (its padding zeroed)."""
        if self.grads is None:
            assert self.grad_dtype is not None, "a stream only all-gathered holds no gradients"
            self.grads = torch.empty(self.weights.numel(), dtype=self.grad_dtype, device=self.weights.device)
            for lo, hi in self.pads:
                self.grads[lo:hi].zero_()
        return self.grads

    def release(self) -> None:
        """The step has reduce-scattered ``grads``: the next backward fills a new one."""
        self.grads = None

    def grad_region(self, name: str) -> torch.Tensor:
        """Where parameter ``name``'s gradient lies in ``grads``, shaped as the parameter."""
        chunk = self.chunks[name]
        return self.gradient_buffer()[chunk.offset: chunk.offset + chunk.param.numel()].view(chunk.param.shape)

    def take_grad(self, name: str) -> None:
        """``.grad`` into ``grads`` (zeros for none), then, in ``grads``' dtype, a view of it:
        the tensor backward made is freed, and later accumulation adds into the buffer."""
        param, region = self.chunks[name].param, self.grad_region(name)
        grad = param.grad
        if grad is None:
            region.zero_()
        elif grad.data_ptr() != region.data_ptr() or grad.shape != region.shape:
            region.copy_(grad)
            if grad.dtype == region.dtype:
                param.grad = region
