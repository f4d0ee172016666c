"""The counter-based generator (``autopar.runtime.philox``) against Random123's published
known-answer vectors, its index-addressability (any slice of the elements computes the
words the whole computes there), and the samplers' distributions on it."""

from __future__ import annotations

import pytest
import torch

import autopar
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
