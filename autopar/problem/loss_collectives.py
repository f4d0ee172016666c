"""The collectives a step's loss runs by itself: a batch-split 'mean' loss's count summed over the
ranks splitting the batch, and the loss reduced so that every rank returns all of it.

A pipelined training step sums its micro-batches' losses and reduces that sum once
(``cost.summed_loss``). Where the loss it returns is a cross entropy counting its targets whose
count only the ranks together know, that count is summed once per step too, beside the loss:
each micro-batch's program returns its local sum and counts its local targets, and the step
divides the summed losses and the gradients by the summed counts (``runtime.pipeline_loss``).
"""

from __future__ import annotations

from autopar.cost.collectives import ALL_REDUCE, CollectiveCall, reshard
from autopar.cost.model import CostContext
from autopar.cost.summed_loss import SUMMED_LOSS_BYTES, loss_summed_once, summed_loss_dims
from autopar.problem.nodes import PlanNode
from autopar.rules.loss import LOSS_VIEWS, counted_mean, is_partial_mean_loss, static_count
from autopar.rules.strategy import R, Strategy

STATIC, INPUT, REDUCE, STEP = "static", "input", "reduce", "step"
"""Where a batch-split 'mean' loss gets its count (``count_source``)."""


def mark_loss_root(nodes: dict[str, PlanNode], loss: str | None) -> None:
    """Mark the op whose value the step returns as its loss, seen through views and casts (as
    ``runtime.microbatch.loss_root`` finds it on the captured graph)."""
    name = loss
    while name is not None and _packet(nodes[name].op) in LOSS_VIEWS and nodes[name].args:
        name = nodes[name].args[0][0]
    if name is not None:
        nodes[name].loss_root = True


def _packet(op: str) -> str:
    """'aten.view.default' -> 'view'."""
    parts = op.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "aten" else op


def count_source(node: PlanNode, ctx: CostContext) -> str:
    """Where a batch-split 'mean' loss gets its global count: ``STATIC`` (shapes), ``INPUT`` (the
    whole targets input every rank received), ``STEP`` (the step's loss: its local count summed once
    per pipelined step, with the loss) or ``REDUCE`` (local counts summed each micro-batch)."""
    assert node.call is not None
    x, targets = node.call.args[0], node.call.args[1]
    if static_count(node.call.target, tuple(x.shape), not targets.dtype.is_floating_point) is not None:
        return STATIC
    if ctx.inputs_whole and node.targets_input is not None:
        return INPUT
    return STEP if node.loss_root and loss_summed_once(ctx) else REDUCE


def summed_count_root(nodes: dict[str, PlanNode], ctx: CostContext) -> PlanNode | None:
    """The step's loss op where it is a cross entropy counting its targets whose count a pipelined
    step sums once (``STEP``: where the op is split over the batch); else None."""
    root = next((n for n in nodes.values() if n.loss_root), None)
    if root is None or root.call is None or not counted_mean(root.call.target, root.call.args, root.call.kwargs):
        return None
    return root if count_source(root, ctx) == STEP else None


def loss_count_reductions(node: PlanNode, strategy: Strategy, ctx: CostContext) -> list[CollectiveCall]:
    """A batch-split 'mean' loss whose count needs data it does not have sums it over the
    split mesh dims, each micro-batch (4-byte all-reduces)."""
    if node.call is None or not is_partial_mean_loss(node.call, strategy) or count_source(node, ctx) != REDUCE:
        return []
    out = strategy.outputs[0]
    assert out is not None
    return [CollectiveCall(ALL_REDUCE, d, 4) for d, p in enumerate(out) if p.is_partial() and ctx.mesh.shape[d] > 1]


def loss_replication(node: PlanNode, strategy: Strategy, ctx: CostContext, counted: bool = False
                     ) -> list[CollectiveCall]:
    """Collectives that give every rank the whole loss: each micro-batch's as placed, or where the
    step sums its micro-batches' losses first (``cost.summed_loss``) that fp32 sum's all-reduce on
    each dim the loss is Partial on, once, with the summed count beside it where ``counted``
    (``summed_count_root``)."""
    out, meta = strategy.outputs[0], node.outputs[0]
    assert out is not None and meta is not None
    if loss_summed_once(ctx):
        nbytes = SUMMED_LOSS_BYTES * (2 if counted else 1)
        return [CollectiveCall(ALL_REDUCE, d, nbytes) for d in summed_loss_dims(out, ctx.mesh.shape)]
    return reshard(meta, out, (R,) * ctx.mesh.ndim, ctx.mesh, ctx.precision)
