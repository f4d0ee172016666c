"""Ring attention (issue 11 point 1b): its schedule, its runtime against one device on threads
(``ring_threads``: ``runtime.ring`` itself, its backward's dK/dV travelling), its pricing by
hand and the solver choosing it. Numerics on forked gloo ranks: ``test_numerics_context``."""

from __future__ import annotations

import pytest
import torch
from ring_threads import ThreadRing, run_threads
from test_numerics_context import build as build_attention_lm
from torch.distributed.tensor import Shard

import autopar
from autopar.capture.graph import TensorMeta
from autopar.cost.collectives import CollectiveCall, collective_time
from autopar.cost.compute import BACKWARD_FACTOR, ring_step_flops, roofline_time
from autopar.cost.precision import get_precision
from autopar.cost.ring import ring_transfers
from autopar.rules.attention import query_positions
from autopar.rules.ring import DIAGONAL, FULL, SEND_RECV, Piece, busiest_steps, step_pieces
from autopar.rules.strategy import OpCall, Strategy
from autopar.runtime.ring import ring_call

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
RING = (Shard(2),)


@pytest.mark.parametrize("n,zigzag,causal,gqa,masked", [(4, True, True, False, True), (4, False, False, True, True),
                                                        (3, False, True, True, False)],
                         ids=["cp4-zigzag-causal-padding", "cp4-gqa-padding", "cp3-causal-gqa"])
def test_ring_equals_the_whole_call(n: int, zigzag: bool, causal: bool, gqa: bool, masked: bool) -> None:
    """Each rank's rows and its q, k, v gradients equal those of the whole call (fp64), and
    each rank sends n-1 blocks forward, 2n-1 backward (K/V n-1 times, dK/dV n times)."""
    length, gen = 4 * n, torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, length, 4, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, 1 if gqa else 2, length, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    mask = None
    if masked:  # a padding mask: keys 1 and 5 unseen by every query (the rows still see key 0)
        mask = torch.ones(1, 1, 1, length, dtype=torch.bool)
        mask[..., [1, 5]] = False
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = SDPA(*whole, mask, 0.0, causal, enable_gqa=gqa)
    grad = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    want_grads = torch.autograd.grad(want, whole, grad)
    axes, ring = frozenset({0}) if zigzag else frozenset(), ThreadRing(n)

    def rank(i: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        positions = query_positions(length // n, 2, RING, (n,), (i,), axes)
        mine = [t.index_select(2, positions).requires_grad_() for t in (q, k, v)]
        out = ring_call(ring.link(i), SDPA, (*mine, mask, 0.0, causal), {"enable_gqa": gqa}, "S(2)", "S(2)", (n,),
                        (i,), 0, axes)
        return positions, out, torch.autograd.grad(out, mine, grad.index_select(2, positions))
    for positions, out, grads in run_threads(n, rank):
        torch.testing.assert_close(out, want.index_select(2, positions))
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected.index_select(2, positions))
    for i in range(n):
        phases = [phase for r, phase, _ in ring.log if r == i]
        assert (phases.count("forward"), phases.count("backward")) == (n - 1, 2 * n - 1)


def test_step_pieces_skip_blocks_after_the_rows() -> None:
    """Zig-zag on 2 ranks, 8 tokens in chunks of 2: rank 0 holds positions 0-1 and 6-7. Against
    its own block: both diagonals and chunk 3 after chunk 0; against rank 1's (2-3, 4-5): only
    chunk 3's rows, after both."""
    mine = torch.tensor([0, 1, 6, 7])
    assert step_pieces(mine, 2, mine, 2, causal=True) == [Piece(0, 2, 0, 2, DIAGONAL), Piece(2, 2, 0, 2, FULL),
                                                          Piece(2, 2, 2, 2, DIAGONAL)]
    assert step_pieces(mine, 2, torch.tensor([2, 3, 4, 5]), 2, causal=True) == [Piece(2, 2, 0, 2, FULL),
                                                                               Piece(2, 2, 2, 2, FULL)]
    assert step_pieces(mine, 2, torch.tensor([2, 3, 4, 5]), 2, causal=False) == [Piece(0, 4, 0, 4, FULL)]


@pytest.mark.parametrize("n, zigzag", [(2, False), (2, True), (4, False), (4, True), (8, True)])
def test_step_pieces_are_the_pairs_each_query_attends(n: int, zigzag: bool) -> None:
    """Every rank's pieces against every block, found from runs of positions, cover exactly the (query,
    key) pairs a causal mask keeps (brute-forced per pair); a diagonal piece is the same positions on
    both sides, a full one holds no masked pair."""
    placements, zig = (Shard(2),), frozenset({0}) if zigzag else frozenset()
    chunk = 16 // n // (2 if zigzag else 1)
    held = [query_positions(16 // n, 2, placements, (n,), (r,), zig) for r in range(n)]
    for q in held:
        for k in held:
            kept = {(i, j) for i in range(len(q)) for j in range(len(k)) if k[j] <= q[i]}
            covered: set[tuple[int, int]] = set()
            for piece in step_pieces(q, chunk, k, chunk, causal=True):
                rect = {(piece.q_first + a, piece.k_first + b) for a in range(piece.q_count)
                        for b in range(piece.k_count)}
                if piece.mode == FULL:
                    assert rect <= kept
                if piece.mode == DIAGONAL:
                    assert torch.equal(q[piece.q_first:piece.q_first + piece.q_count],
                                       k[piece.k_first:piece.k_first + piece.k_count])
                covered |= rect & kept
                assert len(rect & kept) == piece.pairs() or piece.mode != DIAGONAL
            assert covered == kept


def test_busiest_steps_by_hand() -> None:
    """8 causal tokens on 2 ranks. Contiguous: step 0 both ranks their diagonal (4 x 5 / 2 = 10
    pairs), step 1 rank 1 the whole of rank 0's block (16), rank 0 nothing: 10 + 16 = 26 of the
    36 pairs. Zig-zag: step 0 two diagonals of 3 and a chunk of 4 (10, three pieces), step 1 two
    chunks (8, two pieces): 18, exactly half."""
    contiguous = busiest_steps(8, 2, RING, RING, (2,), 0, True, frozenset())
    zigzag = busiest_steps(8, 2, RING, RING, (2,), 0, True, frozenset({0}))
    assert contiguous == ((10, 1), (16, 1)) and zigzag == ((10, 3), (8, 2))


def test_ring_pricing_by_hand() -> None:
    """Non-causal q, k, v [1, 2, 8, 4] fp32 on cp=2: each step 4 rows x 4 keys, 4 x 2 heads x
    4 dims FLOPs a pair = 512 FLOPs; the block sent is K and V of 4 tokens, 2 x 128 bytes.
    Forward one send, waited for beyond the step's compute; backward the K/V send and, at
    step 1, the dK/dV send beside BACKWARD_FACTOR x the compute, then the last dK/dV whole."""
    mesh = autopar.Mesh({"cp": 2}, "h100")
    meta = TensorMeta((1, 2, 8, 4), torch.float32)
    call = OpCall(SDPA, (meta, meta, meta), {}, (meta,))
    strategy = Strategy(((Shard(2),),), ((Shard(2),), (Shard(2),), (Shard(2),)))
    precision = get_precision("fp32", torch.float32)
    assert ring_step_flops(call, strategy, 2, mesh) == [512.0, 512.0]
    block = CollectiveCall(SEND_RECV, 0, 256)
    bandwidth = mesh.hardware.bus_bandwidth_of(SEND_RECV, True) or mesh.link(0).bandwidth  # measured, else the link's
    t = mesh.hardware.collective_overhead + mesh.link(0).latency + 256 / bandwidth
    assert collective_time(block, mesh) == pytest.approx(t)
    c = roofline_time(512.0, 0.0, mesh, precision)
    transfers = ring_transfers(call, strategy, mesh, precision, train=True)
    assert [(r.phase, r.call) for r in transfers] == [("forward", block)] + [("backward", block)] * 3
    waited = [r.waited for r in transfers]
    assert waited == pytest.approx([(t - c) / t, (t - BACKWARD_FACTOR * c) / t,
                                    (2 * t - BACKWARD_FACTOR * c) / (2 * t), 1.0])


def test_the_pin_is_checked() -> None:
    model, inputs, loss_fn, targets = build_attention_lm(None, masked=True)
    with pytest.raises(autopar.InputError, match="context_attention is 'ring', 'allgather', 'ulysses' or None"):
        autopar.plan(model, autopar.Mesh({"cp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     context_axes=("cp",), context_attention="heads")
