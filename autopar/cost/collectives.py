"""Collective costs (alpha-beta per mesh axis) and the collectives a reshard needs.

Ring algorithms (REFERENCE.md): all-reduce 2(n-1)a + 2(n-1)/n M/b; all-gather and
reduce-scatter (n-1)a + (n-1)/n M/b with M the gathered size; all-to-all
(n-1)a + (n-1)/n M/b with M the bytes a device holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.capture.graph import TensorMeta
from autopar.cost.precision import Precision
from autopar.mesh import Mesh

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"


@dataclass(frozen=True)
class CollectiveCall:
    """One collective on one mesh dimension; ``nbytes`` is the M of the formulas."""

    kind: str
    mesh_dim: int
    nbytes: int
    bucketed: bool = False
    """Gradient synchronization: fused into large buckets (as DDP/FSDP do), so per-tensor
    latency is amortized away and only bandwidth counts."""


def collective_time(call: CollectiveCall, mesh: Mesh) -> float:
    n = mesh.shape[call.mesh_dim]
    if n == 1:
        return 0.0
    link = mesh.link(call.mesh_dim)
    steps = 0 if call.bucketed else 2 * (n - 1) if call.kind == ALL_REDUCE else n - 1
    volume = (2 if call.kind == ALL_REDUCE else 1) * (n - 1) / n * call.nbytes
    return steps * link.latency + volume / link.bandwidth


def bytes_moved(call: CollectiveCall, mesh: Mesh) -> float:
    """Bytes one device sends over its link for this collective (for the plan's comm_bytes)."""
    n = mesh.shape[call.mesh_dim]
    factor = 2 if call.kind == ALL_REDUCE else 1
    return factor * (n - 1) / n * call.nbytes


def _local_bytes(meta: TensorMeta, placements: list[Placement], mesh: Mesh, precision: Precision) -> int:
    ways = math.prod(n for p, n in zip(placements, mesh.shape) if isinstance(p, Shard))
    return precision.tensor_bytes(meta) // ways


def reshard(meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh: Mesh,
            precision: Precision) -> list[CollectiveCall]:
    """Collectives turning ``src`` placements into ``dst``, one mesh dim at a time.

    Replicate -> Shard or Partial is local (slice, or keep on one rank); Shard -> Partial
    gathers first. Sizes are the local sizes at that step.
    """
    current = list(src)
    calls: list[CollectiveCall] = []
    for i, (a, b) in enumerate(zip(src, dst)):
        if a == b:
            continue
        if isinstance(a, Partial) and isinstance(b, Replicate):
            calls.append(CollectiveCall(ALL_REDUCE, i, _local_bytes(meta, current, mesh, precision)))
        elif isinstance(a, Partial) and isinstance(b, Shard):
            calls.append(CollectiveCall(REDUCE_SCATTER, i, _local_bytes(meta, current, mesh, precision)))
        elif isinstance(a, Shard) and isinstance(b, Shard):
            calls.append(CollectiveCall(ALL_TO_ALL, i, _local_bytes(meta, current, mesh, precision)))
        elif isinstance(a, Shard):  # to Replicate, or to Partial through Replicate
            gathered = current[:i] + [Replicate()] + current[i + 1:]
            calls.append(CollectiveCall(ALL_GATHER, i, _local_bytes(meta, gathered, mesh, precision)))
        current[i] = b
    return calls


def grad_placement_at_consumer(required: Placement, consumer_active: bool) -> Placement:
    """Placement of the gradient a consumer sends back for an input it took as ``required``.

    A sharded input gets a sharded gradient; a Partial input a replicated one (d sum/dx_i = 1);
    a replicated input of an op split along this mesh dim gets a Partial gradient (each rank
    saw only its part of the uses).
    """
    if isinstance(required, Shard):
        return required
    if isinstance(required, Partial):
        return Replicate()
    return Partial() if consumer_active else Replicate()


def grad_placement_at_producer(produced: Placement) -> Placement:
    """Placement the producer's backward wants its output gradient in."""
    return produced if isinstance(produced, Shard) else Replicate()
