"""Tied weights of a pipeline: one parameter read by stages on several pp ranks (an embedding
table the output head reuses: GPT-2's ``lm_head.weight`` is ``wte.weight``).

As Megatron-LM runs them (its embedding group): every pp rank whose stages read the weight
holds a copy of it, and after its pipeline has drained and its gradient buckets are reduced,
each copy's gradient is summed with the others' by one all-reduce among those ranks, one group
per position on the stage mesh (the ranks at one place on the other axes hold the same shard
of it). The copies start equal and get the same gradient, hence the same update: they stay
tied. Stages on one rank share one copy (its gradient accumulates there).

The plan lists each such weight (``PipelinePlan.tied``) and prices it as it runs: its state on
every rank holding it (``parameter_stages``), and its all-reduce after those ranks'
buckets, which starts when the last of them is ready (``shared_ends``), before the loss is
broadcast and the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cost.model import CostContext
from autopar.mesh import Mesh
from autopar.rules.strategy import Strategy, local_numel
from autopar.problem.nodes import PARAM, PlanGraph


@dataclass(frozen=True, kw_only=True)
class TiedWeight:
    """A parameter held by several pp ranks, its gradient all-reduced between them each step."""

    parameter: str
    """Its FQN (the name the model's ``named_parameters()`` gives it)."""
    node: str
    """Its node in the captured graph."""
    stages: list[int]
    """The stages holding its copies: on each rank, the first of that rank's stages reading it."""
    ranks: list[int]
    """Their coordinates on the pipeline axis, ascending."""
    bytes: int
    """Bytes per device of the all-reduce: the local shard of its gradient, in fp32 at least."""
    time_s: float
    """Predicted seconds of that all-reduce, once per step."""


def all_reduce_among(nbytes: float, ranks: int, mesh_dim: int, mesh: Mesh) -> float:
    """A ring all-reduce of ``nbytes`` among ``ranks`` ranks of mesh dim ``mesh_dim``, over its
    link (``cost.collectives``' formula for the whole dim, at a group of ``ranks``):
    2(n-1) latencies and 2(n-1)/n of the bytes, after the call's fixed cost."""
    if ranks <= 1:
        return 0.0
    link = mesh.link(mesh_dim)
    steps = 2 * (ranks - 1)
    return mesh.hardware.collective_overhead + steps * link.latency + steps / ranks * nbytes / link.bandwidth


def parameter_stages(graph: PlanGraph, stage_of: dict[str, int], rank_of: list[int]) -> dict[str, tuple[int, ...]]:
    """Parameter node -> the stages holding it, in graph order of the parameters: on each pp rank
    whose stages read it, the first of those stages (a weight tied across stages, such as GPT-2's
    embedding and output head, is held once per rank)."""
    readers: dict[str, set[int]] = {}
    for name, s in stage_of.items():
        for src, _ in graph.nodes[name].args:
            if graph.nodes[src].kind == PARAM:
                readers.setdefault(src, set()).add(s)
    out: dict[str, tuple[int, ...]] = {}
    for name in graph.order:
        if name in readers:
            first = {rank_of[s]: s for s in sorted(readers[name], reverse=True)}
            out[name] = tuple(sorted(first.values()))
    return out


def tied_parameters(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext,
                    params: dict[str, tuple[int, ...]], rank_of: list[int], mesh_dim: int, mesh: Mesh
                    ) -> list[TiedWeight]:
    """The parameters with a gradient held by several pp ranks (``params``: ``parameter_stages``),
    with their all-reduces' bytes: the local gradient, reduced in fp32 as the buckets are."""
    held = {n: s for n, s in params.items() if len(s) > 1 and graph.nodes[n].needs_grad and not graph.nodes[n].frozen}
    nbytes = {}
    for name in held:
        meta = graph.nodes[name].outputs[0]
        assert meta is not None
        nbytes[name] = local_numel(meta, chosen[name].outputs[0], ctx.mesh.shape) * ctx.precision.reduce_bytes_per_param
    return tied_weights(held, rank_of, {n: graph.nodes[n].fqn or n for n in held}, nbytes, mesh_dim, mesh)


def tied_weights(holders: dict[str, tuple[int, ...]], rank_of: Sequence[int], fqn: dict[str, str],
                 nbytes: dict[str, int], mesh_dim: int, mesh: Mesh) -> list[TiedWeight]:
    """The weights among ``holders`` (parameter node -> the stages holding it, one per rank) held
    by more than one rank, in the order given (the graph's: the order the runtime reduces them);
    ``nbytes``: each one's all-reduce bytes per device."""
    out = []
    for name, stages in holders.items():
        if len(stages) < 2:
            continue
        ranks = [rank_of[s] for s in stages]
        out.append(TiedWeight(parameter=fqn[name], node=name, stages=list(stages), ranks=ranks, bytes=nbytes[name],
                              time_s=all_reduce_among(nbytes[name], len(ranks), mesh_dim, mesh)))
    return out


def tied_seconds(tied: Sequence[TiedWeight], p: int) -> list[float]:
    """Each pp rank's seconds of its tied weights' all-reduces (waits aside)."""
    out = [0.0] * p
    for weight in tied:
        for r in weight.ranks:
            out[r] += weight.time_s
    return out


def shared_ends(tied: Sequence[TiedWeight], synced_s: Sequence[float]) -> list[tuple[float, float]]:
    """Per pp rank, (start, end) of its tied weights' all-reduces, run one after another in order
    after its buckets end (``synced_s``): each starts once every rank in its group is ready (start =
    end = ``synced_s`` for a rank holding none)."""
    ready = list(synced_s)
    first: list[float | None] = [None] * len(ready)
    for weight in tied:
        start = max(ready[r] for r in weight.ranks)
        for r in weight.ranks:
            first[r] = start if first[r] is None else first[r]
            ready[r] = start + weight.time_s
    return [(s if f is None else f, e) for s, f, e in zip(synced_s, first, ready)]
