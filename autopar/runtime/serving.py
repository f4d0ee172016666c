"""A serving deployment's module on one rank: a prefill program and a decode program on one copy of
the rank's state (``autopar.compile_serving`` plans and builds it: ``api.serving``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from autopar.errors import InputError
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline import PipelinedModule


class ServingModule(nn.Module):
    """This rank's prefill and decode programs on one copy of its parameter and KV-cache shards.

    ``prefill(*inputs)`` and ``decode(*inputs)`` run a step (without autograd) on inputs shaped as
    compiled (another shape is refused by name, as ``ParallelModule`` refuses it) and return its
    outputs as DTensors placed as planned. ``state_dict()`` and ``parameters()`` are the decode
    module's, which owns the state; ``placements`` maps each FQN to the placements both plans give it.
    """

    def __init__(self, *, prefill: ParallelModule | PipelinedModule, decode: ParallelModule | PipelinedModule
                 ) -> None:
        super().__init__()
        self.decode_module = decode  # owns the state (the only submodule: each tensor listed once)
        object.__setattr__(self, "prefill_module", prefill)

    @property
    def placements(self) -> dict[str, tuple[Placement, ...]]:
        return dict(self.decode_module._placements)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.decode_module.device_mesh

    @torch.no_grad()
    def prefill(self, *inputs: Any, **kwargs: Any) -> Any:
        """One prefill step (a chunk of one request's prompt, as compiled): the model's outputs."""
        return self.prefill_module(*inputs, **kwargs)

    @torch.no_grad()
    def decode(self, *inputs: Any, **kwargs: Any) -> Any:
        """One decode step (a token of every slot, as compiled): the model's outputs."""
        return self.decode_module(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        raise InputError("a ServingModule runs two programs: call .prefill(...) or .decode(...)")

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.decode_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        """Copy values into the shared shards (both programs read them)."""
        return self.decode_module.load_state_dict(state_dict, strict, assign)
