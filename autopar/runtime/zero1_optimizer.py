"""Any elementwise ``torch.optim`` optimizer over ZeRO-1 chunks (``autopar.runtime.zero1``).

``pm.optimizer(torch.optim.AdamW, lr=1e-3)`` returns a ``ShardedStateOptimizer`` when the
plan makes some parameters ZeRO-1 (``plan.memory.zero1``). The wrapped optimizer steps, in
place of each such parameter, the view of its chunk (this rank's elements of it), so every
state tensor it creates (Adam's m and v) has the chunk's size. A step reduce-scatters the
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
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from autopar.runtime.wrapped_optimizer import WorkingCopyOptimizer
from autopar.runtime.zero1 import Chunk, ZeroOneShards


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
        local shapes: the layout of the optimizer run without ZeRO-1 (a collective)."""
        self._sync_hyperparameters()
        out = self.inner.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, entries in out["state"].items():
            chunk = self._chunk_of.get(id(params[index]), (None, None))[1]
            if chunk is not None:
                out["state"][index] = {k: self._shards.gather_whole(chunk, v) if _is_chunk(chunk, v) else v for k, v in entries.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain layout: each ZeRO-1 parameter's state tensors cut to this rank's chunk."""
        # keys as torch's own load_state_dict matches them: the saved groups' params, by position
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        owner = dict(zip(saved, (p for g in self.param_groups for p in g["params"])))
        state = {}
        for index, entries in state_dict["state"].items():
            chunk = self._chunk_of.get(id(owner[index]), (None, None))[1]
            state[index] = entries if chunk is None else {
                k: v.reshape(-1)[chunk.lo:chunk.hi].clone() if _is_whole(chunk, v) else v for k, v in entries.items()}
        self._load_inner({**state_dict, "state": state})


def _is_chunk(chunk: Chunk, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == chunk.hi - chunk.lo


def _is_whole(chunk: Chunk, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == chunk.param.shape


def sharded_state_optimizer(shards: ZeroOneShards, optimizer_class: type[Optimizer], params: Iterable[Any],
                            **kwargs: Any) -> ShardedStateOptimizer:
    """``ShardedStateOptimizer`` over ``params`` for the chunks of ``shards``."""
    return ShardedStateOptimizer(params, optimizer_class, shards=shards, **kwargs)
