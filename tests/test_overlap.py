"""Prefetched parameter gathers: priced per overlap window (``autopar.solver.overlap``) and
run that way (``autopar.passes.prefetch_gathers``, ``autopar.runtime.regather``).

Pricing, on two identical blocks by hand: block 0's gathers and block 1's regathers wait in
full; block 1's gathers hide under block 0's forward and block 0's regathers under block
1's backward, each up to eff x that compute (exposed = max(0, comm - eff x compute)); the
ILP's objective is the plan's predicted step time. Running: block i+1's gathers are issued
before block i's first op, block i's regathers when block i+1's backward starts (whether
block i+1 gathers its own again or holds them), and what runs is what the plan lists
(``numerics_harness``), with the single-device numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api.planning import plan_step
from tests.planning import solved, assert_one_price
from autopar.hardware import PROFILES
from autopar.passes.prefetch_gathers import first_compute
from autopar.problem.block_paths import block_of
from autopar.solver.overlap import plan_windows
from examples import gpt
import backward_prefetch
from tiny_models import Stack
from numerics_harness import STEPS, Reference, reference, run_checked, run_compiled


def _block_figures(step: Any) -> dict[str, dict[str, float]]:
    """Per block: forward gathers G, backward regathers R (from the plan's collectives) and
    forward / backward compute F, B (the chosen strategies' costs), in seconds per step."""
    blocks = dict.fromkeys(b for n in step.graph.order if (b := block_of(step.graph.nodes[n].module)) is not None)
    out = {b: {"G": 0.0, "R": 0.0, "F": 0.0, "B": 0.0} for b in blocks}
    for c in step.plan.collectives:
        block = block_of(c.module)
        if block in out and c.kind == "all_gather" and step.graph.nodes[c.tensor].kind == "param":
            out[block]["G" if c.phase == "forward" else "R"] += c.time_s * c.count
    for name in step.graph.order:
        node = step.graph.nodes[name]
        block = block_of(node.module)
        if node.kind == "op" and block in out:
            cost = node.costs[node.strategies.index(step.chosen[name])]
            out[block]["F"] += cost.forward
            out[block]["B"] += cost.time - cost.forward
    return out


@pytest.mark.parametrize("eff", [0.0, 0.05, 0.8])
def test_windows_hide_gathers_behind_the_neighbouring_block(eff: float) -> None:
    hw = dataclasses.replace(PROFILES["h100"], grad_sync_overlap=eff)
    d = 256
    step = plan_step(Stack(d), autopar.Mesh({"dp": 2}, hardware=hw), (torch.randn(64, d),), loss_fn=F.mse_loss,
                     example_targets=(torch.randn(64, d),), zero={"dp": 3}, data_axes=("dp",), pipeline=False)
    plan = step.plan
    assert plan.solver["folded_blocks"] == {"layers": 2} and plan.grad_buckets == []
    fig = _block_figures(step)
    b0, b1 = fig["layers.0"], fig["layers.1"]
    assert b0 == b1 and b0["F"] > 0
    if eff:  # with nothing hidden the plan splits the weights as tensor parallelism does: no gathers
        assert b0["G"] > 0 and b0["R"] > 0
    hidden = (b1["G"] - max(0.0, b1["G"] - eff * b0["F"])) + (b0["R"] - max(0.0, b0["R"] - eff * b1["B"]))
    scatters = sum(c.time_s for c in plan.collectives if c.phase == "backward" and c.kind == "reduce_scatter")
    assert scatters > 0 or not eff  # each weight's gradient, reduce-scattered beside the rest of backward
    hidden += _beside(step, eff)
    total_comm = sum(c.time_s * c.count for c in plan.collectives)
    pred = plan.predicted
    assert pred.hidden_comm_time_s == pytest.approx(hidden, rel=1e-9, abs=1e-15)
    assert pred.comm_time_s == pytest.approx(total_comm - hidden, rel=1e-9)
    assert pred.step_time_s == pytest.approx(pred.compute_time_s + total_comm - hidden, rel=1e-9)
    assert_one_price(plan)
    # by name: the ops' compute, and the blocks' gathers (their group calls with them) as their windows
    # leave them exposed; without overlap no window prices them (reshards do)
    windows = b0["G"] + max(0.0, b1["G"] - eff * b0["F"]) + b1["R"] + max(0.0, b0["R"] - eff * b1["B"])
    assert pred.terms["compute"] == pytest.approx(pred.compute_time_s, rel=1e-12)
    assert pred.terms["gathers in windows"] == pytest.approx(windows if eff else 0.0, rel=1e-9, abs=1e-15)
    if eff == 0.05:  # the windows' communication is longer than 5% of a block: part of it waits
        assert b1["G"] > eff * b0["F"] and b0["R"] > eff * b1["B"] and hidden > 0
    if eff == 0.8:  # a block's compute is longer than its gathers: hidden whole, the reduce-scatters too
        assert hidden == pytest.approx(b1["G"] + b0["R"] + scatters, rel=1e-12)
    if hidden:
        assert "hidden behind compute" in str(plan)


@pytest.mark.parametrize("zero", [2, 3])
def test_backward_prefetch_holds_one_more_block(zero: int) -> None:
    """ZeRO-3's backward prefetch keeps block 0's regathered weight (d x d in bf16) alive
    while block 1's backward runs: the peak adds it, in the ILP's memory row as in the plan.
    ZeRO-2 holds its gathers until backward anyway (priced as held copies): nothing more."""
    d = 256
    step, solution = solved(Stack(d), autopar.Mesh({"dp": 2}, hardware="h100"), (torch.randn(64, d),),
                            loss_fn=F.mse_loss, example_targets=(torch.randn(64, d),), zero={"dp": zero},
                            data_axes=("dp",))
    costs = {n: step.graph.nodes[n].costs[step.graph.nodes[n].strategies.index(step.chosen[n])]
             for n in step.graph.order}
    prefetched = plan_windows(step.graph, step.chosen, costs, step.ctx).prefetched_bytes
    assert prefetched == (d * d * 2 if zero == 3 else 0)
    assert solution.memory_bytes == pytest.approx(step.plan.predicted.peak_memory_bytes, rel=1e-12)


def _beside(step: Any, eff: float) -> float:
    """Seconds of the weights' gradient reduce-scatters (each read once) hidden beside the
    rest of backward, by hand: up to eff x the whole backward (one micro-batch, no buckets)."""
    scatters = sum(c.time_s for c in step.plan.collectives if c.phase == "backward" and c.kind == "reduce_scatter"
                   and step.graph.nodes[c.tensor].kind == "param")
    backward = sum(c.time - c.forward for n in step.graph.order if step.graph.nodes[n].kind == "op"
                   for c in [step.graph.nodes[n].costs[step.graph.nodes[n].strategies.index(step.chosen[n])]])
    return min(scatters, eff * backward)


def _hidden(fig: dict[str, dict[str, float]], eff: float) -> float:
    """Seconds the windows hide, by hand: block k's gathers under block k-1's forward, and the
    regathers of every block but the last under the next block's backward."""
    blocks = list(fig)
    return sum(fig[b]["G"] - max(0.0, fig[b]["G"] - eff * fig[a]["F"]) for a, b in zip(blocks, blocks[1:])) + \
        sum(fig[a]["R"] - max(0.0, fig[a]["R"] - eff * fig[b]["B"]) for a, b in zip(blocks, blocks[1:]))


def _plans(n: int, shares: tuple[int | None, ...], eff: float = 0.8) -> dict[int | None, Any]:
    """ZeRO-3 plans of an ``n``-block Stack gathering again every parameter (None) or the first
    k blocks' (k in ``shares``), each with the ILP's memory row (``memory_bytes``) beside it."""
    d = 256
    mesh = autopar.Mesh({"dp": 2}, hardware=dataclasses.replace(PROFILES["h100"], grad_sync_overlap=eff))
    out = {}
    for k in shares:
        step, solution = solved(Stack(d, n), mesh, (torch.randn(64, d),), loss_fn=F.mse_loss,
                                example_targets=(torch.randn(64, d),), data_axes=("dp",), zero={"dp": 3},
                                regather_blocks=k)
        out[k] = (step, solution.memory_bytes)
    return out


def test_gathering_again_in_the_first_block_only() -> None:
    """``regather_blocks=1``: block 0 frees its gathered weight after forward and gathers it
    again; block 1 holds its copy. Block 1's backward start still prefetches block 0's
    regather (the runtime's trigger needs nothing of block 1's parameters), so it hides
    under block 1's backward, as block 1's forward gather hides under block 0's forward.
    Memory: block 1's held copy plus block 0's prefetched one; gathering both again holds
    none and prefetches block 0's the same way: one weight (d x d in bf16) less."""
    d, eff = 256, 0.8
    plans = _plans(2, (None, 1), eff)
    (every, every_row), (first, first_row) = plans[None], plans[1]
    assert first.plan.memory.regather == ["layers.0.fc.weight"]
    fig = _block_figures(first)
    b0, b1 = fig["layers.0"], fig["layers.1"]
    assert b0["R"] > 0 and b1["R"] == 0 and b1["G"] > 0
    assert b0["R"] <= eff * b1["B"]  # hidden whole: the plan waits for none of block 0's regather
    hidden = b1["G"] - max(0.0, b1["G"] - eff * b0["F"]) + b0["R"]
    assert hidden == pytest.approx(_hidden(fig, eff), rel=1e-12)
    hidden += _beside(first, eff)
    pred = first.plan.predicted
    total_comm = sum(c.time_s * c.count for c in first.plan.collectives)
    assert pred.hidden_comm_time_s == pytest.approx(hidden, rel=1e-9)
    assert pred.step_time_s == pytest.approx(pred.compute_time_s + total_comm - hidden, rel=1e-9)
    assert first.plan.solver["objective_s"] == pytest.approx(pred.step_time_s, rel=1e-9)
    assert every.plan.memory.regather == ["layers.0.fc.weight", "layers.1.fc.weight"]
    weight = d * d * 2
    for step, row in (plans[None], plans[1]):
        costs = {n: step.graph.nodes[n].costs[step.graph.nodes[n].strategies.index(step.chosen[n])]
                 for n in step.graph.order}
        assert plan_windows(step.graph, step.chosen, costs, step.ctx).prefetched_bytes == weight
        assert row == pytest.approx(step.plan.predicted.peak_memory_bytes, rel=1e-12)  # ILP row == plan
    assert _block_figures(every) == fig | {"layers.1": {**b1, "R": b0["R"]}}  # the same plan, block 1 regathering
    assert pred.peak_memory_bytes == pytest.approx(every.plan.predicted.peak_memory_bytes + weight, rel=1e-12)


def test_a_later_block_holding_still_prefetches_the_one_before() -> None:
    """Three blocks, the first two gathering again and block 2 holding (torchtitan's default:
    the last block holds): block 1's regathers hide under block 2's backward, block 0's under
    block 1's, so no regather waits; one block's weight is prefetched at a time, and each
    block more held adds its weight to the peak."""
    d, eff = 256, 0.8
    plans = _plans(3, (None, 1, 2), eff)
    step, row = plans[2]
    assert step.plan.memory.regather == ["layers.0.fc.weight", "layers.1.fc.weight"]
    fig = _block_figures(step)
    assert [fig[b]["R"] > 0 for b in fig] == [True, True, False]
    assert all(fig[a]["R"] <= eff * fig[b]["B"] for a, b in (("layers.0", "layers.1"), ("layers.1", "layers.2")))
    pred = step.plan.predicted
    hidden = _hidden(fig, eff) + _beside(step, eff)
    assert pred.hidden_comm_time_s == pytest.approx(hidden, rel=1e-9)
    total_comm = sum(c.time_s * c.count for c in step.plan.collectives)
    assert pred.step_time_s == pytest.approx(pred.compute_time_s + total_comm - hidden, rel=1e-9)
    assert step.plan.solver["objective_s"] == pytest.approx(pred.step_time_s, rel=1e-9)
    weight = d * d * 2
    costs = {n: step.graph.nodes[n].costs[step.graph.nodes[n].strategies.index(step.chosen[n])]
             for n in step.graph.order}
    assert plan_windows(step.graph, step.chosen, costs, step.ctx).prefetched_bytes == weight
    assert row == pytest.approx(pred.peak_memory_bytes, rel=1e-12)
    peaks = [plans[k][0].plan.predicted.peak_memory_bytes for k in (None, 2, 1)]  # 0, 1, 2 blocks held
    assert peaks == pytest.approx([peaks[0], peaks[0] + weight, peaks[0] + 2 * weight], rel=1e-12)
    # every parameter gathered again: the last block's regather waits, the rest as above
    every = plans[None][0]
    last = _block_figures(every)["layers.2"]["R"]
    assert last > 0 and every.plan.predicted.step_time_s == pytest.approx(pred.step_time_s + last, rel=1e-9)


def _order_on_rank(rank: int, world: int, case: Any, ref: Reference) -> dict[str, Any]:
    """Three steps of the GPT example under ZeRO-3 (``run_compiled``), recording beside the
    collective log when each block starts computing and when each parameter's gather is
    issued in forward; backward's events (``backward_prefetch``) apart."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, zero={"dp": 3},
                         data_axes=("dp",), pipeline=False)
    fqn_of = {id(p): fqn for fqn, p in pm.named_parameters()}
    events: list[tuple[str, str, int]] = []  # (what, block, collectives logged so far)

    def note(what: str, block: str | None) -> None:
        log = pm._comm.log
        events.append((what, block or "", len(log.entries) if log is not None else 0))

    prefetch, group = pm.program.get_submodule("prefetch"), pm.program.get_submodule("gather_group")
    issue, issue_group = prefetch.forward, group.forward

    def watch_issue(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        note("issue", block_of(fqn_of[id(x)]))
        note("collective", block_of(fqn_of[id(x)]))
        return issue(x, *args, **kwargs)

    def watch_group(xs: tuple[torch.Tensor, ...], *args: Any, **kwargs: Any) -> Any:
        for x in xs:  # one collective for the block's parameters (``cost.groups``): an issue each
            note("issue", block_of(fqn_of[id(x)]))
        note("collective", block_of(fqn_of[id(xs[0])]))
        return issue_group(xs, *args, **kwargs)
    prefetch.forward = watch_issue  # type: ignore[method-assign]
    group.forward = watch_group  # type: ignore[method-assign]

    def start(block: str) -> None:
        note("start", block)
    graph = pm.program.graph
    for block, node in first_compute(graph).items():
        with graph.inserting_before(node):
            graph.call_function(start, (block,))
    pm.program.recompile()
    backward = backward_prefetch.watch(pm)
    return {**run_compiled(pm, (*inputs, *targets), ref), "events": events, "backward": backward}


@pytest.mark.slow
def test_gathers_are_issued_one_block_ahead() -> None:
    ref = reference(gpt.build)
    for result in run_checked(_order_on_rank, (2,), None, ref):  # numerics, and executed == planned
        events = result["events"][:len(result["events"]) // STEPS]  # the first of the alike steps
        at = {(what, block): i for i, (what, block, _) in reversed(list(enumerate(events)))}  # first occurrence
        issued = {b: [i for i, (what, block, _) in enumerate(events) if what == "issue" and block == b]
                  for b in ("blocks.0", "blocks.1")}
        assert issued["blocks.0"] and issued["blocks.1"]
        # forward: block 0's gathers, then block 1's, are issued before block 0 computes
        assert max(issued["blocks.0"]) < min(issued["blocks.1"]) < max(issued["blocks.1"]) < at[("start", "blocks.0")]
        # ... and logged then (the log lists them in the order they were issued)
        count_at = {e[:2]: e[2] for e in reversed(events)}
        collectives = [i for i, (what, block, _) in enumerate(events) if what == "collective" and block != ""]
        assert count_at[("start", "blocks.0")] >= len(collectives) > 0
        # backward: block 1's backward start issues block 0's regathers, one per handle block 0
        # unpacks later; block 1's own (the last block's) are gathered as they are unpacked
        runs = backward_prefetch.runs(result["backward"])
        assert len(runs) == STEPS
        for run in runs:
            backward_prefetch.assert_prefetched(run, "blocks.0", after="blocks.1")
            backward_prefetch.assert_on_demand(run, "blocks.1")
            assert [e[:2] for e in run if e[0] == "starts"] == [("starts", "blocks.1")]


def test_a_bf16_models_grouped_reduce_scatters_run_beside_backward() -> None:
    """A model whose parameters are bf16 gets its gradients cast up to fp32 before they are
    reduce-scattered. Its parameters read once reduce-scatter in their block's group
    (``cost.groups``), which casts each gradient into the group's fp32 buffer and is left
    running beside backward whatever the width (``runtime.grouped``): the plan hides them as it
    hides an fp32 model's, besides its windows."""
    d, eff = 256, 0.8
    mesh = autopar.Mesh({"dp": 2}, hardware=dataclasses.replace(PROFILES["h100"], grad_sync_overlap=eff))
    for dtype in (torch.bfloat16, torch.float32):
        step = plan_step(Stack(d).to(dtype), mesh, (torch.randn(64, d, dtype=dtype),), loss_fn=F.mse_loss,
                         example_targets=(torch.randn(64, d, dtype=dtype),), zero={"dp": 3}, data_axes=("dp",))
        fig = _block_figures(step)
        assert any(c.kind == "reduce_scatter" and c.phase == "backward" for c in step.plan.collectives)
        hidden = step.plan.predicted.hidden_comm_time_s - _hidden(fig, eff)
        assert_one_price(step.plan)
        assert hidden == pytest.approx(_beside(step, eff), rel=1e-9) and hidden > 0
