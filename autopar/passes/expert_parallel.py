"""expert_parallel: a dropless expert layer whose experts the plan splits runs as
``self.moe_dispatch_combine(x, ids, weights, gate_up, down, grouped_mm, mesh_dim)``.

Capture collapsed Hugging Face's sorted expert region into one ``autopar::moe_experts`` call
(``capture.moe_region``), so the planner could choose its placement (``rules.routing``). Where
the chosen strategy keeps every expert on the rank (tokens split or replicated, ``F`` split
inside the experts) the op runs as captured, on the rank's tokens and weights. Where it splits
the experts (``Shard(0)`` on a mesh dim: expert parallelism) the rank holds only its experts,
so its pairs must travel to their experts' ranks and back: the call becomes the runtime's
(``autopar.runtime.moe``), which does that with variable-split all-to-alls. Runs after
insert_reshards, so the arguments it moves are the resharded ones.
"""

from __future__ import annotations

import torch.fx

from autopar.capture.moe import MOE_EXPERTS
from autopar.capture.schema import positional_args
from autopar.cost.moe import expert_dims
from autopar.errors import InputError
from autopar.passes.context import PassContext, strategy_of


def expert_parallel(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    for node in list(graph.nodes):
        strategy = strategy_of(node)
        if node.op != "call_function" or node.target is not MOE_EXPERTS or strategy is None:
            continue
        dims = expert_dims(strategy, pc.mesh_shape)
        if not dims:
            continue
        if len(dims) > 1:  # the rule marks expert parallelism exclusive: a plan never asks for it
            names = [pc.ctx.mesh.names[d] for d in dims]
            raise InputError(f"{node.name}: experts split on mesh axes {names}; expert parallelism runs on one axis")
        with graph.inserting_before(node):
            call = graph.call_module("moe_dispatch_combine",
                                     (*positional_args(node.target, node.args, node.kwargs), dims[0]))
        call.meta.update(node.meta)  # its block, plan name and value: checkpointing and stages follow it
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    gm.recompile()
    return gm
