"""Things a plan did that its user did not ask for and should know: batch splits it could not
make, how attention runs where its sequence is split (context parallelism), and the expert load
imbalance an expert-parallel plan is priced at."""

from __future__ import annotations

from collections import Counter

from autopar.cost.moe import expert_dims, is_moe
from autopar.mesh import Mesh
from autopar.rules.attention import ATTENTION_OPS
from autopar.rules.strategy import Strategy, placement_str, shard_dim
from autopar.problem.context_kind import sequence_kind
from autopar.problem.nodes import INPUT, PlanGraph

ALL_GATHER_KV = "all-gather K/V (query rows split, keys and values gathered)"
RING = "ring attention (queries, keys and values split; K/V blocks passed around the ring, overlapped with compute)"
ULYSSES = "Ulysses (heads split on an axis splitting the sequence: all-to-alls around attention)"
ZIGZAG = ("; the sequence cut zig-zag (2n chunks, rank i holding chunks i and 2n-1-i: causal rows balanced, "
          "tokens, targets and position tables cut alike, outputs gathered back in order)")


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


def context_notes(graph: PlanGraph, chosen: dict[str, Strategy], mesh: Mesh) -> list[str]:
    """One note per mesh axis where attention calls run context parallel, and which kind:
    queries split on their sequence dim (keys and values all-gathered, ``rules.attention``), or
    queries, keys and values all split on it (ring attention, ``runtime.ring``), or
    split on heads on an axis the step's inputs are split on by sequence (dim 1), so that the
    activations reach attention by all-to-alls from the sequence split into heads (Ulysses). A
    heads split on an axis that does not split the sequence is Megatron TP, not noted. On a
    zig-zag axis (``Mesh.zigzag``) the note says so."""
    sequence_axes = {d for name in graph.order if graph.nodes[name].kind == INPUT
                     for d, p in enumerate(chosen[name].outputs[0] or ()) if shard_dim(p) == 1}
    kinds: dict[str, Counter[str]] = {}
    calls = 0
    for name in graph.order:
        node = graph.nodes[name]
        if node.call is None or node.call.target not in ATTENTION_OPS or chosen[name].inputs[0] is None:
            continue
        calls += 1
        q, wanted = node.call.tensor_inputs[0], chosen[name].inputs[0]
        for d, (axis, size) in enumerate(zip(mesh.names, mesh.shape)):
            split = shard_dim(wanted[d])
            if size > 1 and split == q.ndim - 2:
                ring = sequence_kind(chosen[name], q.ndim, node.call.tensor_inputs[1].ndim, d) == "ring"
                kinds.setdefault(axis, Counter())[RING if ring else ALL_GATHER_KV] += 1
            elif size > 1 and split == q.ndim - 3 and q.ndim >= 4 and d in sequence_axes:
                kinds.setdefault(axis, Counter())[ULYSSES] += 1
    return [f"context parallel attention on {axis}: " + "; ".join(f"{kind} in {n} of {calls} calls"
                                                                  for kind, n in sorted(counts.items()))
            + (ZIGZAG if axis in mesh.zigzag else "") for axis, counts in kinds.items()]


def expert_notes(graph: PlanGraph, chosen: dict[str, Strategy], mesh: Mesh) -> list[str]:
    """Where expert layers run expert parallel, the load imbalance they are priced at (the busiest
    rank's (token, expert) pairs over the mean, ``HardwareProfile.moe_imbalance``): it scales their
    all-to-all bytes and expert FLOPs (``cost.moe``), and real routing may be better or worse."""
    axes: Counter[str] = Counter()
    for name in graph.order:
        node = graph.nodes[name]
        if node.call is not None and is_moe(node.call.target):
            axes.update(mesh.names[d] for d in expert_dims(chosen[name], mesh.shape))
    if not axes:
        return []
    where = ", ".join(f"{n} layers on {axis}" for axis, n in sorted(axes.items()))
    return [f"expert parallel ({where}): priced at an expert load imbalance of {mesh.hardware.moe_imbalance:g} "
            "(busiest rank's pairs / mean; set by HardwareProfile.moe_imbalance, CLI --moe-imbalance)"]
