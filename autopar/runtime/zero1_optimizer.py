"""Any elementwise ``torch.optim`` optimizer over ZeRO-1 chunks (``autopar.runtime.zero1``).

``pm.optimizer(torch.optim.AdamW, lr=1e-3)`` returns a ``ShardedStateOptimizer`` when the
plan makes some parameters ZeRO-1 (``plan.memory.zero1``). The wrapped optimizer steps, in
place of each such parameter, the view of its chunk (this rank's elements of it: its row of
the parameter's stream), so every state tensor it creates (Adam's m and v) has the chunk's
size; a parameter with no elements in this rank's row is not stepped here and has no state
here. A step reduce-scatters the
gradients into the chunks, runs the wrapped optimizer, and all-gathers the updated chunks
into the parameters; other parameters are stepped as they are. The optimizer must be
elementwise (Adam, AdamW, SGD, ...): one that mixes elements of a tensor (a norm over the
whole parameter, as LAMB's trust ratio) would see only the chunk.

``param_groups`` hold the module's own parameters, ``state`` maps each of them to the wrapped
optimizer's state of its chunk. ``state_dict`` gathers every chunk-sized state tensor into
the parameter's local shape (one all-gather per tensor on its ZeRO-1 dim: every rank must
call it, as ``checkpoint.save`` does) and ``load_state_dict`` takes this rank's chunk of
such tensors, so a checkpoint has the plain optimizer's layout and moves between meshes,
plans and single-device runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from autopar.runtime.wrapped_optimizer import WorkingCopyOptimizer
from autopar.runtime.zero1 import ZeroOneShards
from autopar.runtime.zero1_streams import Chunk


class ShardedStateOptimizer(WorkingCopyOptimizer):
    """``optimizer_class(params, **kwargs)`` keeping the state of ZeRO-1 parameters for their
    chunks only (see the module docstring)."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer], *, shards: ZeroOneShards,
                 **kwargs: Any) -> None:
        self._shards = shards
        self._chunk_of = {id(c.param): (name, c) for name, c in shards.chunks.items()}
        super().__init__(params, optimizer_class, **kwargs)
        missing = sorted(name for name, c in shards.chunks.items() if c.param not in self._working)
        if missing:
            raise ValueError(f"the plan shards the optimizer state of {', '.join(missing)} (ZeRO-1): an optimizer "
                             "over some of them only would leave the others' chunks unstepped while the step "
                             "gathers them; pass every ZeRO-1 parameter")

    def chunk(self, param: nn.Parameter) -> torch.Tensor | None:
        """The chunk the wrapped optimizer steps for ``param`` (None: stepped whole)."""
        return self._working[param] if id(param) in self._chunk_of else None

    def _working_copy(self, param: nn.Parameter) -> torch.Tensor:
        entry = self._chunk_of.get(id(param))
        return entry[1].view() if entry is not None and param.requires_grad else param

    def _step_working(self) -> None:
        """Gradients reduce-scattered into the chunks, the wrapped optimizer's step, chunks all-gathered."""
        grads = self._shards.reduce_scatter()
        for name, chunk in self._shards.chunks.items():
            grad = grads[name]
            self._working[chunk.param].grad = None if grad is None else grad.to(chunk.param.dtype)
        try:
            self.inner.step()
        finally:
            for chunk in self._shards.chunks.values():
                self._working[chunk.param].grad = None
        self._shards.all_gather()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, chunk-sized tensors gathered to the parameters'
        local shapes: the layout of the optimizer run without ZeRO-1 (a collective; a rank
        without elements of a parameter takes the rest of its state from those with some)."""
        self._sync_hyperparameters()
        out = self.inner.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        shared = self._shared_state(out["state"], params)
        for index, param in enumerate(params):
            chunk = self._chunk_of.get(id(param), (None, None))[1]
            if chunk is None or index not in shared:
                continue
            mine = out["state"].get(index, {})
            out["state"][index] = {k: self._shards.gather_whole(chunk, mine.get(k), v.like)
                                   if isinstance(v, _Piece) else v for k, v in shared[index].items()}
        return out

    def _shared_state(self, state: dict[int, dict[str, Any]], params: list[nn.Parameter]
                      ) -> dict[int, dict[str, Any]]:
        """Per ZeRO-1 parameter (by index) stepped on some rank of its dim: its state as any of
        them holds it, chunk-sized tensors as ``_Piece`` (one object all-gather per ZeRO-1 dim)."""
        dims = sorted({c.mesh_dim for c in self._shards.chunks.values()})
        shared: dict[int, dict[str, Any]] = {}
        for dim in dims:
            mine = {}
            for index, entries in state.items():
                chunk = self._chunk_of.get(id(params[index]), (None, None))[1]
                if chunk is not None and chunk.mesh_dim == dim:
                    mine[index] = {k: _Piece(v.new_empty(0)) if _is_chunk(chunk, v) else v for k, v in entries.items()}
            everyone: list[Any] = [None] * self._shards.mesh.size(dim)
            self._shards.settle()
            dist.all_gather_object(everyone, mine, group=self._shards.mesh.get_group(dim))
            for theirs in everyone:
                for index, entries in theirs.items():
                    shared.setdefault(index, entries)
        return shared

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain layout: each ZeRO-1 parameter's state tensors cut to this rank's
        elements (no state where it has none: that chunk is never stepped)."""
        # keys as torch's own load_state_dict matches them: the saved groups' params, by position
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        owner = dict(zip(saved, (p for g in self.param_groups for p in g["params"])))
        state = {}
        for index, entries in state_dict["state"].items():
            chunk = self._chunk_of.get(id(owner[index]), (None, None))[1]
            if chunk is None:
                state[index] = entries
            elif chunk.hi > chunk.lo:
                state[index] = {k: v.reshape(-1)[chunk.lo:chunk.hi].clone() if _is_whole(chunk, v) else v
                                for k, v in entries.items()}
        self._load_inner({**state_dict, "state": state})


@dataclass(frozen=True)
class _Piece:
    """A state tensor kept for a rank's elements of a parameter (``state_dict``)."""

    like: torch.Tensor
    """An empty tensor of its dtype and device."""


def _is_chunk(chunk: Chunk, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == chunk.hi - chunk.lo


def _is_whole(chunk: Chunk, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == chunk.param.shape


def sharded_state_optimizer(shards: ZeroOneShards, optimizer_class: type[Optimizer], params: Iterable[Any],
                            **kwargs: Any) -> ShardedStateOptimizer:
    """``ShardedStateOptimizer`` over ``params`` for the chunks of ``shards``."""
    return ShardedStateOptimizer(params, optimizer_class, shards=shards, **kwargs)
