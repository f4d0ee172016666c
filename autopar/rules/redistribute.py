"""How to turn one set of placements into another: the ordered per-mesh-dim steps.

The cost model prices these steps and the runtime executes them, so what a plan lists
is what runs. Shards on several mesh dims of one tensor dim are nested with the first
mesh dim outermost (DTensor's convention), so the order matters:
1. un-shard (all-gather, or all-to-all when no other mesh dim splits the two tensor dims
   but outer ones that stay), innermost mesh dim first;
2. reduce Partials (all-reduce, or reduce-scatter when it keeps the nesting);
3. shard what is replicated (a local slice) outermost first, and make Partials from
   replicated values (keep the value on coordinate 0, zeros elsewhere).

A strided shard (``strided(d, k)``: dim d seen as k blocks, each split across the ranks)
gathers with one all-gather plus a local reorder, and is made by a strided slice; it
never takes part in an all-to-all or a reduce-scatter (those move contiguous chunks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Placement, Replicate

from autopar.rules.strategy import is_strided, shard_dim, split_factor

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
SLICE, ZERO = "slice", "zero"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)


@dataclass(frozen=True)
class Step:
    """One step on one mesh dim. ``before`` are all placements just before it runs."""

    kind: str
    mesh_dim: int
    before: tuple[Placement, ...]
    src_dim: int = -1
    """Tensor dim gathered (all_gather, all_to_all)."""
    dst_dim: int = -1
    """Tensor dim scattered or sliced (reduce_scatter, all_to_all, slice)."""
    factor: int = 1
    """Blocks of a strided shard being gathered (all_gather) or made (slice); 1 if plain."""


def strided_view(x: torch.Tensor, dim: int, factor: int, ways: int, index: int) -> torch.Tensor:
    """Rank ``index``'s piece of a strided shard as a view of ``x``: dim ``dim`` becomes
    two, (block, position in this rank's piece of the block)."""
    return x.unflatten(dim, (factor, ways, x.shape[dim] // (factor * ways))).select(dim + 1, index)


def strided_take(x: torch.Tensor, dim: int, factor: int, ways: int, index: int) -> torch.Tensor:
    """Rank ``index``'s piece of a strided shard: its 1/ways of each of ``factor`` blocks."""
    return strided_view(x, dim, factor, ways, index).flatten(dim, dim + 1)


def strided_join(gathered: torch.Tensor, dim: int, factor: int, ways: int) -> torch.Tensor:
    """Undo the rank-major order of an all-gather of strided pieces: rank pieces per block."""
    pieces = gathered.unflatten(dim, (ways, factor, gathered.shape[dim] // (factor * ways)))
    return pieces.transpose(dim, dim + 1).flatten(dim, dim + 2)


def zigzag_view(x: torch.Tensor, dim: int, factor: int, ways: int, index: int) -> torch.Tensor:
    """Rank ``index``'s piece of a zig-zag shard as a view of ``x``: dim ``dim`` seen as
    ``factor`` blocks (1: a plain shard), each cut into 2 * ways chunks, of which the rank holds
    chunks index and 2 * ways - 1 - index; dim becomes three, (block, which chunk, position).
    Those two chunks are one step of a strided slice apart, so this is a view."""
    cut = x.unflatten(dim, (factor, 2 * ways, x.shape[dim] // (factor * 2 * ways)))
    pick = slice(index, 2 * ways - index, 2 * ways - 1 - 2 * index)
    return cut[(slice(None),) * (dim + 1) + (pick,)]


def piece_view(whole: torch.Tensor, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
               coordinate: tuple[int, ...], zigzag: frozenset[int] = frozenset()) -> torch.Tensor:
    """The elements of ``whole`` (replicated) that the rank at ``coordinate`` holds under
    ``placements``, as a view (no copy) in its local tensor's order: the slice a reshard from
    Replicate hands it, with each strided dim left as two, (block, position in this rank's
    piece), each zig-zag one (a mesh dim in ``zigzag``) as three."""
    view, where = whole, list(range(whole.ndim))  # where each global dim sits in ``view``
    for step in redistribute_steps((Replicate(),) * len(placements), placements):
        assert step.kind == SLICE, step
        n, i, d = mesh_shape[step.mesh_dim], coordinate[step.mesh_dim], where[step.dst_dim]
        if step.mesh_dim in zigzag and n > 1:  # (block, which chunk, position): two dims more
            view = zigzag_view(view, d, step.factor, n, i)
            where = [w + 2 if w > d else w for w in where]
        elif step.factor > 1:
            view = strided_view(view, d, step.factor, n, i)
            where = [w + 1 if w > d else w for w in where]
        else:
            size = view.shape[d] // n
            view = view.narrow(d, i * size, size)
    return view


def zigzag_take(x: torch.Tensor, dim: int, factor: int, ways: int, index: int) -> torch.Tensor:
    """Rank ``index``'s piece of a zig-zag shard (``zigzag_view``), dim ``dim`` whole again."""
    return zigzag_view(x, dim, factor, ways, index).flatten(dim, dim + 2)


def zigzag_join(gathered: torch.Tensor, dim: int, factor: int, ways: int) -> torch.Tensor:
    """Undo the rank-major order of an all-gather of zig-zag pieces: rank j's first chunk is
    chunk j of each block, its second chunk 2 * ways - 1 - j."""
    pieces = gathered.unflatten(dim, (ways, factor, 2, gathered.shape[dim] // (ways * factor * 2)))
    first, second = pieces.select(dim + 2, 0), pieces.select(dim + 2, 1).flip(dim)
    return torch.cat([first, second], dim).transpose(dim, dim + 1).flatten(dim, dim + 2)


def zigzag_order(x: torch.Tensor, dim: int, ways: int) -> torch.Tensor:
    """``x`` reordered along ``dim`` so that its contiguous chunk j is rank j's zig-zag piece:
    what a reduce-scatter or an all-to-all, which hand rank j the j-th contiguous chunk, is
    given to leave zig-zag pieces."""
    chunks = x.unflatten(dim, (2 * ways, x.shape[dim] // (2 * ways)))
    first, second = chunks.narrow(dim, 0, ways), chunks.narrow(dim, ways, ways).flip(dim)
    return torch.stack([first, second], dim + 1).flatten(dim, dim + 2)


def _all_to_all_fits(cur: list[Placement], dst: tuple[Placement, ...], i: int) -> bool:
    """Mesh dim ``i`` can turn its shard of tensor dim a into one of dim b with one all-to-all.

    Each rank cuts its tensor into chunks along b and concatenates what it receives along a,
    so afterwards i is the innermost split of both dims. That is DTensor's nesting (outer mesh
    dims outermost) when every other mesh dim splitting a or b, before or after, is an outer
    one that stays as it is (a batch split on dp around the ep all-to-all of expert parallelism)."""
    a, b = shard_dim(cur[i]), shard_dim(dst[i])
    if b is None or a == b or is_strided(cur[i]) or is_strided(dst[i]):
        return False
    for j in range(len(cur)):
        touches = j != i and {shard_dim(cur[j]), shard_dim(dst[j])} & {a, b}
        if touches and not (j < i and cur[j] == dst[j] and not is_strided(cur[j])):
            return False
    return True


@functools.lru_cache(maxsize=65536)
def redistribute_steps(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> tuple[Step, ...]:
    """The steps from ``src`` to ``dst`` (cached: planning asks for the same pairs many times)."""
    cur = list(src)
    ndim = len(cur)
    steps: list[Step] = []

    # Mesh dims whose shard must be undone, plus inner mesh dims nested inside them
    # (gathering an outer shard while an inner one stays would interleave the chunks).
    unshard: set[int] = set()
    for i in range(ndim):
        a, b = shard_dim(cur[i]), shard_dim(dst[i])
        if a is not None and cur[i] != dst[i]:
            unshard.add(i)
            unshard.update(j for j in range(i + 1, ndim) if shard_dim(cur[j]) == a)
        if b is not None and cur[i] != dst[i]:
            unshard.update(j for j in range(i + 1, ndim) if shard_dim(cur[j]) == b)
    for i in sorted(unshard, reverse=True):
        a, b = shard_dim(cur[i]), shard_dim(dst[i])
        assert a is not None
        if _all_to_all_fits(cur, dst, i):
            steps.append(Step(ALL_TO_ALL, i, tuple(cur), src_dim=a, dst_dim=b))
            cur[i] = dst[i]
        else:
            steps.append(Step(ALL_GATHER, i, tuple(cur), src_dim=a, factor=split_factor(cur[i])))
            cur[i] = Replicate()

    for i in range(ndim):
        if isinstance(cur[i], Partial) and not isinstance(dst[i], Partial):
            b = shard_dim(dst[i])
            # A reduce-scatter puts its chunk innermost: wrong if an inner mesh dim already
            # splits dim b, or an outer one still has to slice it (DTensor nests outer first).
            nested_inside = b is None or any(shard_dim(cur[j]) == b for j in range(i + 1, ndim)) or any(
                shard_dim(dst[j]) == b and cur[j] != dst[j] for j in range(i))
            if b is not None and not nested_inside and not is_strided(dst[i]):
                steps.append(Step(REDUCE_SCATTER, i, tuple(cur), dst_dim=b))
                cur[i] = dst[i]
            else:
                steps.append(Step(ALL_REDUCE, i, tuple(cur)))
                cur[i] = Replicate()

    for i in range(ndim):
        if cur[i] == dst[i]:
            continue
        assert isinstance(cur[i], Replicate), (src, dst, cur)
        if shard_dim(dst[i]) is not None:
            steps.append(Step(SLICE, i, tuple(cur), dst_dim=shard_dim(dst[i]), factor=split_factor(dst[i])))
        else:
            steps.append(Step(ZERO, i, tuple(cur)))
        cur[i] = dst[i]
    return tuple(steps)
