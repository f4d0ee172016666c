"""Which consumers share one reshard: every reader of one tensor (and version) that needs it at
the same placement and sends back the same gradient placement uses one ``reshard`` call, listed
at the first of them (``result.build``'s ledger; the ILP's ``solver.sharing`` counts the same)."""

from __future__ import annotations

from autopar.cost.model import CostContext, grad_placements
from autopar.problem.graph import edge_flags
from autopar.problem.nodes import PlanGraph
from autopar.rules.strategy import Strategy


def reshard_key(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, name: str, arg: int) -> tuple:
    """What the reshard of input ``arg`` of ``name`` serves: a tensor (and version) needed at one
    placement, sending back one gradient placement; consumers with the same key share it."""
    node = graph.nodes[name]
    src, out_index = node.args[arg]
    required = chosen[name].inputs[arg]
    grad_in = (grad_placements(chosen[src].outputs[out_index], required, chosen[name])[0]
               if ctx.train and graph.sends_gradient(src, name) else None)
    return src, out_index, node.version(arg), required, grad_in  # a write in place between two reads: nothing shared


def readers_by_reshard(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, tensor: str
                       ) -> dict[str, list[str]]:
    """Of ``tensor``'s readers, per reshard: its first reader (where the ledger lists it) -> every
    reader sharing it, in graph order."""
    keys: dict[tuple, list[str]] = {}
    for name in graph.order:
        for arg, (src, _) in enumerate(graph.nodes[name].args):
            if src == tensor:
                readers = keys.setdefault(reshard_key(graph, chosen, ctx, name, arg), [])
                if name not in readers:
                    readers.append(name)
    return {readers[0]: readers for readers in keys.values()}


def gathers_again(graph: PlanGraph, tensor: str, reader: str) -> bool:
    """Whether ``reader`` has parameter ``tensor`` gathered again in backward (ZeRO-3): it saves it for a
    backward that sends a gradient, and frees its gathered copy after forward (``edge_flags``)."""
    flags = [edge_flags(graph, tensor, reader, k) for k, (src, _) in enumerate(graph.nodes[reader].args)
             if src == tensor]
    return any(f["regathered"] and f["needs_grad"] and f["saves_input"] and not f["recomputed"] for f in flags)
