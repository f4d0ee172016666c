"""What an eager PyTorch step runs, priced against hand-computed figures (issue 31.2): the fp32 a
model's code upcasts to under mixed precision, views and metadata-only reads priced free, the
additions autograd runs to sum a value's gradients, torch's AdamW passes over the state, the
log-softmax inside ``cross_entropy_loss``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import autopar
from autopar.api.planning import plan_step
from autopar.capture.graph import TensorMeta
from autopar.cost.compute import op_bytes
from autopar.cost.model import CostContext, op_cost, parameter_cost
from autopar.cost.precision import PRECISIONS
from autopar.hardware import get_profile
from autopar.rules.strategy import OpCall, R, Strategy

aten = torch.ops.aten
H100 = get_profile("h100")
BANDWIDTH = H100.memory_bandwidth * H100.memory_efficiency
"""Bytes/s a memory-bound kernel reaches on the h100 profile: 3.35 TB/s x 0.89 = 2.98 TB/s."""
AS_RUN = replace(PRECISIONS["bf16"], captured_as_run=True)
"""Mixed precision with each float at the width the captured graph gives it."""
MiB = 2**20


def _ctx() -> CostContext:
    return CostContext(mesh=autopar.Mesh({"dp": 1}, H100), precision=AS_RUN, train=True)


class Upcast(nn.Module):
    """A linear whose output the model squares in fp32, as an eager RMSNorm does (``h = x.float()``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x).float().pow(2)


def test_plan_prices_a_floats_upcast_at_fp32_as_compile_runs_it() -> None:
    """``autopar.plan`` of an fp32 model in bf16 captures its bf16 compute copy, as ``compile`` does:
    the ``pow`` of ``x.float()`` reads and writes 4096 x 4096 fp32 elements, 2 x 64 MiB, not bf16's
    2 x 32 MiB (its forward: 134.2 MB / 2.98 TB/s = 45.0 us)."""
    d = 4096
    with torch.device("meta"):
        model, x = Upcast(d), torch.zeros(d, d)
    plan = autopar.plan(model, autopar.Mesh({"dp": 1}, "h100"), (x,), loss_fn=lambda y: y.sum(), pipeline=False)
    pow_node = next(n for n in plan.nodes if n.op == "aten.pow.Tensor_Scalar")
    assert pow_node.forward_s == pytest.approx(2 * 4 * d * d / BANDWIDTH, rel=1e-9)
    assert 2 * 4 * d * d / BANDWIDTH == pytest.approx(45.0e-6, rel=1e-3)


def test_views_and_metadata_reads_move_no_bytes() -> None:
    """``view_as_complex``/``view_as_real`` are views (0 bytes); ``x.type_as(y)`` reads y's dtype only:
    a 1024 x 1024 fp32 x cast to bf16 moves 4 MiB read + 2 MiB written, however large y is."""
    x, y = TensorMeta((1024, 1024), torch.float32), TensorMeta((1024, 1024), torch.bfloat16)
    cast = TensorMeta((1024, 1024), torch.bfloat16)
    assert op_bytes(aten.type_as.default, [x, y], (cast,), AS_RUN) == 6 * MiB
    pairs, complex_ = TensorMeta((1024, 512, 2), torch.float32), TensorMeta((1024, 512), torch.complex64)
    assert op_bytes(aten.view_as_complex.default, [pairs], (complex_,), AS_RUN) == 0
    assert op_bytes(aten.view_as_real.default, [complex_], (pairs,), AS_RUN) == 0


def test_a_complex_product_has_a_backward() -> None:
    """A rotary embedding's complex multiply (complex64 [4096, 4096] by a [1, 4096] table) runs a
    backward kernel as a real one does: forward 128 MiB read + 128 MiB written (+32 KiB of table),
    backward twice that, 3 x 268.5 MB / 2.98 TB/s = 270.2 us in all."""
    a, t = TensorMeta((4096, 4096), torch.complex64), TensorMeta((1, 4096), torch.complex64)
    call = OpCall(aten.mul.Tensor, (a, t), {}, (a,))
    cost = op_cost(call, Strategy(inputs=((R,), (R,)), outputs=((R,),)), _ctx())
    moved = 2 * 128 * MiB + 32 * 1024
    assert cost.time == pytest.approx(3 * moved / BANDWIDTH, rel=1e-9)
    assert cost.time == pytest.approx(270.2e-6, rel=1e-3)


class Fan(nn.Module):
    """One value read by three linears, as a norm's output feeds the q, k and v projections."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, d, bias=False)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        return self.q(h) + self.k(h) + self.v(h)


def test_a_value_read_three_times_sums_its_gradients_twice() -> None:
    """Autograd adds the three gradients of ``relu(up(x))`` into one: two adds of [4096, 4096] bf16,
    each reading 2 x 32 MiB and writing 32 MiB, 100.7 MB / 2.98 TB/s = 33.8 us, priced at the second
    and third readers (``k`` and ``v``), none at the first nor at a value read once."""
    d = 4096
    with torch.device("meta"):
        model, x = Fan(d), torch.zeros(d, d)
    step = plan_step(model, autopar.Mesh({"dp": 1}, "h100"), (x,), loss_fn=lambda y: y.sum(), pipeline=False)
    linears = {n.module: n for n in step.graph.nodes.values() if n.op == "aten.linear.default"}
    assert [linears[m].grad_sums for m in ("up", "q", "k", "v")] == [(), (), (1, 0), (1, 0)]
    assert all(n.grad_sums == () for n in step.graph.nodes.values() if n.op == "aten.add.Tensor")
    add = 3 * 32 * MiB / BANDWIDTH
    assert add == pytest.approx(33.76e-6, rel=1e-3)
    v = linears["v"]
    assert v.call is not None
    chosen = step.chosen[v.name]
    summed = op_cost(v.call, chosen, step.ctx, grad_sums=(1, 0)).time - op_cost(v.call, chosen, step.ctx).time
    assert summed == pytest.approx(add, rel=1e-9)


def test_adamw_streams_its_state_five_times_on_a_gpu() -> None:
    """torch's foreach AdamW over a 4096 x 4096 parameter's fp32 master, gradient, m and v (16 B per
    element): 20 accesses of 4 B, 80 B per element, 1.342 GB / 2.98 TB/s = 450.2 us; the cpu profile
    keeps its measured 2x (32 B per element)."""
    meta = TensorMeta((4096, 4096), torch.float32)
    update = parameter_cost(meta, (R,), _ctx()).time
    assert update == pytest.approx(80 * 4096**2 / BANDWIDTH, rel=1e-9)
    assert update == pytest.approx(450.2e-6, rel=1e-3)
    assert get_profile("cpu").optimizer_traffic == 2.0 and H100.optimizer_traffic == 5.0


def test_cross_entropy_writes_and_reads_back_its_log_softmax() -> None:
    """``cross_entropy_loss`` over [8, 128] fp32 logits and 8 int64 targets: reads 4096 + 64 B,
    writes its 4 B loss and the 4096 B log-softmax nll_loss picks from."""
    logits, targets, loss = (TensorMeta((8, 128), torch.float32), TensorMeta((8,), torch.int64),
                             TensorMeta((), torch.float32))
    assert op_bytes(aten.cross_entropy_loss.default, [logits, targets], (loss,), AS_RUN) == 4096 + 64 + 4 + 4096
