"""What crosses a pipeline cut: the values a later stage reads of an earlier one's, sent across
each cut between them once (``crossing_bytes``), placed as their producer placed them (a reshard
runs in the stage reading it). User inputs never cross: every rank is handed the step's whole
inputs (``pm.step(*inputs, *targets)`` on every rank), so each stage reads its own micro-batch of
those it needs (the targets the last stage's loss reads). The runtime cuts the same way
(``passes.split_stages``).
"""

from __future__ import annotations

from autopar.cost.model import CostContext
from autopar.problem.nodes import OP, PlanGraph
from autopar.rules.strategy import Strategy, local_numel


def crossing_bytes(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, stage_of: dict[str, int],
                   count: int) -> list[float]:
    """Per cut (after stage s), bytes per device of the values it carries forward in one
    micro-batch: outputs of ops read by a later stage, each once however many stages it passes;
    user inputs never cross (each stage reads its own micro-batch of them)."""
    crossing: dict[tuple[str, int], tuple[int, int]] = {}  # value -> (its stage, last reader)
    for name, s in stage_of.items():
        for src, idx in graph.nodes[name].args:
            if graph.nodes[src].kind != OP:
                continue
            born = stage_of[src]
            if born < s:
                first, last = crossing.get((src, idx), (born, s))
                crossing[(src, idx)] = (first, max(last, s))
    out = [0.0] * count
    for (src, idx), (first, last) in crossing.items():
        meta = graph.nodes[src].outputs[idx]
        if meta is None:
            continue
        nbytes = ctx.precision.tensor_bytes(meta, local_numel(meta, chosen[src].outputs[idx], ctx.mesh.shape))
        for cut in range(first, last):
            out[cut] += nbytes
    return out
