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
    """Reduce-scatter buckets (ZeRO-1 parameters synchronized on their ZeRO-1 dim), then the
    all-gather buckets (every ZeRO-1 parameter), each stream cut as ``shard_buckets`` does."""
    dims = zero1_dims(graph, chosen, ctx)
    chunks = []
    for name, d in dims.items():
        meta = graph.nodes[name].outputs[0]
        assert meta is not None
        chunk = chunk_elements(local_numel(meta, chosen[name].outputs[0], ctx.mesh.shape), ctx.mesh.shape[d])
        chunks.append((name, chunk, d, ctx.mesh.shape[d]))
    precision = ctx.precision
    out = []
    for kind, params, itemsize in ((REDUCE_SCATTER, [c for c in chunks if c[2] in sync_dims.get(c[0], ())],
                                    precision.grad_bytes_per_param),
                                   (ALL_GATHER, chunks, precision.master_bytes_per_param)):
        for d in sorted({c[2] for c in params}):
            cap = shard_bucket_cap(ctx.bucket_bytes, itemsize, ctx.mesh.shape[d])
            out += shard_buckets(kind, [c for c in params if c[2] == d], itemsize, cap)
    return out
