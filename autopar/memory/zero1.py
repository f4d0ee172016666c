"""A plan's ZeRO-1 parameters and their buckets (``autopar.cost.zero1``): what the optimizer
step reduce-scatters and all-gathers, priced by the same functions as the ILP's terms."""

from __future__ import annotations

from autopar.cost.buckets import ShardBucket, shard_buckets
from autopar.cost.model import CostContext
from autopar.cost.zero1 import ALL_GATHER, REDUCE_SCATTER, chunk_elements, shard_bucket_cap
from autopar.rules.strategy import Strategy, local_numel
from autopar.problem.nodes import PARAM, PlanGraph


def zero1_dims(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext) -> dict[str, int]:
    """Parameter node -> the mesh dim its optimizer state is sharded on, for every trainable
    parameter whose chosen strategy is a ZeRO-1 twin (``Strategy.zero1``)."""
    out: dict[str, int] = {}
    if not ctx.train:
        return out
    for name in graph.order:
        node = graph.nodes[name]
        d = chosen[name].zero1
        if node.kind == PARAM and node.needs_grad and d is not None:
            out[name] = d
    return out


def plan_shard_buckets(graph: PlanGraph, chosen: dict[str, Strategy], sync_dims: dict[str, frozenset[int]],
                       ctx: CostContext) -> list[ShardBucket]:
    """Reduce-scatter buckets, then all-gather buckets, per ZeRO-1 dim d: two streams in
    backward order, the parameters synchronized on d (reduce-scattered and all-gathered) and
    the others (all-gathered only), each cut as ``shard_buckets`` does."""
    chunks: dict[int, list[tuple[str, int]]] = {}
    for name, d in zero1_dims(graph, chosen, ctx).items():
        meta = graph.nodes[name].outputs[0]
        assert meta is not None
        numel = local_numel(meta, chosen[name].outputs[0], ctx.mesh.shape)
        chunks.setdefault(d, []).append((name, chunk_elements(numel, ctx.mesh.shape[d])))
    precision = ctx.precision
    scattered = {d: [c for c in reversed(on_d) if d in sync_dims.get(c[0], ())] for d, on_d in chunks.items()}
    kept = {d: [c for c in reversed(on_d) if d not in sync_dims.get(c[0], ())] for d, on_d in chunks.items()}
    out = []
    for kind, itemsize in ((REDUCE_SCATTER, precision.grad_bytes_per_param),
                           (ALL_GATHER, precision.master_bytes_per_param)):
        for d in sorted(chunks):
            streams = [scattered[d]] if kind == REDUCE_SCATTER else [scattered[d], kept[d]]
            if any(streams):
                ways = ctx.mesh.shape[d]
                out += shard_buckets(kind, d, ways, streams, itemsize, shard_bucket_cap(ctx.bucket_bytes, itemsize, ways))
    return out
