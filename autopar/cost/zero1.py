"""Price ZeRO-1 (optimizer state sharded on a data axis; the runtime is ``autopar.runtime.zero1``).

The mesh dims where ZeRO-1 may run are the scenario's (``CostContext.zero1``); which
parameters run it is a choice per parameter: a placement replicated on one of those dims
is offered twice, as is (DDP) and as its twin sharding the optimizer state on ``zero1_dim``
(the first such dim; ``Strategy.zero1``), and the ILP picks (a pin of stage 1 offers the
twin alone). A ZeRO-1 parameter on dim d keeps its weights and its whole gradient, but
only about 1/n of its optimizer state (n = the size of d). Per dim d, the ZeRO-1 parameters
form streams (``memory.zero1.plan_shard_buckets``): those whose gradient backward leaves
Partial on d, and the others; each stream is its parameters' local tensors, each padded to
``n * c`` elements with ``c = ceil(numel / n)``, end to end in backward order, viewed as n
rows: the rank at index i owns row i (``runtime.zero1_streams``: a flat buffer the
parameters are views of, as DeepSpeed lays them). At the optimizer step (after backward,
not overlapping it):

- the first stream's gradients are reduce-scattered on d (the others' are whole on every
  rank already: each takes its row), ``M = n * c`` gradient elements per parameter, bucketed;
- the optimizer updates the rank's row (its state has the row's elements);
- every stream's updated rows are all-gathered on d into the parameters, ``M = n * c``
  weight elements per parameter, bucketed.

RS + AG move the bytes of one all-reduce; the RS replaces the parameter's all-reduce on
d. Buckets cut a kind's streams' columns (n elements each, one per row; the first
stream's columns, then the second's) every ``cap`` bytes (``shard_bucket_cap``), so M
bytes run exactly ``ceil(M / cap)`` calls: the ILP prices that count and the runtime runs
those buckets. A parameter's state on a rank is what its row holds of it: ``c`` per
parameter is the row's length summed, the bound the memory model prices.

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
    """Bytes of a full bucket of stream columns: whole columns of ``ways`` elements that fit in ``cap``."""
    columns = cap // itemsize // ways
    if columns < 1:
        raise ValueError(f"bucket size {cap} holds no column of {ways} {itemsize}-byte elements")
    return columns * ways * itemsize
