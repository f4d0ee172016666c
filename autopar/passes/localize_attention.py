"""localize_attention: a causal attention whose queries are split on the sequence runs on
its rows' global positions, through ``self.context_attention``.

``scaled_dot_product_attention(q, k, v, is_causal=True)`` with q placed ``S(2)`` on a
context axis (``rules.attention``: keys and values whole) becomes
``self.context_attention('aten.scaled_dot_product_attention.default', 'S(2)', q, k, v,
is_causal=True)``: the runtime (``autopar.runtime.attention``) knows the rank's coordinate
and which axes are zig-zag, so it knows which query positions the rank holds, and runs the call with the causal mask
of those positions instead of ``is_causal`` (which would align the rank's first row with
the first key). Every other attention call is left as captured: split on batch or heads,
or non-causal, or split on mesh dims of size 1 (a stage mesh of one device), a rank's rows need
nothing of their positions. Runs after insert_reshards,
so the arguments it moves are the resharded ones (keys and values gathered).

An attention call planned as ring attention (its keys split on the sequence too,
``rules.attention.ring_dim``), causal or not, becomes ``self.ring_attention(op, q_placements,
kv_placements, ring_dim, q, k, v, ...)`` (``autopar.runtime.ring``): its keys and values
travel around the ring instead of being gathered.
"""

from __future__ import annotations

import torch.fx

from autopar.passes.context import PassContext, plan_name, strategy_of
from autopar.rules.attention import ring_dim, splits_causal_rows
from autopar.rules.strategy import Placements, placement_str, shard_dim


def localize_attention(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        strategy, name = strategy_of(node), plan_name(node)
        if node.op != "call_function" or strategy is None or not strategy.inputs or name not in pc.graph.nodes:
            continue
        call = pc.graph.nodes[name].call  # the captured call's tensors (q's rank), before any reshard
        if call is None or len(call.tensor_inputs) < 3:
            continue
        ring = ring_dim(node.target, strategy.inputs[1], call.tensor_inputs[1].ndim)
        if ring is not None:
            module, extra = "ring_attention", (placement_str(strategy.inputs[1]), ring)
        elif splits_causal_rows(node.target, node.args, node.kwargs, strategy.inputs[0], call.tensor_inputs[0].ndim) \
                and _ways(strategy.inputs[0], call.tensor_inputs[0].ndim - 2, pc.mesh_shape) > 1:
            module, extra = "context_attention", ()
        else:
            continue
        with graph.inserting_before(node):
            rows = graph.call_module(module, (str(node.target), placement_str(strategy.inputs[0]), *extra,
                                              *node.args), dict(node.kwargs))
        rows.meta.update(node.meta)  # its block, plan name and value: checkpointing and stages follow it
        node.replace_all_uses_with(rows)
        graph.erase_node(node)
    gm.recompile()
    return gm


def _ways(placements: Placements, dim: int, mesh_shape: tuple[int, ...]) -> int:
    """Into how many pieces ``placements`` split ``dim``: a split on mesh dims of size 1 leaves
    every rank all rows, which run as captured."""
    ways = 1
    for p, n in zip(placements, mesh_shape):
        if shard_dim(p) == dim:
            ways *= n
    return ways
