"""Node pricing: the work one rank does under a strategy, checked against hand-computed figures."""

from __future__ import annotations

import operator

import pytest
import torch

import autopar
from autopar.capture.graph import TensorMeta
from autopar.cost import get_precision
from autopar.cost.collectives import ALL_REDUCE, CollectiveCall, call_time, collective_time, transfer_time
from autopar.cost.compute import VIEW_OPS
from autopar.cost.model import CostContext, NodeCost, op_cost, parameter_cost
from autopar.hardware import get_profile
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
    """The fixed cost of one kernel-running op in a step: forward, and backward when training.
    These matmuls and adds run far longer than it on h100, which dispatches ahead: hidden."""
    hw = ctx.mesh.hardware
    return 0.0 if hw.overlapped_dispatch else hw.op_overhead + ctx.train * hw.backward_op_overhead


def _step(ctx: CostContext, work: float) -> float:
    """An op's seconds in a step from its forward work, by hand: backward is twice the work;
    each phase pays its fixed cost, hidden behind longer work where dispatch runs ahead."""
    hw = ctx.mesh.hardware
    phases = [(work, hw.op_overhead)] + ([(2 * work, hw.backward_op_overhead)] if ctx.train else [])
    return sum(max(w, f) if hw.overlapped_dispatch else w + f for w, f in phases)


def _roofline(ctx: CostContext, flops: float, nbytes: float, efficiency: float | None = None) -> float:
    hw = ctx.mesh.hardware
    peak = hw.peak_flops_bf16 if ctx.precision.name == "bf16" else hw.peak_flops_fp32
    efficiency = hw.compute_efficiency if efficiency is None else efficiency
    return max(flops / (peak * efficiency), nbytes / (hw.memory_bandwidth * hw.memory_efficiency))


def _mm_time(ctx: CostContext, ways: int = 1) -> float:
    """One rank's share (1/ways) of an 8192^3 bf16 matmul, forward + backward (2x forward), by
    hand: its FLOPs at the profile's matmul efficiency for that many FLOPs per call."""
    flops = 2.0 * N**3 / ways
    efficiency = ctx.mesh.hardware.matmul_curve("bf16")(flops)
    return 3 * _roofline(ctx, flops, 3 * N * N * 2 / ways, efficiency)


def _whole_mm_time(ctx: CostContext) -> float:
    """8192^3 bf16 matmul on one H100: 2 N^3 = 1.1e12 FLOPs at 989 TFLOP/s x 0.681 (the measured
    maximum sustained, ``hardware.gpus``) is 1.632 ms forward, 4.896 ms a step."""
    return _mm_time(ctx)


def test_partial_input_matmul_is_whole_work() -> None:
    """mm(Partial, Replicate) -> Partial: every rank multiplies the whole (partial) matrix."""
    ctx = _ctx({"tp": 8})
    whole = _whole_mm_time(ctx)
    assert whole == pytest.approx(4.896e-3, rel=1e-3)
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
    assert cost.time == pytest.approx(_mm_time(ctx, 8) + _fixed(ctx), rel=1e-9)


def test_two_mesh_dims_divide_by_the_split_ones_only() -> None:
    """dp=2 x tp=4: rows split on dp, Partial in on tp: each rank does half the matmul."""
    ctx = _ctx({"dp": 2, "tp": 4})
    cost = op_cost(_mm(), Strategy(((S(0), P),), ((S(0), P), (R, R))), ctx)
    assert cost.time == pytest.approx(_mm_time(ctx, 2) + _fixed(ctx), rel=1e-9)


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
    assert cost.time == pytest.approx(_step(ctx, _roofline(ctx, 2**24 / ways, 2**24 * 2 / ways)), rel=1e-9)


# Fixed costs per op, per optimizer parameter and per collective call (issue 7, item 18).

def _tiny_add() -> OpCall:
    x = TensorMeta((4, 16), torch.float32)
    return OpCall(aten.add.Tensor, (x, x), {}, (x,))


def test_cpu_op_pays_its_fixed_costs_on_top_of_its_work() -> None:
    """On the cpu profile the host runs each op itself: dispatch and work add up."""
    ctx = CostContext(mesh=autopar.Mesh({"dp": 2}, "cpu"), precision=get_precision("fp32"), train=True)
    hw = ctx.mesh.hardware
    work = _roofline(ctx, 64, 3 * 64 * 4)
    cost = op_cost(_tiny_add(), Strategy(((R,),), ((R,), (R,))), ctx)
    assert cost.time == pytest.approx(3 * work + hw.op_overhead + hw.backward_op_overhead, rel=1e-9)
    assert hw.op_overhead > 0 and hw.backward_op_overhead > 0


def test_gpu_op_costs_at_least_its_dispatch() -> None:
    """On a GPU a tiny op takes its dispatch time, forward and backward (2-6 us steps for
    whole tiny models were the symptom); splitting it does not make it cheaper."""
    ctx = _ctx({"tp": 8})
    hw = ctx.mesh.hardware
    whole = op_cost(_tiny_add(), Strategy(((R,),), ((R,), (R,))), ctx).time
    split = op_cost(_tiny_add(), Strategy(((S(0),),), ((S(0),), (S(0),))), ctx).time
    assert whole == pytest.approx(hw.op_overhead + hw.backward_op_overhead, rel=1e-9)
    assert split == whole


@pytest.mark.parametrize("target, args, out", [
    (aten.view.default, (TensorMeta((4, 16), torch.float32), [64]), TensorMeta((64,), torch.float32)),
    (operator.getitem, ((TensorMeta((4, 16), torch.float32), TensorMeta((4, 16), torch.float32)), 0),
     TensorMeta((4, 16), torch.float32)),
])
def test_views_and_getitem_are_free(target, args, out) -> None:
    ctx = CostContext(mesh=autopar.Mesh({"dp": 2}, "cpu"), precision=get_precision("fp32"), train=True)
    call = OpCall(target, args, {}, (out,))
    strategy = Strategy(((R,),), tuple((R,) for _ in call.tensor_inputs))
    assert op_cost(call, strategy, ctx) == NodeCost(0.0, 0.0)


def test_integer_op_has_no_backward() -> None:
    ctx = CostContext(mesh=autopar.Mesh({"dp": 2}, "cpu"), precision=get_precision("fp32"), train=True)
    out = TensorMeta((64,), torch.int64)
    cost = op_cost(OpCall(aten.arange.default, (64,), {}, (out,)), Strategy(((R,),), ()), ctx)
    assert cost.time == pytest.approx(_roofline(ctx, 64, 64 * 8) + ctx.mesh.hardware.op_overhead, rel=1e-9)


def test_optimizer_pays_a_fixed_cost_per_parameter() -> None:
    """AdamW's per-tensor loop on CPU: a fixed cost per parameter besides the update's bytes."""
    ctx = CostContext(mesh=autopar.Mesh({"dp": 2}, "cpu"), precision=get_precision("fp32"), train=True)
    hw = ctx.mesh.hardware
    meta = TensorMeta((16,), torch.float32)
    update = _roofline(ctx, 10 * 16, 2 * 16 * 16)
    assert parameter_cost(meta, (R,), ctx).time == pytest.approx(update + hw.optimizer_param_overhead, rel=1e-9)


@pytest.mark.parametrize("hardware", ["cpu", "h100"])
def test_collective_call_pays_its_fixed_cost(hardware: str) -> None:
    mesh = autopar.Mesh({"tp": 4}, hardware)
    hw, link = mesh.hardware, mesh.link(0)
    call = CollectiveCall(ALL_REDUCE, 0, 4096)
    bandwidth = hw.bus_bandwidth_of(ALL_REDUCE, link.intra_node) or link.bandwidth  # measured, else the link's
    ring = 6 * link.latency + 2 * 3 / 4 * 4096 / bandwidth
    # the fixed cost adds even where the host dispatches ahead: a bucket of gradients then
    # splits linearly into one call's cost plus each gradient's transfer
    assert collective_time(call, mesh) == pytest.approx(ring + hw.collective_overhead, rel=1e-9)
    assert hw.collective_overhead > 0
    assert call_time(ALL_REDUCE, 0, mesh) + transfer_time(call, mesh) == pytest.approx(collective_time(call, mesh))


def test_tiny_model_step_on_h100_is_bound_by_dispatch() -> None:
    """A tiny MLP's step costs at least one dispatch per kernel-running op, forward and
    backward, not the 2-6 us its FLOPs and bytes would take."""
    from torch import nn

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, "h100"), (torch.randn(16, 8),), loss_fn=lambda y: y.sum())
    kernel_ops = [n for n in plan.nodes if n.op.startswith("aten.") and n.op not in
                  {str(t) for t in VIEW_OPS}]
    hw = get_profile("h100")
    # two linears, relu, sum, each with a backward; the input's cast to bf16 (the compute copy's
    # entry, as compile runs it) has none: no gradient reaches an input
    assert sum(n.backward_s > 0 for n in kernel_ops) >= 4
    assert plan.predicted.step_time_s >= sum(hw.op_overhead + (hw.backward_op_overhead if n.backward_s else 0.0)
                                             for n in kernel_ops)
