"""The counter stream's draw as eager torch ops (CPU, and any device without the fused kernel).

Words are uint32 values in int64 lanes (torch has no full unsigned arithmetic; see
``runtime.philox``). On a CPU the rounds are bound by int64 multiplies and the number of ops,
and, over large draws, by memory, so (measured on the cpu profile's machine, 4 ranks drawing at
once: ``benchmarks/random.py --calibrate``):

- chunks of ``CHUNK`` counters: each op's operands (eight int64 buffers, reused) stay in L2
  instead of streaming the whole draw through memory once per op (3x faster than whole-tensor
  ops on 1-4M-element masks, 17 ns an element; the same up to 0.5M elements);
- 10 ops a round, not 12: a round's low words (the products' low halves) are only ever xored
  into the next round's high words, so they are kept unmasked (the garbage above bit 31 is
  masked off with the high word) and masked once at the end;
- scalars stay scalars: the draw's counter words (and the index's high word) are the same for
  every element, so the first rounds multiply and xor Python ints where they can (4, 6, 9 ops
  in rounds 0-2);
- the finish (compare, scale) runs per lane into the output, whose bytes are written once.

``philox_spec.eager_draw_ops`` counts the ops a draw runs; ``cost.draws`` prices that count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.philox_spec import CHUNK, LANES, M0, M1, MASK, ROUNDS, W0, W1, Finish, Region

Word = torch.Tensor | int
"""A counter word: a tensor over the chunk's counters, or one int for all of them."""


class _Buffers:
    """Two sets of four int64 buffers, alternating by round, so a round never writes what it
    reads; a chunk shorter than the buffers takes views of them, made once per length."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.size = n
        self.sets = {n: [[torch.empty(n, dtype=torch.int64, device=device) for _ in range(4)] for _ in range(2)]}

    def take(self, round_: int, n: int) -> list[torch.Tensor]:
        if n not in self.sets:
            self.sets[n] = [[b[:n] for b in buffers] for buffers in self.sets[self.size]]
        return self.sets[n][round_ % 2]


def _mul(c: Word, m: int, out: torch.Tensor) -> Word:
    # int64 products wrap past 2^63, keeping the low 64 bits (two's complement): exact
    return c * m if isinstance(c, int) else torch.mul(c, m, out=out)


def _high_xor(p: Word, c: Word, k: int, out: torch.Tensor) -> Word:
    """``(high word of p) ^ c ^ k``, masked to 32 bits; ``c`` may carry garbage above bit 31."""
    if isinstance(p, int) and isinstance(c, int):
        return ((p >> 32) ^ c ^ k) & MASK
    if isinstance(p, int):
        assert isinstance(c, torch.Tensor)
        return torch.bitwise_xor(c, ((p >> 32) ^ k) & MASK, out=out).bitwise_and_(MASK)
    t = torch.bitwise_right_shift(p, 32, out=out)  # arithmetic: sign bits above 31, masked below
    if isinstance(c, int):
        t.bitwise_xor_((c ^ k) & MASK)
    else:
        t.bitwise_xor_(c).bitwise_xor_(k)
    return t.bitwise_and_(MASK)


def rounds(counter: Sequence[Word], key: tuple[int, int], buffers: _Buffers, n: int) -> list[Word]:
    """Philox-4x32-10 on ``counter`` (c0 and c2 below 2^32; c1 and c3 may carry bits above 31)
    under ``key``: the four words, c0 and c2 masked, c1 and c3 valid in their low 32 bits."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        h0, h1, p0_out, p1_out = buffers.take(r, n)
        p0, p1 = _mul(c0, M0, p0_out), _mul(c2, M1, p1_out)
        c0, c1, c2, c3 = _high_xor(p1, c1, k0, h0), p1, _high_xor(p0, c3, k1, h1), p0
    return [c0, c1, c2, c3]


def _finish_lane(word: torch.Tensor, masked: bool, finish: Finish, threshold: int, shift: int, out: torch.Tensor,
                 scratch: torch.Tensor) -> None:
    """Write one lane's finish into ``out`` (a strided view of the output's chunk)."""
    if finish == "words":
        if masked:
            out.copy_(word)
        else:
            torch.bitwise_and(word, MASK, out=out)
        return
    if not masked:
        word = torch.bitwise_and(word, MASK, out=scratch)
    if finish == "below":
        torch.lt(word, threshold, out=out)
    else:
        out.copy_(torch.bitwise_right_shift(word, shift, out=scratch))  # exact: below 2^bits


def draw(key: tuple[int, int], high: tuple[int, int], region: Region, finish: Finish, out: torch.Tensor,
         threshold: int = 0, bits: int = 32) -> None:
    """Write into ``out`` (contiguous, ``region.numel`` elements) the finish of each held
    element's word: counter ``(index // 4, index // 4 >> 32, *high)`` under ``key``, lane
    ``index % 4``. ``below``: ``word < threshold`` (in any dtype ``out`` has); ``uniform``:
    ``(word >> (32 - bits)) * 2^-bits`` in ``out``'s float dtype; ``words``: the word (int64)."""
    flat = out.view(-1)
    counters = region.counters()
    grouped = counters is not None
    shape = counters if counters is not None else region
    last, step = shape.sizes[-1], shape.strides[-1]
    width = LANES if grouped else 1  # elements per entry of ``shape``
    size = min(CHUNK, shape.numel)
    column = torch.arange(min(last, CHUNK), dtype=torch.int64, device=out.device) * step
    buffers = _Buffers(size, out.device)
    scratch = torch.empty(size * (1 if grouped else LANES), dtype=torch.int64, device=out.device)
    if last >= CHUNK:  # one row at a time, cut in column blocks: the row's base a scalar
        for r in range(shape.numel // last):
            base = shape.row_base(r)
            for c in range(0, last, CHUNK):
                n = min(CHUNK, last - c)
                index = column[:n] + (base + c * step)
                start = (r * last + c) * width
                _chunk(key, high, index, (base + c * step, base + (c + n - 1) * step), grouped, finish,
                       flat[start:start + n * width], threshold, bits, buffers, scratch)
        return
    bases = _row_bases(shape, out.device)
    rows = CHUNK // last  # whole rows per chunk
    for r in range(0, len(bases), rows):
        index = (bases[r:r + rows].unsqueeze(1) + column).view(-1)
        n = index.numel()
        bounds = (shape.row_base(r), shape.row_base(r + n // last - 1) + (last - 1) * step)
        _chunk(key, high, index, bounds, grouped, finish, flat[r * last * width:(r * last + n) * width], threshold,
               bits, buffers, scratch)


def _row_bases(region: Region, device: torch.device) -> torch.Tensor:
    """int64 global index of each row's first element (``Region.row_base`` for every row)."""
    base = torch.full((), region.offset, dtype=torch.int64, device=device)
    for d, (n, s) in enumerate(zip(region.sizes[:-1], region.strides[:-1])):
        at = [1] * (len(region.sizes) - 1)
        at[d] = n
        base = base + (torch.arange(n, device=device) * s).view(at)
    return base.reshape(-1)


def _chunk(key: tuple[int, int], high: tuple[int, int], index: torch.Tensor, bounds: tuple[int, int], grouped: bool,
           finish: Finish, out: torch.Tensor, threshold: int, bits: int, buffers: _Buffers,
           scratch: torch.Tensor) -> None:
    """One chunk: ``index`` the counters (grouped) or elements, ascending from ``bounds[0]`` to ``bounds[1]``."""
    n = index.numel()
    lane = None
    if not grouped:
        lane = index.bitwise_and(LANES - 1)
        index = index.bitwise_right_shift(2)
        bounds = (bounds[0] >> 2, bounds[1] >> 2)
    top = bounds[0] >> 32
    if top == bounds[1] >> 32:  # one high word for the chunk: a scalar
        c0: Word = index if top == 0 else index - (top << 32)  # one op more past 2^32 counters
        c1: Word = top
    else:
        c0, c1 = index & MASK, index >> 32
    words = rounds((c0, c1, high[0], high[1]), key, buffers, n)
    assert all(isinstance(w, torch.Tensor) for w in words)  # every word depends on the index by round 2
    shift = 32 - bits
    if lane is None:
        lanes = out.view(n, LANES)
        for i, word in enumerate(words):
            _finish_lane(word, i % 2 == 0, finish, threshold, shift, lanes[:, i], scratch[:n])
        if finish == "uniform":
            out.mul_(2.0 ** -bits)  # exact: a power of two
        return
    stacked = torch.stack(words, dim=1, out=scratch[:LANES * n].view(n, LANES)).bitwise_and_(MASK)
    word = torch.gather(stacked, 1, lane.unsqueeze(1)).view(-1)
    if finish == "words":
        out.copy_(word)
    elif finish == "below":
        torch.lt(word, threshold, out=out)
    else:
        out.copy_(word.bitwise_right_shift_(shift)).mul_(2.0 ** -bits)
