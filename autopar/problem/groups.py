"""The grouped collectives a chosen plan runs (``cost.groups``), per parameter: what the runtime's
passes write (``passes.prefetch_gathers``), from the same prices the plan lists (``result.build``)."""

from __future__ import annotations

from autopar.cost.groups import GroupKey, edge_groups
from autopar.cost.model import CostContext
from autopar.problem.block_paths import block_of
from autopar.problem.graph import price_edge
from autopar.problem.nodes import OP, PlanGraph
from autopar.rules.strategy import Strategy


def param_groups(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext) -> dict[str, list[GroupKey]]:
    """Parameter node -> the groups its collectives join (forward gather, gradient reduce-scatter,
    gather again), for every parameter read once whose edge has grouped calls."""
    out: dict[str, list[GroupKey]] = {}
    groups = group_names(graph, ctx.pipelined)
    for name in graph.order:
        node = graph.nodes[name]
        for arg, (src, out_index) in enumerate(node.args):
            if src not in graph.read_once:
                continue
            edge = price_edge(graph, src, out_index, name, arg, chosen[src], chosen[name], ctx)
            meta = graph.nodes[src].outputs[out_index]
            assert meta is not None
            keys = [k for k, _ in edge_groups(edge.forward, edge.backward, edge.recompute, groups[name],
                                              node.recompute, str(meta.dtype))]
            if keys:
                out[src] = keys
    return out


def group_names(graph: PlanGraph, pipelined: bool) -> dict[str, str]:
    """Node -> the group a parameter it reads joins (``cost.groups``): its repeated block instance;
    outside every block, the root "" (as FSDP2's root module), or for a pipeline's stage plan the
    stretch between blocks it lies in ("@k": after k block instances), which no stage cut splits."""
    out: dict[str, str] = {}
    seen: set[str] = set()  # the blocks whose ops came before (a parameter's own module path says nothing)
    for name in graph.order:
        node = graph.nodes[name]
        block = block_of(node.module)
        if block is not None and node.kind == OP:
            seen.add(block)
        out[name] = block if block is not None else f"@{len(seen)}" if pipelined else ""
    return out
