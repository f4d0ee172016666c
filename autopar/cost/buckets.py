"""Gradient buckets: the gradients reduced together, one all-reduce per bucket.

Parameters whose gradient comes back Partial on a mesh dim are all-reduced there once per
step. Per mesh dim, their local gradients are laid end to end in backward order (reverse
parameter order, as DDP fills its buckets) and cut into buckets of exactly ``cap`` bytes
(the last one shorter); a parameter may straddle two buckets. So a mesh dim whose
gradients total M bytes runs exactly ``ceil(M / cap)`` all-reduces: the ILP prices that
count (``bucket_count``) and the runtime runs these buckets, so both pay the same
latency terms. A parameter reduced on several mesh dims is in one bucket stream per dim;
the runtime reduces them in mesh-dim order.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket size."""


@dataclass(frozen=True)
class BucketSlice:
    """Elements ``[start, stop)`` of one parameter's flattened local gradient."""

    param: str
    """Parameter node name."""
    start: int
    stop: int


@dataclass(frozen=True)
class GradBucket:
    mesh_dim: int
    """The mesh dim this bucket is all-reduced over."""
    slices: tuple[BucketSlice, ...]
    """What the bucket holds, in packing order."""
    nbytes: int
    """Bytes of the packed gradients (local shards, at the plan's precision)."""

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.param for s in self.slices))


def bucket_count(nbytes: float, cap: int = DEFAULT_BUCKET_BYTES) -> int:
    """All-reduces ``gradient_buckets`` makes of ``nbytes`` of gradients on one mesh dim."""
    return math.ceil(nbytes / cap)


def gradient_buckets(params: list[tuple[str, int, frozenset[int]]], itemsize: int,
                     cap: int = DEFAULT_BUCKET_BYTES) -> list[GradBucket]:
    """``params``: (name, local gradient elements, sync dims) in parameter order; every
    gradient element takes ``itemsize`` bytes. Buckets of mesh dim 0 first, then dim 1, ..."""
    if cap % itemsize:
        raise ValueError(f"bucket size {cap} is not a whole number of {itemsize}-byte elements")
    per_bucket = cap // itemsize
    buckets: list[GradBucket] = []
    for dim in sorted({d for _, _, dims in params for d in dims}):
        slices: list[BucketSlice] = []
        room = per_bucket
        for name, numel, dims in reversed(params):
            if dim not in dims:
                continue
            start = 0
            while start < numel:
                take = min(room, numel - start)
                slices.append(BucketSlice(name, start, start + take))
                start += take
                room -= take
                if room == 0:
                    buckets.append(GradBucket(dim, tuple(slices), cap))
                    slices, room = [], per_bucket
        if slices:
            buckets.append(GradBucket(dim, tuple(slices), (per_bucket - room) * itemsize))
    return buckets


@dataclass(frozen=True)
class ShardBucket:
    """One bucket of ZeRO-1 columns (``autopar.cost.zero1``): a reduce-scatter of gradients or
    an all-gather of updated parameters on one mesh dim, run at the optimizer step."""

    kind: str
    """'reduce_scatter' or 'all_gather'."""
    mesh_dim: int
    ways: int
    """Ranks on ``mesh_dim``: each column holds one element of each rank's row."""
    columns: tuple[int, int]
    """Columns ``[start, stop)`` of the kind's streams on ``mesh_dim``, one stream's after another's."""
    slices: tuple[BucketSlice, ...]
    """The parameters it moves elements of, in stream order: each one's padded elements lie at
    ``[start, stop)`` of its stream."""
    nbytes: int
    """M of the collective: the columns' elements on every rank (``ways`` x columns x itemsize)."""

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.param for s in self.slices))


_Placed = tuple[int, list[tuple[str, int, int]], list[int]]
"""One stream laid out: its columns, its parameters' (name, start, stop) elements, and their starts."""


def shard_buckets(kind: str, mesh_dim: int, ways: int, streams: list[list[tuple[str, int]]], itemsize: int,
                  cap: int) -> list[ShardBucket]:
    """The buckets of one kind on one mesh dim. ``streams``: each stream's parameters (name,
    chunk elements c) in stream order, each taking ``ways * c`` elements end to end, viewed as
    ``ways`` rows; the columns of the streams one after another, cut every ``cap`` bytes of
    ``ways`` x columns (a whole number of columns: ``zero1.shard_bucket_cap``)."""
    per_bucket = cap // (itemsize * ways)
    if per_bucket * itemsize * ways != cap:
        raise ValueError(f"bucket size {cap} is not a whole number of {ways}-element columns of {itemsize} bytes")
    placed: list[_Placed] = []
    for stream in streams:
        layout, position = [], 0
        for name, chunk in stream:
            layout.append((name, position, position + ways * chunk))
            position += ways * chunk
        placed.append((position // ways, layout, [lo for _, lo, _ in layout]))
    total = sum(width for width, _, _ in placed)
    buckets = []
    for start in range(0, total, per_bucket):
        stop = min(start + per_bucket, total)
        slices = tuple(BucketSlice(*s) for s in _touched(placed, ways, start, stop))
        buckets.append(ShardBucket(kind, mesh_dim, ways, (start, stop), slices, (stop - start) * ways * itemsize))
    return buckets


def _touched(placed: list[_Placed], ways: int, start: int, stop: int) -> list[tuple[str, int, int]]:
    """The parameters with an element in columns ``[start, stop)`` of the streams (row r of a
    stream of w columns holds its elements ``[r * w, (r + 1) * w)``), in stream order. Each row's
    piece is found by bisection: a bucket of a big model's stream meets a few parameters per row
    of hundreds, and a plan lists thousands of buckets."""
    out, first = [], 0
    for width, layout, starts in placed:
        a, b = max(start - first, 0), min(stop - first, width)
        if a < b:
            hit: set[int] = set()
            for row in range(ways):
                lo, hi = row * width + a, row * width + b
                i = max(bisect_right(starts, lo) - 1, 0)  # parameters laid end to end: none before i reaches lo
                while i < len(layout) and layout[i][1] < hi:
                    if layout[i][2] > lo:
                        hit.add(i)
                    i += 1
            out += [layout[i] for i in sorted(hit)]
        first += width
    return out
