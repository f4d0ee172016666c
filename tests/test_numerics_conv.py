"""Convolutional models end to end: a CNN with batch norm and pooling, and a ViT-style
patch embedding, planned without fallbacks and compiled on forked gloo ranks, match one
device: loss, every gradient, parameters and batch norm's running statistics after 3
AdamW steps.

The tiny models' cheapest plans on the cpu profile replicate almost everything; planned
for a device whose network is nearly free and whose compute is slow, the solver splits
every op it can, so the compiled runs exercise the channel, group, batch and
contraction splits of the new rules (the test checks that they are used).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conv_models import build_cnn, build_patch_embed
from numerics_harness import ATOL, RTOL, Reference, check, reference, run_compiled
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.api.planning import plan_step
from autopar.errors import CaptureError
from autopar.capture import capture
from autopar.capture.export import _to_captured
from autopar.capture.step import StepSignature, TrainStep
from autopar.cost import get_precision
from autopar.cost.model import CostContext
from autopar.hardware import PROFILES
from autopar.rules import DEFAULT_RULES
from autopar.runtime.forked import run_ranks
from autopar.problem.folding import fold_repeated_blocks
from autopar.problem.constraints import Pin, apply_pins
from autopar.problem.graph import build_plan_graph
from autopar.solver.ilp import NoPlan, solve


SPLIT_HAPPY = dataclasses.replace(
    PROFILES["cpu"], name="split-happy", peak_flops_fp32=1e6, peak_flops_bf16=1e6, memory_bandwidth=1e6,
    intra_node_bandwidth=1e15, intra_node_latency=1e-12, inter_node_bandwidth=1e15, inter_node_latency=1e-12,
    collective_overhead=0.0)
"""Slow compute and a free network: every split the rules offer pays off."""

MODELS: dict[str, Callable[[], Any]] = {"cnn": build_cnn, "patch_embed": build_patch_embed}
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "dp2": ((2,), ("dp",)), "tp2": ((2,), ("tp",)), "2x2": ((2, 2), ("dp", "tp"))}
CASES = [(model, mesh, hardware, data) for model in MODELS for mesh in MESHES
         for hardware, data in (("cpu", False), ("split-happy", False), ("split-happy", True))
         if not data or "dp" in MESHES[mesh][1]]
COMPILED = [c for c in CASES if c[2] == "split-happy"]  # the cpu plans replicate almost everything


def _hardware(name: str) -> Any:
    return SPLIT_HAPPY if name == "split-happy" else name


def _check_running_stats_in_place(step: Any) -> None:
    """Every op writing an input in place (batch norm's running stats) takes it as produced."""
    for name, node in step.graph.nodes.items():
        for k in node.as_produced:
            src, idx = node.args[k]
            assert step.chosen[name].inputs[k] == step.chosen[src].outputs[idx], (name, src)


@pytest.mark.parametrize(("model", "mesh", "hardware", "data"), CASES)
def test_plan_has_no_fallbacks(model: str, mesh: str, hardware: str, data: bool) -> None:
    shape, names = MESHES[mesh]
    module, inputs, loss_fn, targets = MODELS[model]()
    step = plan_step(module, autopar.Mesh(dict(zip(names, shape)), _hardware(hardware)), inputs, loss_fn=loss_fn,
                     example_targets=targets, data_axes=("dp",) if data else ())
    assert step.plan.fallbacks == []
    _check_running_stats_in_place(step)
    if hardware == "split-happy":  # the compiled runs below must exercise the new rules' splits
        convs = [n for n in step.plan.nodes if "conv" in n.op]
        assert all(any(p not in ("R", "RR") for p in n.inputs) for n in convs), [(n.name, n.inputs) for n in convs]


CONV_SPLITS = {("S(0)", "R"): "batch", ("R", "S(0)"): "out-channels", ("S(1)", "S(0)"): "groups",
               ("S(1)", "S(1)"): "in-channels", ("P", "R"): "partial-x", ("R", "P"): "partial-weight"}


def test_split_happy_plans_use_the_conv_splits() -> None:
    """Across the compiled cases the convolutions run batch, output-channel, group and
    input-channel splits and take a Partial input, and training batch norm splits channels."""
    seen: set[str] = set()
    for model, mesh, hardware, data in CASES:
        if hardware != "split-happy":
            continue
        shape, names = MESHES[mesh]
        module, inputs, loss_fn, targets = MODELS[model]()
        plan = autopar.plan(module, autopar.Mesh(dict(zip(names, shape)), SPLIT_HAPPY), inputs, loss_fn=loss_fn,
                            example_targets=targets, data_axes=("dp",) if data else ())
        for node in plan.nodes:
            for axis in range(len(shape)):
                if "conv" in node.op:
                    seen.add(CONV_SPLITS.get((_at(node.inputs[0], axis), _at(node.inputs[1], axis)), "other"))
                if "batch_norm" in node.op:
                    seen.add(f"batch_norm-{_at(node.inputs[0], axis)}")
    # (not the input-channel contraction nor a Partial input: each writes the whole output,
    # or convolves the whole input, on every rank, so the output- or batch-split conv is
    # cheaper; those strategies are brute-forced, values and gradients, in test_rules_conv)
    assert {"batch", "out-channels", "groups", "batch_norm-S(1)"} <= seen, seen


def _at(placements: str, axis: int) -> str:
    """The placement on mesh axis ``axis`` of a compact string such as ``S(0)R``."""
    parts, i = [], 0
    while i < len(placements):
        end = placements.index(")", i) + 1 if placements[i] == "S" else i + 1
        parts.append(placements[i:end])
        i = end
    return parts[axis]


def test_running_stats_are_never_updated_in_a_copy() -> None:
    """Running stats replicated while batch norm splits channels would update a resharded
    copy and lose the update: the solver links a written input to its producer's
    placement, so with both pinned there is no plan (it used to plan the lost update)."""
    module, inputs, loss_fn, targets = build_cnn()
    mesh = autopar.Mesh({"tp": 2}, "cpu")
    ctx = CostContext(mesh=mesh, precision=get_precision("fp32"), train=True)
    graph = build_plan_graph(capture(module, inputs, loss_fn=loss_fn, example_targets=targets), DEFAULT_RULES, ctx)
    bn = next(n for n in graph.order if graph.nodes[n].op == "aten.batch_norm.default")
    running_mean = graph.nodes[bn].args[3][0]
    assert graph.nodes[running_mean].fqn == "bn.running_mean" and 3 in graph.nodes[bn].as_produced
    pins = {running_mean: Pin(output=Replicate(), reason="test"), bn: Pin(output=Shard(1), reason="test")}
    apply_pins(graph, pins, 0, "tp", 2)
    no_plan = solve(graph, fold_repeated_blocks(graph, pins), ctx, None)
    assert isinstance(no_plan, NoPlan) and no_plan.kind == "pins" and "no plan satisfies" in no_plan.message


def train_on_rank(rank: int, world: int, model: str, mesh: str, hardware: str, data: bool,
                  ref: Reference) -> dict[str, Any]:
    shape, names = MESHES[mesh]
    device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    module, inputs, loss_fn, targets = MODELS[model]()
    pm = autopar.compile(module, device_mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                         hardware=_hardware(hardware), data_axes=("dp",) if data else (), pipeline=False)
    return run_compiled(pm, (*inputs, *targets), ref)


@pytest.mark.parametrize(("model", "mesh", "hardware", "data"), COMPILED)
def test_compiled_step_matches_single_device(model: str, mesh: str, hardware: str, data: bool) -> None:
    """Parameters and buffers (running statistics, num_batches_tracked) after the steps."""
    ref = reference(MODELS[model])
    shape, _ = MESHES[mesh]
    check(run_ranks(train_on_rank, math.prod(shape), model, mesh, hardware, data, ref), ref)


def _eval_cnn() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The CNN in eval mode, its running statistics away from their initial 0 and 1."""
    module, inputs, _, _ = build_cnn()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        module.bn.running_mean.copy_(torch.rand(8, generator=gen) * 2 - 1)
        module.bn.running_var.copy_(torch.rand(8, generator=gen) + 0.5)
    return module.eval(), inputs


def _eval_on_rank(rank: int, world: int) -> dict[str, Any]:
    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    module, inputs = _eval_cnn()
    pm = autopar.compile(module, device_mesh, inputs, train=False, hardware=SPLIT_HAPPY, data_axes=("dp",),
                         pipeline=False)
    bn = next(n for n in pm.plan.nodes if n.op == "aten.batch_norm.default")
    return {"outputs": pm(*inputs).full_tensor().flatten().tolist(), "bn_input": bn.inputs[0]}


def test_eval_mode_batch_norm_splits_the_batch() -> None:
    """Eval-mode batch norm normalizes with the running statistics: elementwise per
    channel, so it runs split on the data axis (by batch or channel, whichever the cost
    model prefers) and gives one device's outputs."""
    module, inputs = _eval_cnn()
    with torch.no_grad():
        expected = module(*inputs).flatten()
    for rank, result in enumerate(run_ranks(_eval_on_rank, 4)):
        assert _at(result["bn_input"], 0) in ("S(0)", "S(1)"), result["bn_input"]
        torch.testing.assert_close(torch.tensor(result["outputs"]), expected, rtol=RTOL, atol=ATOL,
                                   msg=f"rank {rank}")


def test_capture_keeps_running_stat_updates_in_the_graph() -> None:
    """Export's training IR updates running stats inside batch_norm and bumps
    num_batches_tracked with add_, returning the loss alone: buffers are updated where
    they live. A functionalized program returns them as outputs instead, which is refused."""
    module, inputs, loss_fn, targets = build_cnn()
    captured = capture(module, inputs, loss_fn=loss_fn, example_targets=targets)
    ops = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    (bn,) = [n for n in ops if n.target is torch.ops.aten.batch_norm.default]
    (bump,) = [n for n in ops if n.target is torch.ops.aten.add_.Tensor]
    assert captured.buffers[bn.args[3].name] == "bn.running_mean" and bn.args[5] is True
    assert captured.buffers[bump.args[0].name] == "bn.num_batches_tracked"
    assert len(captured.gm.graph.output_node().args[0]) == 1
    step = TrainStep(module, loss_fn, 1, (), True)
    functional = torch.export.export(step, (*inputs, *targets), strict=False).run_decompositions()
    with pytest.raises(CaptureError, match="BUFFER_MUTATION"):
        _to_captured(functional, True, 0.0, StepSignature.of(tuple(inputs), {}, tuple(targets)))
