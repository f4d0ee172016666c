"""Cost of a higher-order op (a ``torch.no_grad()`` or autocast block): the ops of its
subgraph, each priced as ``op_cost`` prices it, replicated (the block runs whole on every
rank). A no_grad block runs no backward and saves nothing for it."""

from __future__ import annotations

from typing import Any

import torch.fx

from autopar.capture.graph import TensorMeta
from autopar.capture.subgraphs import is_higher_order, runs_without_grad, subgraph_call
from autopar.cost.model import CostContext, NodeCost, op_cost
from autopar.rules.strategy import OpCall, expand


def block_cost(node: torch.fx.Node, ctx: CostContext, *, backward: bool) -> NodeCost | None:
    """The summed cost of the ops a block runs (with their backward where ``backward``: a
    gradient reaches the block and it does not run under no_grad), or None for a node that
    is no block autopar can look into (priced as an op of its own)."""
    call = subgraph_call(node)
    if call is None:
        return None
    backward = backward and not runs_without_grad(node)
    time = memory = forward = 0.0
    for op in call[0].graph.nodes:
        if op.op != "call_function":
            continue
        cost = block_cost(op, ctx, backward=backward) if is_higher_order(op) else None
        if cost is None:
            op_call = _op_call(op)
            replicated = expand(op_call, [], ctx.mesh.shape)[0]
            cost = op_cost(op_call, replicated, ctx, backward=backward, saved=backward)
        time += cost.time
        memory += cost.memory
        forward += cost.forward
    return NodeCost(time, memory, forward)


def _op_call(node: torch.fx.Node) -> OpCall:
    def to_meta(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return TensorMeta.of(a.meta.get("val")) or a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(to_meta(x) for x in a)
        return a

    val = node.meta.get("val")
    outputs = tuple(TensorMeta.of(v) for v in val) if isinstance(val, (list, tuple)) else (TensorMeta.of(val),)
    return OpCall(node.target, tuple(to_meta(a) for a in node.args), {k: to_meta(v) for k, v in node.kwargs.items()},
                  outputs)


__all__ = ["block_cost"]
