"""Prefetched parameter gathers: priced per overlap window (``autopar.solver.overlap``) and
run that way (``autopar.passes.prefetch_gathers``, ``autopar.runtime.regather``).

Pricing, on two identical blocks by hand: block 0's gathers and block 1's regathers wait in
full; block 1's gathers hide under block 0's forward and block 0's regathers under block
1's backward, each up to eff x that compute (exposed = max(0, comm - eff x compute)); the
ILP's objective is the plan's predicted step time. Running: block i+1's gathers are issued
before block i's first op, block i's regathers when block i+1's backward starts, and what
runs is what the plan lists (``numerics_harness``), with the single-device numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.api import finish_step, plan_step, prepare_step, solve_step
from autopar.hardware import PROFILES
from autopar.runtime import regather as regather_module
from autopar.passes.prefetch_gathers import _first_compute
from autopar.solver.memory import block_of
from autopar.solver.overlap import plan_windows
from examples import gpt
from numerics_harness import Reference, reference, run_checked, run_compiled


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Stack(nn.Module):
    """An input projection (so both blocks' inputs need a gradient: they fold) and two blocks."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, bias=False)
        self.layers = nn.ModuleList([Block(d), Block(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _block_figures(step: Any) -> dict[str, dict[str, float]]:
    """Per block: forward gathers G, backward regathers R (from the plan's collectives) and
    forward / backward compute F, B (the chosen strategies' costs), in seconds per step."""
    out = {b: {"G": 0.0, "R": 0.0, "F": 0.0, "B": 0.0} for b in ("layers.0", "layers.1")}
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
                     example_targets=(torch.randn(64, d),), zero={"dp": 3}, data_axes=("dp",))
    plan = step.plan
    assert plan.solver["folded_blocks"] == {"layers": 2} and plan.grad_buckets == []
    fig = _block_figures(step)
    b0, b1 = fig["layers.0"], fig["layers.1"]
    assert b0 == b1 and b0["F"] > 0
    if eff:  # with nothing hidden the plan splits the weights as tensor parallelism does: no gathers
        assert b0["G"] > 0 and b0["R"] > 0
    hidden = (b1["G"] - max(0.0, b1["G"] - eff * b0["F"])) + (b0["R"] - max(0.0, b0["R"] - eff * b1["B"]))
    total_comm = sum(c.time_s * c.count for c in plan.collectives)
    pred = plan.predicted
    assert pred.hidden_comm_time_s == pytest.approx(hidden, rel=1e-9, abs=1e-15)
    assert pred.comm_time_s == pytest.approx(total_comm - hidden, rel=1e-9)
    assert pred.step_time_s == pytest.approx(pred.compute_time_s + total_comm - hidden, rel=1e-9)
    assert plan.solver["objective_s"] == pytest.approx(pred.step_time_s, rel=1e-9)
    if eff == 0.05:  # the windows' communication is longer than 5% of a block: part of it waits
        assert b1["G"] > eff * b0["F"] and b0["R"] > eff * b1["B"] and hidden > 0
    if eff == 0.8:  # a block's compute is longer than its gathers: hidden whole
        assert hidden == pytest.approx(b1["G"] + b0["R"], rel=1e-12)
    if hidden:
        assert "hidden behind compute" in str(plan)


@pytest.mark.parametrize("zero", [2, 3])
def test_backward_prefetch_holds_one_more_block(zero: int) -> None:
    """ZeRO-3's backward prefetch keeps block 0's regathered weight (d x d in bf16) alive
    while block 1's backward runs: the peak adds it, in the ILP's memory row as in the plan.
    ZeRO-2 holds its gathers until backward anyway (priced as held copies): nothing more."""
    d = 256
    prepared = prepare_step(Stack(d), autopar.Mesh({"dp": 2}, hardware="h100"), (torch.randn(64, d),),
                            loss_fn=F.mse_loss, example_targets=(torch.randn(64, d),), zero={"dp": zero},
                            data_axes=("dp",))
    solution = solve_step(prepared)
    step = finish_step(prepared, solution)
    costs = {n: step.graph.nodes[n].costs[step.graph.nodes[n].strategies.index(step.chosen[n])]
             for n in step.graph.order}
    prefetched = plan_windows(step.graph, step.chosen, costs, step.ctx).prefetched_bytes
    assert prefetched == (d * d * 2 if zero == 3 else 0)
    assert solution.memory_bytes == pytest.approx(step.plan.predicted.peak_memory_bytes, rel=1e-12)


def test_gathering_again_in_the_first_block_only() -> None:
    """``regather_blocks=1``: block 0 frees its gathered weight after forward and gathers it
    again; block 1 holds its copy. Nothing prefetches block 0's regather (the runtime starts
    a prefetch at the next block's first regather, and block 1 has none), so it waits in
    full; block 1's forward gather still hides under block 0's forward. Memory: block 1's
    held copy, no prefetched block; gathering both again holds none but prefetches block 0's
    while block 1's backward runs: one copy either way."""
    d, eff = 256, 0.8
    mesh = autopar.Mesh({"dp": 2}, hardware=dataclasses.replace(PROFILES["h100"], grad_sync_overlap=eff))
    kwargs: dict[str, Any] = {"loss_fn": F.mse_loss, "example_targets": (torch.randn(64, d),), "data_axes": ("dp",)}
    steps = {k: plan_step(Stack(d), mesh, (torch.randn(64, d),), zero={"dp": z}, regather_blocks=k, **kwargs)
             for z, k in ((3, None), (3, 1))}
    every, first = steps[None], steps[1]
    assert first.plan.memory.regather == ["layers.0.fc.weight"]
    fig = _block_figures(first)
    b0, b1 = fig["layers.0"], fig["layers.1"]
    assert b0["R"] > 0 and b1["R"] == 0 and b1["G"] > 0
    hidden = b1["G"] - max(0.0, b1["G"] - eff * b0["F"])
    pred = first.plan.predicted
    assert pred.hidden_comm_time_s == pytest.approx(hidden, rel=1e-9)
    assert first.plan.solver["objective_s"] == pytest.approx(pred.step_time_s, rel=1e-9)
    assert every.plan.memory.regather == ["layers.0.fc.weight", "layers.1.fc.weight"]
    costs = {n: first.graph.nodes[n].costs[first.graph.nodes[n].strategies.index(first.chosen[n])]
             for n in first.graph.order}
    assert plan_windows(first.graph, first.chosen, costs, first.ctx).prefetched_bytes == 0
    assert pred.peak_memory_bytes == pytest.approx(every.plan.predicted.peak_memory_bytes, rel=1e-12)


def _order_on_rank(rank: int, world: int, case: Any, ref: Reference) -> dict[str, Any]:
    """Three steps of the GPT example under ZeRO-3 (``run_compiled``), recording beside the
    collective log when each block starts computing, when each parameter's gather is issued
    in forward and when each regather is issued and unpacked in backward."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, zero={"dp": 3},
                         data_axes=("dp",))
    fqn_of = {id(p): fqn for fqn, p in pm.named_parameters()}
    events: list[tuple[str, str, int]] = []  # (what, block, collectives logged so far)

    def note(what: str, block: str | None) -> None:
        log = pm._comm.log
        events.append((what, block or "", len(log.entries) if log is not None else 0))

    prefetch = pm.program.get_submodule("prefetch")
    issue = prefetch.forward

    def watch_issue(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        note("issue", block_of(fqn_of[id(x)]))
        return issue(x, *args, **kwargs)
    prefetch.forward = watch_issue  # type: ignore[method-assign]

    def start(block: str) -> None:
        note("start", block)
    graph = pm.program.graph
    for block, node in _first_compute(graph).items():
        with graph.inserting_before(node):
            graph.call_function(start, (block,))
    pm.program.recompile()
    launch, unpack = regather_module._Source.launch, regather_module._Prefetcher.unpack

    def watch_launch(source: Any) -> Any:
        note("regather", block_of(source.fqn))
        return launch(source)

    def watch_unpack(self: Any, saved: Any) -> Any:
        if isinstance(saved, regather_module._Saved):
            note("unpack", block_of(saved.source.fqn))
        return unpack(self, saved)
    # patched in this forked rank's process only, which ends with the test
    regather_module._Source.launch, regather_module._Prefetcher.unpack = watch_launch, watch_unpack  # type: ignore
    return {**run_compiled(pm, (*inputs, *targets), ref), "events": events}


def _first_step(events: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The events of the first step: up to the next step's first forward issue (after a backward unpack)."""
    first_unpack = next(i for i, e in enumerate(events) if e[0] == "unpack")
    end = next((i for i in range(first_unpack, len(events)) if events[i][0] == "issue"), len(events))
    return events[:end]


def test_gathers_are_issued_one_block_ahead() -> None:
    ref = reference(gpt.build)
    for result in run_checked(_order_on_rank, (2,), None, ref):  # numerics, and executed == planned
        events = _first_step(result["events"])
        at = {(what, block): i for i, (what, block, _) in reversed(list(enumerate(events)))}  # first occurrence
        issued = {b: [i for i, (what, block, _) in enumerate(events) if what == "issue" and block == b]
                  for b in ("blocks.0", "blocks.1")}
        assert issued["blocks.0"] and issued["blocks.1"]
        # forward: block 0's gathers, then block 1's, are issued before block 0 computes
        assert max(issued["blocks.0"]) < min(issued["blocks.1"]) < max(issued["blocks.1"]) < at[("start", "blocks.0")]
        # ... and logged then (the log lists them in the order they were issued)
        count_at = {e[:2]: e[2] for e in reversed(events)}
        assert count_at[("start", "blocks.0")] >= len(issued["blocks.0"]) + len(issued["blocks.1"])
        # backward: block 1 regathers as it is unpacked; its first unpack issues block 0's regathers,
        # one per handle block 0 unpacks later, all before block 0's backward starts
        unpacks = [i for i, (what, block, _) in enumerate(events) if what == "unpack" and block == "blocks.0"]
        ahead = [i for i, (what, block, _) in enumerate(events) if what == "regather" and block == "blocks.0"]
        assert at[("unpack", "blocks.1")] < min(ahead) and max(ahead) < min(unpacks)
        assert len(ahead) == len(unpacks)
