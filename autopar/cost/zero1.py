"""Price ZeRO-1 (optimizer state sharded on a data axis; the runtime is ``autopar.runtime.zero1``).

The mesh dims where ZeRO-1 may run are the scenario's (``CostContext.zero1``); which
parameters run it is a choice per parameter: a placement replicated on one of those dims
is offered twice, as is (DDP) and as its twin sharding the optimizer state on ``zero1_dim``
(the first such dim; ``Strategy.zero1``), and the ILP picks (a pin of stage 1 offers the
twin alone). A ZeRO-1 parameter on dim d keeps its weights and its whole gradient, but
only a 1/n shard of its optimizer state (n = the size of d): its local tensor, flattened
and padded to ``n * c`` elements with ``c = ceil(numel / n)``, is cut into n chunks of c,
and the rank at index i on d owns chunk i. At the optimizer step (after backward, not overlapping it):

- the gradient is reduce-scattered on d (when backward leaves it Partial there, i.e. d
  is one of its sync dims; else every rank already holds it whole and takes its chunk),
  ``M = n * c`` gradient elements, bucketed;
- the optimizer updates the chunk (its state is c elements);
- the updated chunks are all-gathered on d into the whole parameter, ``M = n * c``
  weight elements, bucketed.

RS + AG move the bytes of one all-reduce; the RS replaces the parameter's all-reduce on
d. Buckets pack chunk columns (n elements each, one per rank) in backward order, at most
``cap`` bytes each (``shard_bucket_cap``), a parameter straddling two buckets where it
must, so a stream of M bytes runs exactly ``ceil(M / cap)`` calls: the ILP prices that
count and the runtime runs those buckets.

Mixed precision keeps fp32 master weights as the parameters themselves (the program reads
bf16 casts), so the master is not sharded: Adam's m and v are.
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Replicate

from autopar.rules.redistribute import ALL_GATHER, REDUCE_SCATTER
from autopar.rules.strategy import Placements

__all__ = ["ALL_GATHER", "REDUCE_SCATTER", "chunk_elements", "padded_elements", "shard_bucket_cap", "zero1_dim"]


def zero1_dim(placements: Placements, zero1: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int | None:
    """The mesh dim a trainable parameter stored as ``placements`` may shard its optimizer
    state on (its ZeRO-1 twin's ``Strategy.zero1``): the first ZeRO-1 dim (of ``zero1``, in
    mesh order) where it is replicated; None when it is split (or on one rank) on each of them."""
    for d in sorted(zero1):
        if isinstance(placements[d], Replicate) and mesh_shape[d] > 1:
            return d
    return None


def chunk_elements(numel: int, ways: int) -> int:
    """Elements of each rank's chunk (the last ranks' chunks end in padding)."""
    return math.ceil(numel / ways)


def padded_elements(numel: int, ways: int) -> int:
    """Elements of the padded flat tensor a reduce-scatter or all-gather moves (its M)."""
    return ways * chunk_elements(numel, ways)


def shard_bucket_cap(cap: int, itemsize: int, ways: int) -> int:
    """Bytes of a full bucket of chunk columns: whole columns of ``ways`` elements that fit in ``cap``."""
    columns = cap // itemsize // ways
    if columns < 1:
        raise ValueError(f"bucket size {cap} holds no column of {ways} {itemsize}-byte elements")
    return columns * ways * itemsize
