"""Node pricing: the work one rank does under a strategy, checked against hand-computed figures."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.capture.graph import TensorMeta
from autopar.cost import get_precision
from autopar.cost.model import CostContext, op_cost
from autopar.rules.strategy import OpCall, P, R, S, Strategy, strided

aten = torch.ops.aten
N = 8192
BF16 = torch.bfloat16


def _ctx(axes: dict[str, int], hardware: str = "h100", train: bool = True) -> CostContext:
    return CostContext(mesh=autopar.Mesh(axes, hardware), precision=get_precision("bf16"), train=train)


def _mm(m: int = N, k: int = N, n: int = N) -> OpCall:
    a, b = TensorMeta((m, k), BF16), TensorMeta((k, n), BF16)
    return OpCall(aten.mm.default, (a, b), {}, (TensorMeta((m, n), BF16),))


def _fixed(ctx: CostContext) -> float:
    """The fixed per-op cost one kernel-running op pays in a step (none is priced yet)."""
    return 0.0


def _roofline(ctx: CostContext, flops: float, nbytes: float) -> float:
    hw = ctx.mesh.hardware
    return max(flops / (hw.peak_flops_bf16 * hw.compute_efficiency),
               nbytes / (hw.memory_bandwidth * hw.memory_efficiency))


def _whole_mm_time(ctx: CostContext) -> float:
    """8192^3 bf16 matmul, forward + backward (2x forward) on one H100, by hand: 2 N^3 FLOPs
    at 989 TFLOP/s x 0.6 is 1.853 ms forward, 5.559 ms a step."""
    return 3 * _roofline(ctx, 2.0 * N**3, 3 * N * N * 2)


def test_partial_input_matmul_is_whole_work() -> None:
    """mm(Partial, Replicate) -> Partial: every rank multiplies the whole (partial) matrix."""
    ctx = _ctx({"tp": 8})
    whole = _whole_mm_time(ctx)
    assert whole == pytest.approx(5.559e-3, rel=1e-3)
    cost = op_cost(_mm(), Strategy(((P,),), ((P,), (R,))), ctx)
    assert cost.time == pytest.approx(whole + _fixed(ctx), rel=1e-9)


def test_replicated_matmul_is_whole_work() -> None:
    ctx = _ctx({"tp": 8})
    cost = op_cost(_mm(), Strategy(((R,),), ((R,), (R,))), ctx)
    assert cost.time == pytest.approx(_whole_mm_time(ctx) + _fixed(ctx), rel=1e-9)


@pytest.mark.parametrize("strategy", [
    Strategy(((S(0),),), ((S(0),), (R,))),            # rows split
    Strategy(((S(1),),), ((R,), (S(1),))),            # columns split
    Strategy(((P,),), ((S(1),), (S(0),))),            # contraction split: Partial output, 1/8 of the work
    Strategy(((strided(1, 2),),), ((R,), (strided(1, 2),))),  # strided columns: still 1/8 each
])
def test_split_matmul_divides_work(strategy: Strategy) -> None:
    ctx = _ctx({"tp": 8})
    cost = op_cost(_mm(), strategy, ctx)
    assert cost.time == pytest.approx(_whole_mm_time(ctx) / 8 + _fixed(ctx), rel=1e-9)


def test_two_mesh_dims_divide_by_the_split_ones_only() -> None:
    """dp=2 x tp=4: rows split on dp, Partial in on tp: each rank does half the matmul."""
    ctx = _ctx({"dp": 2, "tp": 4})
    cost = op_cost(_mm(), Strategy(((S(0), P),), ((S(0), P), (R, R))), ctx)
    assert cost.time == pytest.approx(_whole_mm_time(ctx) / 2 + _fixed(ctx), rel=1e-9)


def test_memory_bound_op_reads_and_writes_local_bytes() -> None:
    """add(Partial, Partial) -> Partial reads two whole tensors and writes one, on every rank;
    add(S(0), S(0)) -> S(0) one eighth of that."""
    ctx = _ctx({"tp": 8}, train=False)
    x = TensorMeta((N, N), BF16)
    call = OpCall(aten.add.Tensor, (x, x), {}, (x,))
    whole = _roofline(ctx, N * N, 3 * N * N * 2)
    partial = op_cost(call, Strategy(((P,),), ((P,), (P,))), ctx).time
    split = op_cost(call, Strategy(((S(0),),), ((S(0),), (S(0),))), ctx).time
    overhead = _fixed(ctx)
    assert partial == pytest.approx(whole + overhead, rel=1e-9)
    assert split == pytest.approx(whole / 8 + overhead, rel=1e-9)


def test_embedding_split_vocab_reads_its_shard_and_writes_whole_output() -> None:
    """Vocab-split embedding (weight S(0), ids R -> Partial): each rank reads 1/n of the table
    and all ids, and writes a whole (partial) output: memory-bound on local bytes."""
    ctx = _ctx({"tp": 8}, train=False)
    weight, ids = TensorMeta((32768, 4096), BF16), TensorMeta((8, 4096), torch.int64)
    out = TensorMeta((8, 4096, 4096), BF16)
    call = OpCall(aten.embedding.default, (weight, ids), {}, (out,))
    nbytes = 32768 * 4096 * 2 / 8 + 8 * 4096 * 8 + 8 * 4096 * 4096 * 2
    cost = op_cost(call, Strategy(((P,),), ((S(0),), (R,))), ctx)
    overhead = _fixed(ctx)
    assert cost.time == pytest.approx(_roofline(ctx, out.numel / 8, nbytes) + overhead, rel=1e-9)


@pytest.mark.parametrize("placement, ways", [(R, 1), (S(0), 8)])
def test_op_without_tensor_inputs_divides_by_its_output_split(placement, ways: int) -> None:
    """A factory builds only its local slice: split when its output is sharded, whole when replicated."""
    ctx = _ctx({"tp": 8}, train=False)
    out = TensorMeta((2**24,), torch.float32)
    call = OpCall(aten.arange.default, (2**24,), {}, (out,))
    cost = op_cost(call, Strategy(((placement,),), ()), ctx)
    overhead = _fixed(ctx)
    assert cost.time == pytest.approx(_roofline(ctx, 2**24 / ways, 2**24 * 2 / ways) + overhead, rel=1e-9)
