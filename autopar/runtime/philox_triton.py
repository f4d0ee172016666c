"""The counter stream's draw as one Triton kernel (CUDA): index, Philox rounds and finish fused, the
result written once, so a draw costs about one pass over the rank's elements (plus its integer
arithmetic; ``philox_spec.KERNEL_OPS_*``, priced by ``cost.draws``).

Each program takes one row of the draw's region (every dim but the last: its base index
unravelled once, as scalars) and a block of that row: ``BLOCK`` counters whose four words fill
``4 * BLOCK`` consecutive elements, one store per lane, where the row holds whole counters
(``Region.counters``), else ``BLOCK`` elements each computing its own counter and keeping its
lane. (Interleaving the lanes with ``tl.join`` before one store costs a shared-memory shuffle
and 15 barriers a program: the per-lane stores write the same bytes, as byte stores either way.) The rounds are
written out as ``runtime.philox`` writes them (32-bit words, ``tl.umulhi`` for the high halves;
Triton's ``tl.philox`` is the same generator, but a jit function made at import, which the
interpreter cannot call). Regions of more than ``MAX_OUTER`` + 1 dims after coalescing (none that
plain, strided or zig-zag pieces of a 4-D tensor make) run the eager draw instead.

Checked bit for bit against the eager draw under Triton's interpreter (``TRITON_INTERPRET=1``,
on CPU tensors: ``tests/test_philox.py`` where triton is installed), and compiled to SASS for
sm_80 and sm_90 without a GPU (every finish, grouped or not: what ``KERNEL_OPS_*`` count); not
yet run on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from autopar.philox_spec import M0, M1, MASK, ROUNDS, W0, W1, Finish, Region

MAX_OUTER = 4
"""Dims of a region besides the last that the kernel unravels a row index over."""
BLOCK = 1024


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _finish(words, threshold, scale, out_ptr, FINISH: tl.constexpr, SHIFT: tl.constexpr):
        if FINISH == 0:  # words
            value = words.to(tl.int64)
        elif FINISH == 1:  # below: a mask (the threshold below 2^32: ``draw`` fills 0 or 1 past it)
            value = words < tl.cast(threshold, tl.uint32)
        else:  # uniform: the top bits, scaled by a power of two (exact)
            value = (words >> SHIFT).to(out_ptr.dtype.element_ty) * scale
        return value.to(out_ptr.dtype.element_ty)

    # Triton resolves a kernel's callees in its module's globals; made here, with the kernel,
    # because whether a jit function is interpreted is fixed when it is made.
    globals()["_finish"] = _finish

    @triton.jit
    def draw_kernel(out_ptr, key0, key1, high0, high1, threshold, scale, offset, last, step, blocks,
                    n0, s0, n1, s1, n2, s2, n3, s3,
                    FINISH: tl.constexpr, SHIFT: tl.constexpr, GROUPED: tl.constexpr, BLOCK: tl.constexpr,
                    ROUNDS: tl.constexpr, M0: tl.constexpr, M1: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        row, block = pid // blocks, pid % blocks
        base = tl.cast(offset, tl.int64)  # the row's first global index (a counter's where GROUPED)
        rest = row
        base += (rest % n3) * s3
        rest = rest // n3
        base += (rest % n2) * s2
        rest = rest // n2
        base += (rest % n1) * s1
        rest = rest // n1
        base += (rest % n0) * s0
        j = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        index = base + j * step
        counter = index if GROUPED else index >> 2
        c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
        c1 = (counter >> 32).to(tl.uint32)
        c2 = c0 * 0 + tl.cast(high0, tl.uint32)  # (tl.zeros is a jit function: not in the interpreter)
        c3 = c0 * 0 + tl.cast(high1, tl.uint32)
        k0 = tl.cast(key0, tl.uint32)  # scalars: the key's bump is not per element
        k1 = tl.cast(key1, tl.uint32)
        for _ in tl.static_range(ROUNDS):  # Philox-4x32 (philox_spec): as runtime.philox.philox4x32
            hi0, lo0 = tl.umulhi(c0, M0), c0 * M0
            hi1, lo1 = tl.umulhi(c2, M1), c2 * M1
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            k0 += W0
            k1 += W1
        if GROUPED:  # element 4j + l is word l of counter j (LANES = 4): one store per lane
            at = (row * last + j) * 4
            valid = j < last
            tl.store(out_ptr + at, _finish(c0, threshold, scale, out_ptr, FINISH, SHIFT), mask=valid)
            tl.store(out_ptr + at + 1, _finish(c1, threshold, scale, out_ptr, FINISH, SHIFT), mask=valid)
            tl.store(out_ptr + at + 2, _finish(c2, threshold, scale, out_ptr, FINISH, SHIFT), mask=valid)
            tl.store(out_ptr + at + 3, _finish(c3, threshold, scale, out_ptr, FINISH, SHIFT), mask=valid)
        else:
            lane = index & 3
            words = tl.where(lane == 0, c0, tl.where(lane == 1, c1, tl.where(lane == 2, c2, c3)))
            tl.store(out_ptr + row * last + j, _finish(words, threshold, scale, out_ptr, FINISH, SHIFT), mask=j < last)

    return draw_kernel


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Triton imports (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fits(region: Region) -> bool:
    return len(region.sizes) <= MAX_OUTER + 1


FINISHES: dict[Finish, int] = {"words": 0, "below": 1, "uniform": 2}


def draw(seed: int, high: tuple[int, int], region: Region, finish: Finish, out: torch.Tensor, threshold: int = 0,
         bits: int = 32) -> None:
    """``philox_eager.draw``'s contract (key: ``seed``'s two words) as one kernel launch on ``out``'s
    device (the current CUDA stream)."""
    if finish == "below" and not 0 < threshold < 1 << 32:  # every word is below, or none: no rounds
        out.fill_(threshold > 0)
        return
    counters = region.counters()
    grouped = counters is not None
    shape = counters if counters is not None else region
    outer = list(zip(shape.sizes[:-1], shape.strides[:-1]))
    outer = [(1, 0)] * (MAX_OUTER - len(outer)) + outer
    last = shape.sizes[-1]
    blocks = -(-last // BLOCK)
    rows = shape.numel // last
    flat = [v for pair in outer for v in pair]
    _kernel()[(rows * blocks,)](
        out, seed & MASK, (seed >> 32) & MASK, high[0] & MASK, high[1] & MASK, threshold, 2.0 ** -bits, shape.offset,
        last, shape.strides[-1], blocks, *flat, FINISH=FINISHES[finish], SHIFT=32 - bits, GROUPED=grouped,
        BLOCK=BLOCK, ROUNDS=ROUNDS, M0=M0, M1=M1, W0=W0, W1=W1)
