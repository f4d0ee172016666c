"""Gradient synchronization: priced once per parameter and per bucket, by the same functions
in the ILP and the plan, and run as planned (buckets cut exactly; an incomplete bucket is an
error on every rank, never a silent skip)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel

import autopar
from autopar.api.planning import plan_step
from autopar.cost.buckets import BucketSlice, GradBucket, gradient_buckets
from autopar.cost.model import op_cost
from autopar.hardware import get_profile
from autopar.runtime.forked import run_ranks
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.ops import Comm
from examples import gpt, llama
from tests.planning import assert_one_price


def test_buckets_are_cut_at_exact_byte_boundaries() -> None:
    # 8 elements of 4 bytes per bucket; backward order is reverse parameter order
    params = [("a", 10, frozenset({0})), ("b", 7, frozenset({0, 1})), ("c", 5, frozenset({1}))]
    buckets = gradient_buckets(params, itemsize=4, cap=32)
    assert buckets == [
        GradBucket(0, (BucketSlice("b", 0, 7), BucketSlice("a", 0, 1)), 32),
        GradBucket(0, (BucketSlice("a", 1, 9),), 32),
        GradBucket(0, (BucketSlice("a", 9, 10),), 4),
        GradBucket(1, (BucketSlice("c", 0, 5), BucketSlice("b", 0, 3)), 32),
        GradBucket(1, (BucketSlice("b", 3, 7),), 16),
    ]
    assert sum(b.mesh_dim == 0 for b in buckets) == math.ceil(17 * 4 / 32)
    with pytest.raises(ValueError, match="whole number"):
        gradient_buckets(params, itemsize=4, cap=30)


def _tied_gpt() -> tuple[Any, ...]:
    model, inputs, loss_fn, targets = gpt.build(batch=64)
    model.lm_head.weight = model.wte.weight
    return model, inputs, loss_fn, targets


def _frozen(built: tuple[Any, ...], prefix: str) -> tuple[Any, ...]:
    for name, p in built[0].named_parameters():
        p.requires_grad_(not name.startswith(prefix))
    return built


VARIANTS = {
    "gpt-free": (gpt.build, {}),
    "llama-free": (llama.build, {}),
    "gpt-dp": (gpt.build, {"data_axes": ("dp",)}),
    # the tied table reaches the loss through the embedding and the colwise head: two
    # consumers sending its gradient back in different placements, one sync
    "gpt_tied-tp": (_tied_gpt, {"constraints": {**gpt.TP_PLAN, "lm_head": ColwiseParallel()}}),
    "gpt-tp_sp-dp-small_buckets": (gpt.build, {"constraints": gpt.TP_SP_PLAN, "data_axes": ("dp",),
                                               "bucket_bytes": 65536}),
    "llama-dp-small_buckets": (llama.build, {"data_axes": ("dp",), "bucket_bytes": 16384}),
    # one of two repeated layers frozen: the layers must not fold together
    "llama-partly_frozen": (lambda: _frozen(llama.build(), "layers.0."), {}),
    # inputs passed split: the loss sums its count with a collective of its own
    "gpt-tp-input_sharded": (gpt.build, {"constraints": gpt.TP_PLAN, "data_axes": ("dp",), "input_sharded": True}),
}


@pytest.mark.parametrize("hardware", ["cpu", "h100"])
@pytest.mark.parametrize("axes", [pytest.param({"dp": 2, "tp": 2}, id="2x2"),
                                  pytest.param({"dp": 2, "tp": 4}, id="2x4", marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_objective_equals_prediction(variant: str, axes: dict[str, int], hardware: str) -> None:
    build, kwargs = VARIANTS[variant]
    model, inputs, loss_fn, targets = build()
    plan = autopar.plan(model, autopar.Mesh(axes, hardware), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=False, **kwargs)
    assert plan.solver["status"] == "optimal"
    assert_one_price(plan)
    assert plan.predicted.step_time_s == pytest.approx(plan.predicted.compute_time_s + plan.predicted.comm_time_s)


def test_gradient_sync_by_hand_for_a_tiny_mlp() -> None:
    """Two linears on dp=2 (cpu profile, fp32), data parallel: one bucket holding every
    gradient, all-reduced once, plus the 4-byte loss all-reduce; times from the ring formula."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(16, 8),), loss_fn=lambda y: y.sum(),
                        data_axes=("dp",))
    grad_bytes = (8 * 16 + 16 + 16 * 4 + 4) * 4
    hw = get_profile("cpu")
    alpha, bandwidth = hw.intra_node_latency, hw.intra_node_bandwidth * hw.network_efficiency
    # all-reduce, n = 2: the call's fixed cost, 2(n-1) ring steps, 2(n-1)/n M bytes sent
    ring = {b: hw.collective_overhead + 2 * alpha + b / bandwidth for b in (grad_bytes, 4)}
    got = sorted((c.kind, c.phase, c.bytes, c.consumer == "") for c in plan.collectives)
    assert got == [("all_reduce", "backward", grad_bytes, True), ("all_reduce", "forward", 4, False)]
    assert plan.predicted.comm_time_s == pytest.approx(ring[grad_bytes] + ring[4], rel=1e-12)
    assert plan.predicted.comm_bytes == {"dp": pytest.approx(grad_bytes + 4)}
    assert [b.params for b in plan.grad_buckets] == [tuple(f"p_model_{n}" for n in
                                                           ("2_bias", "2_weight", "0_bias", "0_weight"))]


def test_tied_parameter_is_synchronized_once() -> None:
    model, inputs, loss_fn, targets = _tied_gpt()
    mesh = autopar.Mesh({"dp": 2, "tp": 4}, "cpu")
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                        constraints={**gpt.TP_PLAN, "lm_head": ColwiseParallel()})
    table = "p_model_wte_weight"
    assert [b.mesh_dim for b in plan.grad_buckets if table in b.params] == [0]  # once, on dp
    # bytes reduced per axis: each synchronized parameter's local gradient, from its global
    # shape and placement as the plan prints them (fp32; a shard on tp holds a quarter)
    placed = {n.name: (math.prod(n.shapes[0]), n.outputs[0]) for n in plan.nodes if n.op == "parameter"}
    expected: dict[str, int] = defaultdict(int)
    for dim, axis in enumerate(mesh.axes):
        for name in {p for b in plan.grad_buckets if b.mesh_dim == dim for p in b.params}:
            numel, placement = placed[name]
            expected[axis] += numel // (4 if placement.endswith(")") else 1) * 4
    synced: dict[str, int] = defaultdict(int)
    for c in plan.collectives:
        if c.consumer == "":
            synced[c.axis] += c.bytes
    assert dict(synced) == dict(expected)
    assert_one_price(plan)


def test_frozen_parameters_cost_weights_only_and_are_not_synchronized() -> None:
    model, inputs, loss_fn, targets = gpt.build()
    frozen = {"wte.weight", "wpe.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        data_axes=("dp",))
    synced = {p for b in plan.grad_buckets for p in b.params}
    assert synced and not synced & {"p_model_wte_weight", "p_model_wpe_weight"}
    by_hand = sum(p.numel() * (4 if n in frozen else 16) for n, p in model.named_parameters())  # fp32, replicated
    assert plan.predicted.parameter_memory_bytes == by_hand


def _incomplete_bucket_rank(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    bucket = GradBucket(0, (BucketSlice("a", 0, 3), BucketSlice("b", 0, 2)), 20)
    GradSync([bucket], {"a": a, "b": b}, mesh, Comm(mesh))
    try:
        (a * (rank + 1)).sum().backward()  # b gets no gradient: its bucket cannot complete
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_bucket_that_cannot_complete_is_an_error_on_every_rank() -> None:
    for message in run_ranks(_incomplete_bucket_rank, 2):
        assert "no gradient arrived in this backward for b" in message


class Gated(nn.Module):
    """The gate reaches the loss only through a comparison: autograd gives it no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.a = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * (self.gate(x) > 0).float()


def test_parameters_behind_a_comparison_get_no_gradient_and_no_sync() -> None:
    plan = autopar.plan(Gated(), autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 8),),
                        loss_fn=lambda y: y.pow(2).sum(), data_axes=("dp",))
    synced = {p for b in plan.grad_buckets for p in b.params}
    assert synced == {"p_model_a_weight", "p_model_a_bias"}
    by_hand = (8 * 8 + 8) * 4 + (8 * 8 + 8) * 16  # the gate keeps its fp32 weights alone, a gets Adam state
    assert plan.predicted.parameter_memory_bytes == by_hand
    assert_one_price(plan)


def _gated_rank(rank: int, world: int) -> dict[str, Any]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    pm = autopar.compile(Gated(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x,),
                         loss_fn=lambda y: y.pow(2).sum(), data_axes=("dp",), pipeline=False)
    pm(x).backward()
    return {k: None if p.grad is None else p.grad.tolist() for k, p in pm.named_parameters()}


def test_a_step_whose_gate_gets_no_gradient_trains_like_one_device() -> None:
    model, x = Gated(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    for got in run_ranks(_gated_rank, 2):
        for name, p in model.named_parameters():
            if p.grad is None:
                assert got[name] is None, name
            else:
                torch.testing.assert_close(torch.tensor(got[name]), p.grad, rtol=1e-5, atol=1e-6)


def test_a_frozen_prefix_runs_no_backward() -> None:
    """Layers before the first trainable parameter run forward only: no backward op and no
    saved activation is priced for them (their outputs' consumers have no backward either)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    for p in model[0].parameters():
        p.requires_grad_(False)
    step = plan_step(model, autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(32, 64),), loss_fn=lambda y: y.sum())
    graph, ctx = step.graph, step.ctx
    first = next(n for n in graph.order if graph.nodes[n].op == "aten.linear.default")
    relu = next(n for n in graph.order if graph.nodes[n].op == "aten.relu.default")
    assert not graph.nodes[first].needs_grad and not graph.nodes[relu].needs_grad
    for name in (first, relu):
        node = graph.nodes[name]
        strategy = step.chosen[name]
        forward_only = op_cost(node.call, strategy, ctx, backward=False, saved=name == relu)
        assert node.costs[node.strategies.index(strategy)] == forward_only
    assert graph.nodes[relu].saved and not graph.nodes[first].saved  # the second linear keeps relu's output
