"""The counter-based generator (``autopar.runtime.philox``) against Random123's published
known-answer vectors, its index-addressability (any slice of the elements computes the
words the whole computes there), and the samplers' distributions on it; the draws that run
(chunked eager ops, the fused Triton kernel) against it, and the eager draw's ops against
what ``cost.draws`` prices."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.philox_spec import CHUNK, MASK, Finish, Region, eager_draw_ops
from autopar.runtime import philox_eager, philox_triton
from autopar.runtime.philox import element_words, philox4x32, row_words

# Random123 v1.14.0 tests/kat_vectors, "philox4x32 10": counter words, key words, output words.
KAT = [
    ("00000000 00000000 00000000 00000000", "00000000 00000000", "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    ("ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    ("243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "d16cfe09 94fdcceb 5001e420 24126ea1"),
]


def _words(text: str) -> list[int]:
    return [int(w, 16) for w in text.split()]


@pytest.mark.parametrize("counter,key,expected", KAT, ids=["zeros", "ones", "pi"])
def test_known_answers(counter: str, key: str, expected: str) -> None:
    c, k = _words(counter), _words(key)
    out = philox4x32(tuple(torch.tensor([w]) for w in c), (k[0], k[1]))
    assert [int(w) for w in out] == _words(expected)


def test_known_answers_in_a_batch() -> None:
    """Every counter of a tensor is its own: the three vectors side by side (one key each run)."""
    counters = [_words(c) for c, _, _ in KAT]
    for i, (_, key, expected) in enumerate(KAT):
        k = _words(key)
        columns = tuple(torch.tensor([row[j] for row in counters]) for j in range(4))
        out = philox4x32(columns, (k[0], k[1]))
        assert [int(w[i]) for w in out] == _words(expected)


def test_a_slice_draws_the_slice_of_the_whole() -> None:
    """Words are a function of the element index alone: any subset, in any order, of the
    indices gets the whole's words there; whole counters (rows) agree with per-element lanes."""
    whole = element_words(7, 3, torch.arange(4 * 6 * 8).view(4, 6, 8))
    index = torch.arange(4 * 6 * 8).view(4, 6, 8)
    for piece in (index[1:3], index[:, ::2, 4:], index[..., 5], index.flip(0)[:, 1:4]):
        assert torch.equal(element_words(7, 3, piece.contiguous()), whole.view(-1)[piece])
    groups = torch.arange(4 * 6 * 2).view(4, 6, 2)
    assert torch.equal(row_words(7, 3, groups), whole.view(4, 6, 8))
    assert torch.equal(row_words(7, 3, groups[2:]), whole[2:])


def test_draws_seeds_and_substreams_differ() -> None:
    index = torch.arange(1024)
    base = element_words(7, 3, index)
    for other in (element_words(8, 3, index), element_words(7, 4, index), element_words(7, 3, index, sub=1)):
        assert (base == other).float().mean() < 0.01
    assert int(base.min()) >= 0 and int(base.max()) < 2 ** 32


def test_samplers_draw_their_distributions() -> None:
    x = torch.ones(256, 512)
    with autopar.random.stream(1):
        dropped = torch.nn.functional.dropout(x, 0.1, True)
        u = torch.rand_like(x)
        z = torch.randn_like(x)
        b = torch.bernoulli(torch.full_like(x, 0.3))
        bf = torch.rand(1 << 16, dtype=torch.bfloat16)
    assert abs((dropped == 0).float().mean().item() - 0.1) < 0.005
    assert torch.allclose(dropped[dropped != 0], torch.tensor(1 / 0.9))
    assert abs(u.mean().item() - 0.5) < 0.005 and 0.0 <= u.min().item() and u.max().item() < 1.0
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1.0) < 0.01
    assert abs(b.mean().item() - 0.3) < 0.005
    assert bf.max().item() < 1.0  # rounding to bf16 never reaches 1


def test_stream_continues_across_blocks_and_replays_from_a_state() -> None:
    x = torch.ones(8, 8)
    s = autopar.random.stream(5)
    with s:
        first = torch.rand_like(x)
    state = s.get_state()
    with s:
        second = torch.rand_like(x)
    s.set_state(state)
    with s:
        again = torch.rand_like(x)
    assert not torch.equal(first, second) and torch.equal(second, again)
    with autopar.random.stream(5):
        assert torch.equal(torch.rand_like(x), first)


# The draws that run (``runtime.philox_eager`` on CPU, ``runtime.philox_triton`` on CUDA)
# against the reference above, on regions of every kind a rank's piece makes.

REGIONS = [
    Region((3 * CHUNK + 8,), (1,), 0),  # whole, grouped: full chunks and a short one
    Region((5, 40), (100, 1), 8),  # rows, grouped
    Region((2, 3, 5, 12), (1000, 200, 30, 1), 28),  # three outer dims
    Region((7, 30), (50, 3), 1),  # one counter per element
    Region((9, 13), (1 << 33, 1), (1 << 34) - 5),  # counters past 2^32, a row straddling it
]
FINISHES: list[tuple[Finish, torch.dtype, dict[str, int]]] = [
    ("words", torch.int64, {}), ("below", torch.bool, {"threshold": 3 << 30}),
    ("below", torch.float32, {"threshold": 1 << 32}), ("uniform", torch.float32, {"bits": 24}),
    ("uniform", torch.float64, {"bits": 32}),
]
SEED, DRAW = (1 << 64) - 3, (1 << 40) + 5


def _reference(region: Region, sub: int) -> torch.Tensor:
    index = torch.tensor(region.offset)
    for d, (n, s) in enumerate(zip(region.sizes, region.strides)):
        index = index + (torch.arange(n) * s).view([n if i == d else 1 for i in range(len(region.sizes))])
    return element_words(SEED, DRAW, index.reshape(-1), sub)


def _high(sub: int) -> tuple[int, int]:
    return DRAW & MASK, (DRAW >> 32) | (sub << 31)


@pytest.mark.parametrize("region", REGIONS, ids=lambda r: "x".join(map(str, r.sizes)))
def test_eager_draw_is_the_reference(region: Region) -> None:
    """Every finish of the chunked eager draw is the reference's words, finished alike."""
    for sub in (0, 1):
        words = _reference(region, sub)
        for finish, dtype, kw in FINISHES:
            out = torch.empty(region.numel, dtype=dtype)
            philox_eager.draw((SEED & MASK, SEED >> 32), _high(sub), region, finish, out, **kw)
            if finish == "words":
                want = words
            elif finish == "below":
                want = (words < kw["threshold"]).to(dtype)
            else:
                want = (words >> (32 - kw["bits"])).to(dtype) * 2.0 ** -kw["bits"]
            assert torch.equal(out, want), (finish, dtype, sub)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("region", [*REGIONS[:4], Region((CHUNK * 2 + 12,), (1,), 0), Region((200, 100), (100, 1), 0)],
                         ids=lambda r: "x".join(map(str, r.sizes)))
def test_eager_draw_runs_the_ops_it_is_priced_at(region: Region) -> None:
    """``cost.draws`` prices the eager draw by ``eager_draw_ops``: the ops it dispatches."""
    for finish, dtype, kw in FINISHES[:2] + FINISHES[3:4]:
        out = torch.empty(region.numel, dtype=dtype)
        with _Count() as count:
            philox_eager.draw((1, 2), (3, 4), region, finish, out, **kw)
        assert count.ops == eager_draw_ops(region, finish)[0], finish


def test_fused_kernel_is_the_eager_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernel, run by Triton's interpreter on CPU tensors (where triton is installed;
    on a GPU it compiles the same kernel), writes the eager draw's bits."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    philox_triton._kernel.cache_clear()
    try:
        for region in (REGIONS[1], REGIONS[3], REGIONS[4]):
            for finish, dtype, kw in FINISHES[1:2] + FINISHES[3:4]:
                want, got = torch.empty(region.numel, dtype=dtype), torch.empty(region.numel, dtype=dtype)
                philox_eager.draw((SEED & MASK, SEED >> 32), _high(1), region, finish, want, **kw)
                philox_triton.draw(SEED, _high(1), region, finish, got, **kw)
                assert torch.equal(got, want), (region, finish)
    finally:
        philox_triton._kernel.cache_clear()  # a later GPU run compiles, not interprets
