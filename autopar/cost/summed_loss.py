"""A pipelined training step's loss: reduced once per step, not once per micro-batch.

Each micro-batch's loss stays as placed (Partial on the mesh dims that split the batch) and the
step reduces the sum of the micro-batches' weighted losses once, after its schedule
(``runtime.pipeline``). That is exact: the backward of a Partial -> Replicate reduction is the
identity, so every rank's gradients are those of its own partial losses either way, and only
the reported loss needs the sum. The plan lists and prices that reduction once
(``problem.graph.loss_replication``, ``pipeline.pricing``).
"""

from __future__ import annotations

from torch.distributed.tensor import Placement

from autopar.cost.model import CostContext

SUMMED_LOSS = "summed loss"
"""Consumer, in a plan's collectives, of the all-reduces of a step's summed loss: listed once per
step, run after the micro-batches (a pipeline's: after its schedule, on the last stage's ranks)."""
SUMMED_LOSS_BYTES = 4
"""That sum is one fp32 value (each micro-batch's loss is made fp32 before it is added)."""


def loss_summed_once(ctx: CostContext) -> bool:
    """The step reduces its micro-batches' summed loss once (a pipelined training step)."""
    return ctx.train and ctx.pipelined


def summed_loss_dims(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh dims the summed loss is all-reduced on: those the loss is Partial on."""
    return tuple(d for d, p in enumerate(placements) if p.is_partial() and mesh_shape[d] > 1)
