"""``self.partial_mean_loss(...)``: a batch-split 'mean' loss as local sum / global count (the
calls ``autopar.passes.localize_losses`` writes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as fc
from torch import nn

from autopar.rules import loss as loss_rules
from autopar.rules.redistribute import ALL_REDUCE
from autopar.runtime.ops import Comm


class PartialMeanLoss(nn.Module):
    """A batch-split 'mean' loss: local sum / global count.

    ``self.partial_mean_loss(op, mesh_dims, count, *args)`` with the loss op's own
    arguments. ``count`` is the global count (a number), the whole targets to count it
    on, or None: count the local targets and sum over ``mesh_dims``. The last call's global
    count stays in ``last_count``: a step of micro-batches weighs each by it. ``per_step``: the
    local sum, not divided, and its local count in ``last_count`` (a pipelined step sums both
    once: ``runtime.pipeline_loss``).
    """

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.last_count: torch.Tensor | None = None

    def forward(self, op: str, mesh_dims: tuple[int, ...], count: float | torch.Tensor | None,
                *args: Any, per_step: bool = False) -> torch.Tensor:
        target = getattr(torch.ops.aten, op.split(".")[1]).default
        if per_step:
            with torch.no_grad():
                self.last_count = loss_rules.global_count(target, args).to(torch.float32)
            return loss_rules.local_mean_loss(target, args, torch.ones((), dtype=torch.float32))
        with torch.no_grad():
            if isinstance(count, torch.Tensor):  # the whole targets
                count = loss_rules.global_count(target, (args[0], count, *args[2:]))
            elif count is None:
                count = loss_rules.global_count(target, args)
            count = torch.as_tensor(count, dtype=torch.float32).reshape(1)
            for dim in (d for d in mesh_dims if self.comm.mesh.size(d) > 1):
                self.comm._record("forward", ALL_REDUCE, dim, count)
                self.comm.settle()
                count = fc.wait_tensor(fc.all_reduce(count, "sum", (self.comm.mesh, dim)))
        self.last_count = count.reshape(())
        return loss_rules.local_mean_loss(target, args, count.reshape(()))
