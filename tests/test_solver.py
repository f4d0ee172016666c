"""Solver: the ILP's optimum equals brute-force enumeration; folding; determinism; errors."""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate

import autopar
from autopar.capture import capture
from autopar.cost import get_precision
from autopar.cost.collectives import collective_time, grad_placement_at_consumer, reshard
from autopar.cost.model import CostContext, held_reshard_bytes
from autopar.rules import DEFAULT_RULES, NO_RULE
from autopar.problem.folding import fold_repeated_blocks
from autopar.rules.strategy import local_numel, shard_dim
from autopar.problem.graph import build_plan_graph, edge_flags
from autopar.errors import MemoryLimitError
from autopar.solver.ilp import NoPlan, Solution, solve
from autopar.result.record import Fallback
from examples import gpt, llama
from tests.planning import assert_one_price


class TwoLayerMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16, bias=False)
        self.out = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


def _graph(mesh_axes: dict[str, int], hardware: str = "h100"):
    model = TwoLayerMLP()
    captured = capture(model, (torch.randn(16, 8),), loss_fn=lambda y: y.sum())
    ctx = CostContext(mesh=autopar.Mesh(mesh_axes, hardware), precision=get_precision("bf16"), train=True)
    graph = build_plan_graph(captured, DEFAULT_RULES, ctx)
    return graph, ctx


def _total(graph, ctx, choice: dict[str, int]) -> tuple[float, float]:
    """Objective and memory of one assignment, priced independently of the ILP's formulation
    (and of ``price_edge``): node costs (with the loss's own collectives); each tensor's
    reshards, forward and backward, once per distinct (placement needed, gradient placement
    sent back) among its consumers, from the redistribution steps the runtime executes; and
    gradient buckets by hand: per mesh dim, ceil(gradient bytes / 25 MiB) ring all-reduces,
    each paying its call's fixed cost."""
    mesh = ctx.mesh
    time = memory = 0.0
    paid: set[tuple] = set()
    sync: dict[str, set[int]] = defaultdict(set)
    for name in graph.order:
        node = graph.nodes[name]
        strategy = node.strategies[choice[name]]
        cost = node.costs[choice[name]]
        time += cost.time + (node.comm_times[choice[name]] if node.comm_times else 0.0)
        memory += cost.memory
        for arg, (src, idx) in enumerate(node.args):
            producer = graph.nodes[src]
            meta = producer.outputs[idx]
            produced = producer.strategies[choice[src]].outputs[idx]
            required = strategy.inputs[arg]
            grad = (tuple(grad_placement_at_consumer(r, strategy.is_active(d)) for d, r in enumerate(required))
                    if ctx.train and producer.needs_grad else None)
            is_param = producer.kind == "param"
            syncs = {d for d in range(mesh.ndim) if is_param and grad is not None
                     and produced[d].is_replicate() and grad[d].is_partial()}
            sync[src] |= syncs
            if (src, idx, required, grad) in paid:
                continue
            paid.add((src, idx, required, grad))
            memory += held_reshard_bytes(meta, produced, required, ctx, **edge_flags(graph, src, name, arg))
            calls = reshard(meta, produced, required, mesh, ctx.precision)
            if grad is not None:
                target = tuple(Partial() if d in syncs else p if shard_dim(p) is not None else Replicate()
                               for d, p in enumerate(produced))
                calls += reshard(meta, grad, target, mesh, ctx.precision)
            time += sum(collective_time(c, mesh) for c in calls)
    grad_bytes: dict[int, int] = defaultdict(int)
    for src, dims in sync.items():
        meta = graph.nodes[src].outputs[0]
        for d in dims:
            grad_bytes[d] += ctx.precision.tensor_bytes(meta, local_numel(meta, graph.nodes[src].strategies[choice[src]].outputs[0], mesh.shape))
    for d, nbytes in grad_bytes.items():
        n, link = mesh.shape[d], mesh.link(d)
        per_call = mesh.hardware.collective_overhead + 2 * (n - 1) * link.latency
        time += math.ceil(nbytes / 2**20 / 25) * per_call + 2 * (n - 1) / n * nbytes / link.bandwidth
    return time, memory


def _brute_force(graph, ctx, memory_limit: float | None = None) -> float:
    names = graph.order
    best = math.inf
    for combo in itertools.product(*(range(len(graph.nodes[n].strategies)) for n in names)):
        time, memory = _total(graph, ctx, dict(zip(names, combo)))
        if memory_limit is None or memory <= memory_limit:
            best = min(best, time)
    return best


@pytest.mark.sweep
@pytest.mark.parametrize("axes", [{"x": 2}, {"x": 4}], ids=["mesh2", "mesh4"])
@pytest.mark.parametrize("hardware", ["h100", "cpu"])
def test_ilp_matches_brute_force(axes: dict[str, int], hardware: str) -> None:
    graph, ctx = _graph(axes, hardware)
    combos = math.prod(len(graph.nodes[n].strategies) for n in graph.order)
    assert 1000 < combos < 2_000_000, combos  # big enough to matter, small enough to enumerate
    folding = fold_repeated_blocks(graph)
    solution = solve(graph, folding, ctx, None)
    ilp_time, _ = _total(graph, ctx, solution.choice)
    assert ilp_time == pytest.approx(solution.objective_s, rel=1e-6)
    assert ilp_time == pytest.approx(_brute_force(graph, ctx), rel=1e-6)


@pytest.mark.sweep
def test_ilp_matches_brute_force_under_memory_limit() -> None:
    graph, ctx = _graph({"x": 4}, "cpu")
    folding = fold_repeated_blocks(graph)
    free = solve(graph, folding, ctx, None)
    lean = solve(graph, folding, ctx, None, minimize_memory=True)
    limit = (free.memory_bytes + lean.memory_bytes) / 2
    assert lean.memory_bytes < free.memory_bytes  # the limit really binds
    limited = solve(graph, folding, ctx, limit)
    time, memory = _total(graph, ctx, limited.choice)
    assert memory <= limit
    assert time == pytest.approx(_brute_force(graph, ctx, limit), rel=1e-6)


def test_memory_limit_no_plan_meets_says_what_best_needs() -> None:
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(MemoryLimitError, match=r"least memory .*needs [0-9.]+ (MiB|KiB|GiB) per device: .*weights [0-9.]+ (MiB|KiB|GiB).*"
                       r"activations"):
        autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                     memory_limit=1024, pipeline=False)


def _llama_graph(layers: int):
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=layers))
    ctx = CostContext(mesh=autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), precision=get_precision("fp32"), train=True)
    graph = build_plan_graph(capture(model, inputs, loss_fn=loss_fn, example_targets=targets), DEFAULT_RULES, ctx)
    return graph, ctx


@pytest.mark.slow
def test_repeated_layers_are_solved_once() -> None:
    sizes = {}
    for layers in (2, 5):
        graph, ctx = _llama_graph(layers)
        folding = fold_repeated_blocks(graph)
        assert folding.blocks == {"layers": layers}
        solution = solve(graph, folding, ctx, None)
        sizes[layers] = solution.num_variables
        # every layer gets its representative's strategy; the objective counts every layer
        time, _ = _total(graph, ctx, {n: solution.choice[folding.representative[n]] for n in graph.order})
        assert time == pytest.approx(solution.objective_s, rel=1e-6)
    assert sizes[2] == sizes[5]


def test_whether_some_plan_fits_is_answered_either_way() -> None:
    """A least-memory solve asked only whether some plan needs ``enough_bytes`` or less stops at the first
    that does, and where none does says so ('memory'), HiGHS pruning above it, with no leanest plan's proof."""
    graph, ctx = _llama_graph(2)
    folding = fold_repeated_blocks(graph)
    leanest = solve(graph, folding, ctx, None, minimize_memory=True)
    assert isinstance(leanest, Solution) and leanest.status == "optimal"
    fits = solve(graph, folding, ctx, None, minimize_memory=True, enough_bytes=leanest.memory_bytes * 1.5)
    assert isinstance(fits, Solution) and fits.memory_bytes <= leanest.memory_bytes * 1.5
    none = solve(graph, folding, ctx, None, minimize_memory=True, enough_bytes=leanest.memory_bytes * 0.99)
    assert isinstance(none, NoPlan) and none.kind == "memory", none


@pytest.mark.slow
def test_an_lp_bound_asked_against_a_cutoff_stops_once_over_it() -> None:
    """The LP relaxation solved whole, and against a cutoff: under its optimum the dual simplex stops as
    soon as its bound passes the cutoff ('bound'); over it, the optimum is the relaxation's own; the
    relaxation is no slower than the integer plan."""
    graph, ctx = _llama_graph(1)
    folding = fold_repeated_blocks(graph)
    whole = solve(graph, folding, ctx, None, relaxed=True)
    assert isinstance(whole, Solution) and whole.status == "relaxed"
    plan = solve(graph, folding, ctx, None)
    assert isinstance(plan, Solution) and whole.objective_s <= plan.objective_s * (1 + 1e-9)
    over = solve(graph, folding, ctx, None, relaxed=True, cutoff_s=whole.objective_s * 0.5)
    assert isinstance(over, NoPlan) and over.kind == "bound", over
    under = solve(graph, folding, ctx, None, relaxed=True, cutoff_s=whole.objective_s * 2)
    assert isinstance(under, Solution) and under.objective_s == pytest.approx(whole.objective_s, rel=1e-7)


def test_plans_are_deterministic() -> None:
    model, inputs, loss_fn, targets = llama.build()
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, "cpu")
    a = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=False)
    b = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=False)
    ja, jb = a.to_json(), b.to_json()
    ja.pop("timings"), jb.pop("timings")
    assert ja == jb
    assert a.plan_hash() == b.plan_hash()


def test_small_model_large_batch_is_pure_data_parallel() -> None:
    model, inputs, loss_fn, targets = gpt.build(batch=512)
    plan = autopar.plan(model, autopar.Mesh({"dp": 8}, "h100"), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=False)
    linear_weights = {k: v for k, v in plan.parameters.items() if k.endswith("weight") and "ln" not in k
                      and not k.startswith(("wte", "wpe"))}
    assert set(linear_weights.values()) == {"R"}, linear_weights  # no tensor parallelism
    linears = [n for n in plan.nodes if n.op == "aten.linear.default"]
    assert len(linears) == 9 and all(n.inputs[0] == "S(0)" for n in linears)  # the batch is split
    grad_syncs = [c for c in plan.collectives if c.consumer == ""]
    assert grad_syncs and {(c.kind, c.phase) for c in grad_syncs} == {("all_reduce", "backward")}


def test_unknown_hardware_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown hardware 'tpu9'.*h100"):
        autopar.Mesh({"dp": 2}, "tpu9")


def test_op_without_rule_falls_back_to_replicate_and_is_listed() -> None:
    class Flipper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.flip(self.fc(x), dims=[1]).sum()

    plan = autopar.plan(Flipper(), autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 8),), pipeline=False)
    assert plan.fallbacks == [Fallback(op="aten.flip.default", reason=NO_RULE, nodes=["flip"])]
    assert f"aten.flip.default ({NO_RULE})" in " ".join(str(plan).split())
    flip = next(n for n in plan.nodes if n.op == "aten.flip.default")
    assert flip.outputs == ["R"] and flip.inputs == ["R"] and flip.fallback == NO_RULE


def test_call_a_rule_does_not_handle_is_listed_with_its_reason() -> None:
    """A matmul with a vector operand and an einsum with an ellipsis have rules, but not for
    these forms: they run replicated and the plan says so, and why (not only ops with no rule)."""

    class Scorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.v = nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            scores = torch.matmul(h, self.v)  # [4, 8] @ [8]: a vector operand
            gram = torch.einsum("...i,...j->...ij", h, h)
            return scores.sum() + gram.sum()

    plan = autopar.plan(Scorer(), autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 8),), pipeline=False)
    reasons = {f.op: f.reason for f in plan.fallbacks}
    assert reasons == {"aten.matmul.default": "a vector (1-D) operand",
                       "aten.einsum.default": "ellipsis in the equation '...i,...j->...ij'"}
    assert [f.nodes for f in plan.fallbacks] == [["einsum"], ["matmul"]]
    matmul = next(n for n in plan.nodes if n.op == "aten.matmul.default")
    assert matmul.fallback == "a vector (1-D) operand" and matmul.outputs == ["R"]
    linear = next(n for n in plan.nodes if n.op == "aten.linear.default")
    assert linear.fallback is None
    text = " ".join(str(plan).split())
    assert "aten.matmul.default (a vector (1-D) operand)" in text
    assert "aten.einsum.default (ellipsis in the equation '...i,...j->...ij')" in text
    data = json.loads(json.dumps(plan.to_json()))
    assert {"op": "aten.matmul.default", "reason": "a vector (1-D) operand", "nodes": ["matmul"]} in data["fallbacks"]


@pytest.mark.parametrize("builder", ["build_gpt2_step", "build_llama_step"])
def test_hugging_face_models_plan_end_to_end(builder: str) -> None:
    from examples import hf_models  # needs transformers, a dev dependency

    model, inputs, loss_fn, targets = getattr(hf_models, builder)()
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets, pipeline=False)
    assert_one_price(plan)
    assert len(plan.parameters) == len(dict(model.named_parameters()))
    # model state by hand: fp32 weights, gradients and Adam's m and v (16 bytes), per shard
    sizes = (2, 2)
    by_hand = sum(p.numel() * 16 // math.prod(n for n, pl in zip(sizes, re.findall(r"S\([^)]*\)|R|P",
                                                                                    plan.parameters[k]))
                                                 if pl.startswith("S"))
                  for k, p in model.named_parameters())
    assert plan.predicted.parameter_memory_bytes == by_hand
    # HF's mask construction (diff for position ids, index for the mask) has rules: no fallback
    assert plan.fallbacks == []
    assert any(n.op == "aten.index.Tensor" for n in plan.nodes)
    assert json.dumps(plan.to_json())


def test_solver_time_limit_without_a_plan_is_its_own_error() -> None:
    model, inputs, loss_fn, targets = llama.build()
    with pytest.raises(autopar.SolverTimeLimitError, match="time limit of 1e-09 s"):  # a limit must be > 0
        autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                     example_targets=targets, solver_time_limit_s=1e-9, pipeline=False)


class _Info:
    def __init__(self, feasible: bool, gap: float) -> None:
        self.primal_solution_status = 2 if feasible else 0
        self.mip_gap = gap
        self.objective_function_value = 12.5


def test_solver_status_is_read_not_assumed() -> None:
    from highspy import HighsModelStatus

    from autopar.solver.milp import interpret

    stopped = interpret(HighsModelStatus.kTimeLimit, _Info(True, 0.031), lambda: [1.0, 0.0], 5.0)
    assert (stopped.status, stopped.gap, stopped.values) == ("time_limit", 0.031, [1.0, 0.0])
    empty = interpret(HighsModelStatus.kTimeLimit, _Info(False, float("inf")), lambda: [], 5.0)
    assert (empty.status, empty.values) == ("time_limit", None)
    assert interpret(HighsModelStatus.kInfeasible, _Info(False, 0.0), lambda: [], 5.0).status == "infeasible"
    assert interpret(HighsModelStatus.kOptimal, _Info(True, 1e-9), lambda: [1.0], 5.0).gap == 0.0


def test_a_target_stops_at_the_first_plan_that_meets_it() -> None:
    """``milp.run``'s ``target``: a knapsack (maximize value as minimize -value) whose optimum is
    -2011 stops at a plan of objective <= -1000 without proving it (what ``search._may_fit`` asks
    of a least-memory solve); a target below the optimum leaves the solve as it was."""
    import numpy as np

    from autopar.solver import milp
    rng = np.random.default_rng(0)
    weight, value = rng.integers(10, 100, 60).astype(float), rng.integers(10, 100, 60).astype(float)
    model = milp.Model()
    for v in value:
        model.var(-float(v), integer=True, term="value")
    model.rows.append(({j: float(w) for j, w in enumerate(weight)}, -milp.INF, float(weight.sum() / 3)))
    optimum = milp.run(model, 60.0)
    met = milp.run(model, 60.0, target=-1000.0)
    unmet = milp.run(model, 60.0, target=-1e9)
    assert optimum.status == "optimal" and met.status == "target_reached" and unmet.status == "optimal"
    assert optimum.objective <= met.objective <= -1000.0 and unmet.objective == optimum.objective


def test_a_plan_stopped_at_the_time_limit_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS's incumbent at the time limit comes back as a plan that says it is not proven
    optimal (in the plan, its table and a warning), with the gap."""
    import dataclasses

    from autopar.solver import ilp, milp

    def stopped_run(model: milp.Model, time_limit_s: float, cutoff: float | None = None, **kwargs: Any) -> milp.Result:
        result = milp.run(model, 120.0, cutoff, **kwargs)
        return dataclasses.replace(result, status="time_limit", gap=0.042, time_limit_s=time_limit_s)

    monkeypatch.setattr(ilp, "run", stopped_run)
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.warns(UserWarning, match="NOT PROVEN OPTIMAL.*time limit of 7 s.*within 4.20%"):
        plan = autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                            example_targets=targets, solver_time_limit_s=7.0, pipeline=False)
    assert (plan.solver["status"], plan.solver["gap"], plan.solver["time_limit_s"]) == ("time_limit", 0.042, 7.0)
    assert "NOT PROVEN OPTIMAL" in str(plan)


def test_blocks_whose_inputs_differ_in_gradient_do_not_fold() -> None:
    """The first block's input needs no gradient, so its linear keeps no weight for backward
    and a ZeRO-3 plan gathers that weight once; the second block's gathers it again. Folded
    together, the ILP priced both as the first (objective 201.9 us vs predicted 217.1 us)."""
    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU())
                                              for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    plan = autopar.plan(Stack(), autopar.Mesh({"dp": 2}, "h100"), (torch.randn(64, 256),),
                        loss_fn=lambda y: y.square().mean(), zero={"dp": 3}, pipeline=False)
    assert_one_price(plan)
