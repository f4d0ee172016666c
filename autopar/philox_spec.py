"""Philox-4x32-10 as the counter stream uses it, and what each of its implementations runs per
counter: one module below both ``cost`` (which prices a draw) and ``runtime`` (which runs it),
so the price and the run read the same figures.

The generator (Salmon et al., SC'11; Random123): a counter of four 32-bit words and a key of
two; ``ROUNDS`` rounds, each two 32 x 32 -> 64-bit products by ``M0``/``M1`` whose high words
are xored with the other two counter words and the key, the key bumped by ``W0``/``W1`` between
rounds. The stream (``runtime.stream``): element ``i`` of draw ``d`` (sub-stream ``s``) under
``seed`` is lane ``i % 4`` of the words at counter ``(i // 4 low, i // 4 high, d low, d high |
s << 31)`` under key ``(seed low, seed high)``.

Two implementations run it (``runtime.stream`` picks by device):

- the fused kernel (``runtime.philox_triton``, CUDA): one kernel per draw that computes each
  element's global index, the Philox rounds in 32-bit registers and the sampler's finish (a
  compare for a mask, a scale for a uniform), and writes the result once. ``KERNEL_OPS_*``
  count its instructions.
- eager torch ops (``runtime.philox_eager``, CPU and any other device): int64 ops over chunks of
  ``CHUNK`` counters held in cache, words in int64 lanes. ``eager_draw_ops`` counts the ops it runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.tensor import Placement

from autopar.rules.redistribute import piece_view

MASK = 0xFFFFFFFF
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
LANES = 4
"""Words one counter gives: elements that share a counter (``i // LANES``) are drawn together."""

Finish = Literal["words", "below", "uniform"]
"""What a draw writes per element: its 32-bit word (int64), a bool ``word < threshold`` (dropout's
mask, a scalar Bernoulli), or a uniform float from the word's top bits."""
FINISH_BYTES: dict[Finish, int] = {"words": 8, "below": 1, "uniform": 4}
"""Bytes a draw writes per element (uniform: fp32, fp64 writes 8; a mask written straight into a
float tensor by ``bernoulli_`` writes that tensor's width)."""

KERNEL_OPS_PER_COUNTER = 67
"""Instructions of the fused kernel per counter: its rounds, 6.5 a round (two products' halves
on IMAD, two three-way xors on LOP3; the key's bump is a scalar), and its words from the index.
Counted in the SASS ptxas emits for the kernel (Triton 3.9, sm_80 and sm_90): 52 instructions
a thread a round for its 8 counters."""
KERNEL_OPS_PER_ELEMENT = 7
"""Instructions per element besides the rounds: index, compare (or shift and scale), byte store
(the same SASS: 6.6 an element; the program's row unravel, once per 4096 elements, left out)."""

CHUNK = 16384
"""Counters an eager chunk holds: eight int64 buffers of this size (1 MiB) stay in a core's L2."""


@dataclass(frozen=True)
class Region:
    """Which elements of a drawn tensor a caller holds, as an affine map: local element ``j``
    (row-major in ``sizes``) has the global row-major index ``offset + sum(j[k] * strides[k])``.
    A rank's piece of a tensor (plain, strided and zig-zag shards) is a view of the global
    tensor, so it has this form (``rank_region``); a draw generates words for exactly these
    indices without an index tensor for all of them. Strides are positive."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @staticmethod
    def of_view(view: torch.Tensor) -> Region:
        """The region of ``view``, a view of a contiguous tensor of the global shape (meta)."""
        return Region(tuple(view.shape), tuple(view.stride()), int(view.storage_offset())).coalesced()

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Region:
        return Region((math.prod(shape),), (1,), 0)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def coalesced(self) -> Region:
        """The same map on fewest dims: size-1 dims dropped, a dim merged into the next where
        its stride is the next's stride times the next's size (the order of elements kept)."""
        sizes: list[int] = []
        strides: list[int] = []
        for size, stride in zip(self.sizes, self.strides):
            if size == 1:
                continue
            if sizes and strides[-1] == stride * size:
                sizes[-1], strides[-1] = sizes[-1] * size, stride
            else:
                sizes.append(size)
                strides.append(stride)
        return Region(tuple(sizes) or (1,), tuple(strides) or (1,), self.offset)

    def counters(self) -> Region | None:
        """The region of the counters where every counter's ``LANES`` elements are held together
        and in order (the innermost dim contiguous, its runs whole counters): ``LANES`` elements
        per counter. None otherwise: each element computes its own counter (4x the rounds)."""
        *outer, last = self.sizes
        *outer_strides, step = self.strides
        if step != 1 or last % LANES or self.offset % LANES or any(s % LANES for s in outer_strides):
            return None
        return Region((*outer, last // LANES), (*(s // LANES for s in outer_strides), 1), self.offset // LANES)

    def row_base(self, row: int) -> int:
        """The global index of row ``row``'s first element (rows: every dim but the last)."""
        index = self.offset
        for n, s in zip(reversed(self.sizes[:-1]), reversed(self.strides[:-1])):
            row, at = divmod(row, n)
            index += at * s
        return index

    def chunks(self) -> int:
        """Chunks the eager draw cuts this region (of counters, or elements) into: rows of at
        least ``CHUNK`` cut in column blocks, shorter rows taken ``CHUNK // row`` at a time."""
        last, rows = self.sizes[-1], self.numel // self.sizes[-1]
        return rows * -(-last // CHUNK) if last >= CHUNK else -(-rows // (CHUNK // last))


@functools.lru_cache(maxsize=8192)  # the planner prices each random op under each strategy
def rank_region(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
                coordinate: tuple[int, ...], zigzag: frozenset[int] = frozenset()) -> Region:
    """The region of the rank at ``coordinate``'s piece of a tensor of global ``shape``."""
    whole = torch.empty(shape, device="meta")
    return Region.of_view(piece_view(whole, placements, mesh_shape, coordinate, zigzag))


@functools.lru_cache(maxsize=4096)
def grouped_on_every_rank(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...],
                          zigzag: frozenset[int] = frozenset()) -> bool:
    """Every rank's piece draws ``LANES`` elements per counter (``Region.counters``). A piece's
    offset is a sum over mesh dims of its coordinate times that dim's step (a zig-zag pair's
    second chunk too), so the ranks one step from rank 0 on each mesh dim decide for all."""
    ranks = [(0,) * len(mesh_shape)] + [tuple(int(d == i) for d in range(len(mesh_shape)))
                                        for i, n in enumerate(mesh_shape) if n > 1]
    return all(rank_region(shape, placements, mesh_shape, r, zigzag).counters() is not None for r in ranks)



ROUND_OPS = 4 + 6 + 9 + (ROUNDS - 3) * 10
"""Ops of an eager chunk's rounds: 10 a round (two products, two high words of four ops each),
fewer in rounds 0-2, which start from scalar words (the draw's, and the index's high word)."""
_CHUNK_OPS = 12
"""Per chunk besides the rounds and the finish, grouped (the index, the output's slice and its
four lanes, their scratch) and per element (the index, its counter and lane, the four words
stacked and masked, the lane gathered; views included: each is a dispatch)."""
_FINISH_OPS: dict[bool, dict[Finish, tuple[int, float]]] = {
    True: {"words": (4, 4.0), "below": (6, 6.0), "uniform": (11, 10.0 + LANES)},
    False: {"words": (1, 1.0), "below": (1, 1.0), "uniform": (3, 3.0)},
}
"""(ops, element-ops per counter) of a chunk's finish, grouped: per lane a mask of the low words
(lanes 1 and 3) and the compare, copy or shift-and-copy (then one scale of the chunk); per
element: the compare, copy or shift, copy and scale of the gathered word."""
_ELEMENT_OPS = {True: 1.0 + ROUND_OPS, False: 3.0 + ROUND_OPS + 2 * LANES + 1}
"""Element-ops per counter besides the finish: the index (per element also its counter and
lane), the rounds (per element also the four words stacked and masked, the lane gathered)."""


def eager_draw_ops(region: Region, finish: Finish) -> tuple[int, float]:
    """(ops, element-ops) of the whole eager draw of ``region`` (``runtime.philox_eager``): ops
    each a fixed cost, element-ops each one op over one counter (or element, where each has its
    own). A chunk shorter than the buffers takes views of them once per length (8 ops). A chunk
    whose counters pass 2^32 runs one op more (two where it straddles it): not counted. ``tests/test_philox.py`` counts the ops the draw dispatches against this."""
    counters = region.counters()
    grouped = counters is not None
    shape = counters if counters is not None else region
    long_rows = shape.sizes[-1] >= CHUNK  # one row at a time: its base a scalar
    setup = 12 if long_rows else 14 + 4 * (len(shape.sizes) - 1)  # buffers, columns (and row bases)
    finish_ops, finish_elements = _FINISH_OPS[grouped][finish]
    per_chunk = ROUND_OPS + _CHUNK_OPS + finish_ops + (0 if long_rows else 2)
    last, rows = shape.sizes[-1], shape.numel // shape.sizes[-1]
    full = min(CHUNK, shape.numel)  # the buffers' length
    if long_rows:  # chunks of CHUNK, the row's last one shorter
        lengths = {CHUNK, last % CHUNK or CHUNK}
    else:  # CHUNK // last rows a chunk, the last chunk fewer
        per = CHUNK // last
        lengths = {min(per, rows) * last, (rows % per or min(per, rows)) * last}
    setup += 8 * len(lengths - {full})
    return setup + shape.chunks() * per_chunk, shape.numel * (_ELEMENT_OPS[grouped] + finish_elements)
