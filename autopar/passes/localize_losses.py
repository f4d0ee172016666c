"""localize_losses: a batch-split 'mean' loss becomes local sum / global count.

Each rank's value is then a Partial of the global mean; the count is summed over the
split mesh dims (``self.partial_mean_loss``), one small all-reduce per dim.
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.passes.context import PassContext, plan_name, strategy_of
from autopar.rules.loss import is_partial_mean_loss


def _positional(target: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """All schema arguments in order, defaults filled in."""
    out = list(args)
    for arg in target._schema.arguments[len(args):]:
        out.append(kwargs.get(arg.name, arg.default_value))
    return out


def localize_losses(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        strategy = strategy_of(node)
        plan_node = pc.graph.nodes.get(plan_name(node) or "")
        if strategy is None or plan_node is None or plan_node.call is None:
            continue
        if not is_partial_mean_loss(plan_node.call, strategy):
            continue
        dims = tuple(d for d, p in enumerate(strategy.outputs[0]) if p.is_partial())
        with gm.graph.inserting_before(node):
            local = gm.graph.call_module("partial_mean_loss", (str(node.target), dims,
                                                               *_positional(node.target, node.args, node.kwargs)))
        local.meta.update(node.meta)
        node.replace_all_uses_with(local)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
