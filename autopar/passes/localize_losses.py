"""localize_losses: a batch-split 'mean' loss becomes local sum / global count.

Each rank's value is then a Partial of the global mean. The count is a constant when
shapes fix it, counted on the whole targets input when every rank received it, and
else summed over the split mesh dims, one small all-reduce per dim
(``self.partial_mean_loss(op, count_dims, count, *args)``; ``count`` is the constant,
the whole targets, or None). The loss a pipelined step returns counts its own targets and is
not divided (``per_step``): the step sums losses and counts once (``problem.loss_collectives``).

With micro-batches, a replicated 'mean' loss whose count depends on the data (cross
entropy on class ids) also becomes ``partial_mean_loss`` (no dims: it counts its whole
targets): the same value, and the runtime reads the count it divided by to weigh the
micro-batch (``autopar.runtime.microbatch``).
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.passes.context import PassContext, plan_name, strategy_of
from autopar.rules.loss import counted_mean, is_partial_mean_loss, static_count
from autopar.rules.strategy import positional_args
from autopar.problem.loss_collectives import INPUT, STATIC, STEP, count_source


def localize_losses(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    inputs = {plan_name(n) or n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in list(gm.graph.nodes):
        strategy = strategy_of(node)
        plan_node = pc.graph.nodes.get(plan_name(node) or "")
        if strategy is None or plan_node is None or plan_node.call is None:
            continue
        dims: tuple[int, ...] = ()
        count: object = None
        per_step = False
        if not is_partial_mean_loss(plan_node.call, strategy):
            call = plan_node.call
            if pc.ctx.micro_batches == 1 or not counted_mean(call.target, call.args, call.kwargs):
                continue
        elif (source := count_source(plan_node, pc.ctx)) == STATIC:
            x, targets = plan_node.call.args[0], plan_node.call.args[1]
            count = static_count(node.target, tuple(x.shape), not targets.dtype.is_floating_point)
        elif source == INPUT:
            count = inputs[plan_node.targets_input]
        elif source == STEP:
            per_step = True
        else:
            dims = tuple(d for d, p in enumerate(strategy.outputs[0]) if p.is_partial())
        with gm.graph.inserting_before(node):
            local = gm.graph.call_module("partial_mean_loss", (str(node.target), dims, count,
                                                               *positional_args(node.target, node.args, node.kwargs)),
                                         {"per_step": True} if per_step else {})
        local.meta.update(node.meta)
        node.replace_all_uses_with(local)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
