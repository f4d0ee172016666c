"""``self.recompute(region, policy, *inputs)``: a checkpointed block's forward, run so
that backward recomputes what it did not keep (the calls ``autopar.passes.checkpoint_blocks``
writes).

torch's non-reentrant checkpoint runs the region; 'full' keeps only its inputs, 'selective'
also keeps the outputs of the ops in ``autopar.cost.recompute.SAVED_DISPATCH_OPS`` (matmuls
and attention) and recomputes the rest. The recompute must reproduce the forward bit for bit:
- random draws come from the module's own generator (``RandomOps``), which torch's
  checkpoint does not preserve: the recompute starts from the generator's state at region
  entry and leaves it where it found it;
- early stop is off, so a recompute runs the whole region, every forward collective in it
  included, on every rank alike (a rank stopping early would skip collectives its peers run);
- those collectives are logged as phase "recompute" (``Comm.recomputing``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn, set_checkpoint_early_stop)

from autopar.cost.recompute import SAVED_DISPATCH_OPS
from autopar.runtime.ops import Comm


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_DISPATCH_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


class _RegionRun:
    """The function checkpoint calls: first the forward, then each recompute, which starts
    from the generator state the forward started from."""

    def __init__(self, region: nn.Module, comm: Comm, generator: torch.Generator) -> None:
        self.region, self.comm, self.generator = region, comm, generator
        self.entry = generator.get_state()
        self.ran = False

    def __call__(self, *inputs: Any) -> Any:
        if not self.ran:
            self.ran = True
            return self.region(*inputs)
        after = self.generator.get_state()  # where later draws (forward or backward) left it
        self.generator.set_state(self.entry)
        try:
            with self.comm.recomputing():
                return self.region(*inputs)
        finally:
            self.generator.set_state(after)


class Recompute(nn.Module):
    """Runs a region under activation checkpointing with policy 'full' or 'selective'
    ('none', or grad disabled: just runs it)."""

    def __init__(self, comm: Comm, generator: torch.Generator) -> None:
        super().__init__()
        self.comm = comm
        self.generator = generator

    def forward(self, region: nn.Module, policy: str, *inputs: Any) -> Any:
        if policy == "none" or not torch.is_grad_enabled():
            return region(*inputs)
        if policy not in ("full", "selective"):
            raise ValueError(f"unknown checkpointing policy {policy!r}")
        context_fn = _selective_contexts if policy == "selective" else noop_context_fn
        with set_checkpoint_early_stop(False):
            return checkpoint(_RegionRun(region, self.comm, self.generator), *inputs, use_reentrant=False,
                              context_fn=context_fn)
