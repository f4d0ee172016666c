"""Things a plan did that its user did not ask for and should know: batch splits it could not make."""

from __future__ import annotations

from autopar.mesh import Mesh
from autopar.rules.strategy import Strategy, placement_str, shard_dim
from autopar.solver.nodes import INPUT, PlanGraph


def unsplit_batch_notes(graph: PlanGraph, chosen: dict[str, Strategy], mesh: Mesh,
                        labels: dict[str, str]) -> list[str]:
    """One note per (input, mesh axis) where the input's batch dim (dim 0) is not split because
    its size does not divide: what the input is, which axis, why, and what the plan did instead.

    ``labels`` names inputs as the user passed them ("input 0", "keyword input 'labels'").
    An axis the batch is not split on although it divides is the solver's choice, not a note.
    """
    notes = []
    for name in graph.order:
        node = graph.nodes[name]
        meta = node.outputs[0] if node.outputs else None
        if node.kind != INPUT or meta is None or meta.ndim == 0:
            continue
        placements = chosen[name].outputs[0]
        assert placements is not None
        batch = meta.shape[0]
        ways = 1  # how many ways the batch dim is split already
        for placement, size in zip(placements, mesh.shape):
            if shard_dim(placement) == 0:
                ways *= size
        for axis_name, placement, size in zip(mesh.names, placements, mesh.shape):
            if size == 1 or shard_dim(placement) == 0 or batch % (ways * size) == 0:
                continue
            why = (f"{batch} does not divide by {size}" if ways == 1 else
                   f"{batch} does not divide by {ways * size}: it is split {ways} ways on other axes")
            notes.append(f"{labels.get(name, name)} (shape {list(meta.shape)}): batch dim 0 cannot be split on "
                         f"{axis_name}={size} ({why}); placed {placement_str(placements)} over "
                         f"{' x '.join(mesh.names)}")
    return notes
