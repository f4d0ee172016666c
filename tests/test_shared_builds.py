"""Plan-graph builds that share what one search's places share (``problem.shared.BuildMemo``) build
the graph each builds alone: the same strategies, prices and gradients, node by node."""

from __future__ import annotations

import pytest

import autopar
from autopar.capture import capture, reuse_captures
from autopar.cost.model import CostContext
from autopar.cost.precision import get_precision
from autopar.problem.graph import build_plan_graph
from autopar.problem.nodes import PlanGraph
from autopar.problem.shared import BuildMemo
from autopar.rules import DEFAULT_RULES
from examples import llama

MESHES = (autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), autopar.Mesh({"dp": 4}, "h100"), autopar.Mesh({"tp": 2}, "cpu"))


def _fields(graph: PlanGraph) -> list[tuple[object, ...]]:
    return [(n.name, n.module, n.outputs, n.strategies, n.costs, n.comm_times, n.needs_grad, n.kept, n.grad_sums,
             n.as_produced, n.fallback) for n in (graph.nodes[name] for name in graph.order)]


@pytest.mark.parametrize("train", [True, False])
def test_builds_sharing_a_memo_equal_builds_alone(train: bool) -> None:
    """One model captured symbolic (two sizes of one graph) and concrete, each built on three meshes:
    with one memo, every node equals the one built with none; the memo keeps one set of facts per graph."""
    model, (tokens,), loss_fn, (targets,) = llama.build(llama.LlamaConfig(layers=2), batch=8)
    shared = BuildMemo(DEFAULT_RULES)
    with reuse_captures():
        for rows, symbolic in ((8, True), (4, True), (4, False)):
            captured = capture(model, (tokens[:rows],), loss_fn=loss_fn if train else None,
                               example_targets=(targets[:rows],) if train else (), train=train,
                               symbolic_batch=symbolic)
            for mesh in MESHES:
                ctx = CostContext(mesh=mesh, precision=get_precision("fp32", None), train=train)
                alone = build_plan_graph(captured, DEFAULT_RULES, ctx)
                assert _fields(build_plan_graph(captured, DEFAULT_RULES, ctx, shared)) == _fields(alone)
    assert len(shared._facts) == 2  # the symbolic graph (both sizes) and the concrete one


def _model_of(problem, limit: float, fresh: bool = False) -> tuple[object, ...]:
    """The problem's model; ``fresh``: priced by edge prices of its own (none kept from other builds)."""
    from autopar.solver import ilp
    from autopar.solver.edge_prices import EdgePrices
    built = ilp.build(problem.graph, problem.folding, problem.ctx, limit, shares=problem.memory_shares,
                      prices=EdgePrices(problem.ctx) if fresh else problem.edge_prices())
    model = built.model
    return (model.cost, model.upper, model.integer, model.implied_integer, model.rows, model.terms,
            built.memory_row, built.x)


@pytest.mark.slow
def test_scenario_copies_sharing_their_edges_build_the_models_fresh_graphs_build() -> None:
    """A memory search's scenarios reprice copies of one graph that share what its edges decide
    (``PlanGraph.edges``: consumers, sharing classes, folded edges; partial checkpointing splits the
    folding), priced by one search's edge prices (kept keys and matrices): each scenario's model equals,
    column for column and row for row, the model of its graph copied with nothing shared, priced afresh."""
    from dataclasses import replace

    from autopar.config import PlanConfig
    from autopar.problem.nodes import EdgeMemo
    from autopar.search.problem import Place, Problems, Step, scenarios

    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=2), batch=8)
    problems = Problems(Step(model=model, example_inputs=inputs, loss_fn=loss_fn, example_targets=targets),
                        PlanConfig.from_options(pipeline=False))
    place = Place(mesh=autopar.Mesh({"dp": 2, "tp": 2}, "cpu"))
    every = [s for s in scenarios(problems.at(place)) if s.micro_batches == 1]
    partial = [s for s in every if s.checkpoint_blocks is not None or s.regather_blocks is not None]
    assert partial and len(every) > len(partial)  # split foldings among them
    for scenario in [*every[:2], *partial[::max(1, len(partial) // 3)]]:
        shared = problems.under(place, scenario, 1e12)
        assert shared.graph.edges is problems.at(place).graph.edges
        alone = replace(shared, graph=replace(shared.graph, edges=EdgeMemo()))
        assert _model_of(shared, 1e12) == _model_of(alone, 1e12, fresh=True), scenario.describe()
