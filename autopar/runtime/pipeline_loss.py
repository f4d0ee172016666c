"""A pipelined training step's loss, on the last stage: each micro-batch's weighed as
``runtime.microbatch`` weighs it (1/m for a mean, 1 for a sum, its target count for a cross
entropy dividing by counted targets, the accumulated gradients then divided by the step's total
count), and their sum reduced once per step.

Each micro-batch's loss stays as placed, Partial where the stage mesh splits the batch, and its
backward is seeded on every rank alike: the backward of a Partial -> Replicate reduction is the
identity, so the gradients are the same without it. The last stage's ranks then all-reduce the
sum of their weighted losses on the dims the loss is Partial on, once, as the plan lists and
prices it (``cost.summed_loss``), before it is broadcast to the other pp ranks. Where the loss is
a cross entropy whose count only the ranks together know (``counted``: the plan's
``problem.loss_collectives.summed_count_root``, split over the batch), each micro-batch's program
returns its local sum and counts its local targets (no collective), and that all-reduce sums the
counts beside the losses: the loss is the summed losses over the summed counts, the gradients
(each micro-batch's backward seeded with 1) divided by the summed counts once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.collectives import ALL_REDUCE
from autopar.cost.summed_loss import loss_summed_once, summed_loss_dims
from autopar.problem.loss_collectives import summed_count_root
from autopar.rules.loss import is_partial_mean_loss
from autopar.problem.micro_losses import COUNT, MEAN
from autopar.runtime.microbatch import weighed
from autopar.runtime.ops import CollectiveLog
from autopar.search.planned import PlannedStep


class StepLoss:
    """The loss of one pipelined step: ``weigh`` each micro-batch's as the schedule computes it,
    then ``shared`` the step's (weighted sum, total count) to broadcast and ``value`` the loss."""

    def __init__(self, *, kind: str, micro_batches: int, dtype: torch.dtype | None, dims: tuple[int, ...],
                 mesh: DeviceMesh, counted: bool = False) -> None:
        self.kind = kind
        self.micro_batches = micro_batches
        self.dtype = dtype  # mixed precision: each micro-batch's bf16 loss made fp32, as ParallelModule
        self.dims = dims  # stage mesh dims the loss is Partial on: the step's sum is all-reduced there
        self.mesh = mesh
        self.counted = counted  # the program returns its local sum and local count: both summed once
        self.counts: list[torch.Tensor] = []

    def begin(self) -> None:
        self.counts = []

    def weigh(self, loss: torch.Tensor, count: Callable[[], torch.Tensor | None]) -> torch.Tensor:
        """A micro-batch's loss as the step weighs it; ``count``: the count its loss divided by."""
        if self.dtype is not None:
            loss = loss.to(self.dtype)
        m = self.micro_batches
        if self.counted or (self.kind == COUNT and m > 1):
            counted = count()
            if counted is None:
                raise RuntimeError("the step's loss divides by a count, but the program recorded none")
            self.counts.append(counted.detach())
            return loss if self.counted else weighed(loss, counted)
        return loss * (1.0 / m) if self.kind == MEAN and m > 1 else loss

    def shared(self, losses: list[torch.Tensor], log: CollectiveLog | None) -> torch.Tensor:
        """(the micro-batches' weighted sum, whole; their total count) in fp32: on the last stage's
        ranks, the sum (and the counts where ``counted``) all-reduced once on the dims the loss is
        Partial on; zeros and 1 on the other ranks (``losses`` empty), which receive it."""
        total = torch.stack(self.counts).sum().float() if self.counts else torch.ones((), dtype=torch.float32)
        if not losses:
            return torch.stack([torch.zeros(()), total])
        shared = torch.stack([torch.stack([x.detach().float() for x in losses]).sum(), total])
        summed = shared if self.counted else shared[:1]  # a view: reduced in place
        for dim in self.dims:
            if log is not None:
                log.entries.append(("forward", ALL_REDUCE, dim, summed.numel() * summed.element_size()))
            dist.all_reduce(summed, group=self.mesh.get_group(dim))
        return shared

    def value(self, shared: torch.Tensor) -> torch.Tensor:
        """The step's loss from what ``shared`` gave (broadcast to every rank)."""
        return shared[0] / shared[1] if self.kind == COUNT or self.counted else shared[0]


def step_loss(step: PlannedStep, kind: str, micro_batches: int, compute_dtype: torch.dtype | None,
              mesh: DeviceMesh) -> StepLoss:
    """The loss of a training step of the pipelined ``step`` (``kind``: ``runtime.microbatch``'s) on
    its stage mesh ``mesh``."""
    assert step.graph.loss is not None
    dims = summed_loss_dims(step.chosen[step.graph.loss].outputs[0], step.ctx.mesh.shape) \
        if loss_summed_once(step.ctx) else ()  # else the program replicates each micro-batch's
    root = summed_count_root(step.graph.nodes, step.ctx)
    counted = root is not None and root.call is not None and is_partial_mean_loss(root.call, step.chosen[root.name])
    return StepLoss(kind=kind, micro_batches=micro_batches, dtype=None if compute_dtype is None else torch.float32,
                    dims=dims, mesh=mesh, counted=counted)
