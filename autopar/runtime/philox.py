"""Philox-4x32-10 (Salmon et al., SC'11; Random123) in torch integer ops, as plainly as it is
specified: the reference the stream's implementations (``runtime.philox_eager``,
``runtime.philox_triton``) are tested against. A counter-based generator, so any element's
random bits are a pure function of (key, counter) and a rank computes only the elements it holds.

Words are uint32 values kept in int64 tensors (torch has no full unsigned arithmetic). A
round's 32 x 32 -> 64-bit multiply runs as an int64 multiply: the product may pass 2^63 and
wrap to a negative int64, which keeps all 64 bits (two's complement), so the low word is
``p & 0xffffffff`` and the high word ``(p >> 32) & 0xffffffff`` (the arithmetic shift's sign
bits are masked off). ``tests/test_philox.py`` checks Random123's known-answer vectors.

The stream built on it (``counter_words``): element ``i`` of draw ``d`` under ``seed`` is lane
``i % 4`` of ``philox(key=seed, counter=(i // 4 low, i // 4 high, d low, d high))``.
"""

from __future__ import annotations

import torch

from autopar.philox_spec import LANES, M0, M1, MASK, ROUNDS, W0, W1

Words = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def philox4x32(counter: tuple[torch.Tensor | int, ...], key: tuple[int, int], rounds: int = ROUNDS) -> Words:
    """The four output words of Philox-4x32-``rounds`` for ``counter`` (four words, tensors of
    one shape or ints; at least one a tensor) under ``key`` (two words)."""
    like = next(c for c in counter if isinstance(c, torch.Tensor))
    c0, c1, c2, c3 = (c if isinstance(c, torch.Tensor) else torch.full_like(like, c) for c in counter)
    k0, k1 = key[0] & MASK, key[1] & MASK
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0 = c0 * M0  # may wrap past 2^63: the 64 bits are kept (module docstring)
        p1 = c2 * M1
        hi1 = (p1 >> 32).bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(MASK)
        hi0 = (p0 >> 32).bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(MASK)
        c0, c1, c2, c3 = hi1, p1.bitwise_and_(MASK), hi0, p0.bitwise_and_(MASK)
    return c0, c1, c2, c3


def counter_words(seed: int, draw: int, groups: torch.Tensor, sub: int = 0) -> Words:
    """The four words of draw ``draw`` (below 2^63), sub-stream ``sub`` (0 or 1), for the
    counters ``groups`` (int64 element indices divided by ``LANES``): the stream's words
    for elements ``4g .. 4g + 3``."""
    high = ((draw >> 32) & 0x7FFFFFFF) | (sub << 31)
    return philox4x32((groups & MASK, groups >> 32, draw & MASK, high), (seed & MASK, (seed >> 32) & MASK))


def element_words(seed: int, draw: int, index: torch.Tensor, sub: int = 0) -> torch.Tensor:
    """One 32-bit word (int64) per element index in ``index``: lane ``i % 4`` of its counter."""
    words = torch.stack(counter_words(seed, draw, index >> 2, sub), dim=-1)
    return words.gather(-1, (index & (LANES - 1)).unsqueeze(-1)).squeeze(-1)


def row_words(seed: int, draw: int, groups: torch.Tensor, sub: int = 0) -> torch.Tensor:
    """The words of whole counters: for ``groups`` of shape (..., n), (..., 4n), the four
    lanes of each counter side by side (elements 4g .. 4g + 3 in order). What
    ``element_words`` gives for those elements, a quarter of the rounds' work."""
    return torch.stack(counter_words(seed, draw, groups, sub), dim=-1).flatten(-2)
