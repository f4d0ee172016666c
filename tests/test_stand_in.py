"""The search prepares micro-batch counts on one capture with a symbolic micro-batch that stands in for the
concrete captures (``Problems.stand_in``, ``capture.symbolic.named_as``), then moves its plan onto the
concrete capture of the plan's size (``search.planner.on_concrete_capture``): the same plan as searching on
concrete captures, on a graph that runs; planning only, no ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autopar
from autopar.capture import capture, reuse_captures
from autopar.capture.symbolic import named_as
from autopar.config import PlanConfig
from autopar.cost.model import CostContext
from autopar.cost.precision import get_precision
from autopar.problem.graph import build_plan_graph
from autopar.rules import DEFAULT_RULES
from autopar.search import planner
from autopar.search import problem as problem_module
from autopar.search.problem import Problems, Step
from examples import hf_models, llama

MESH = autopar.Mesh({"dp": 2, "tp": 2}, "cpu")


def _names(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if not n.name.startswith("micro_batch_size_")]


def test_named_as_names_the_symbolic_graph_as_the_concrete_one() -> None:
    """HF GPT-2 reads its input's size: export names that ``sym_size`` node and every later name shifts.
    Named as the concrete capture, the symbolic graph at 2 rows builds the plan graph of the step captured
    at 2 rows, node for node, names included."""
    model, (ids,), _, _, kwargs = hf_models.build_gpt2(batch=4)
    ctx = CostContext(mesh=MESH, precision=get_precision("fp32", None), train=True)
    with reuse_captures():
        concrete = capture(model, (ids,), example_kwargs=kwargs)
        symbolic = capture(model, (ids[:2],), example_kwargs={"labels": ids[:2]}, symbolic_batch=True)
        assert _names(symbolic.gm) != _names(concrete.gm)
        assert named_as(symbolic, concrete)
        assert _names(symbolic.gm) == _names(concrete.gm)
        at_two = capture(model, (ids[:2],), example_kwargs={"labels": ids[:2]})
    mine = build_plan_graph(symbolic, DEFAULT_RULES, ctx)
    theirs = build_plan_graph(at_two, DEFAULT_RULES, ctx)
    assert mine.order == theirs.order
    assert all(mine.nodes[n] == theirs.nodes[n] for n in mine.order)


def test_graphs_that_do_not_align_are_not_renamed() -> None:
    model, (ids,), _, _, kwargs = hf_models.build_gpt2(batch=4)
    other, (tokens,), loss_fn, (targets,) = llama.build(llama.LlamaConfig(layers=1), batch=4)
    with reuse_captures():
        concrete = capture(other, (tokens,), loss_fn=loss_fn, example_targets=(targets,))
        symbolic = capture(model, (ids[:2],), example_kwargs={"labels": ids[:2]}, symbolic_batch=True)
        before = _names(symbolic.gm)
        assert not named_as(symbolic, concrete)
        assert _names(symbolic.gm) == before


def _searched(step: Step, config: PlanConfig, mesh: autopar.Mesh, monkeypatch: pytest.MonkeyPatch,
              stand_in: bool) -> Any:
    if not stand_in:  # every place prepared on its own concrete capture
        monkeypatch.setattr(Problems, "_routed", lambda self, place: place)
    try:
        return planner.plan(step, config, mesh)
    finally:
        monkeypatch.undo()


@pytest.mark.slow
def test_a_search_on_the_stand_in_plans_as_on_concrete_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline depth and memory search (micro-batch counts 2 to 8) plans the same plan either way, here
    of 4 micro-batches, and the plan found is on the concrete capture of its micro-batch, which runs. (HF
    GPT-2, whose symbolic graph is renamed, plans alike too: 4 micro-batches at a 512 KiB limit, 23 s here.)"""
    model, (tokens,), loss_fn, (targets,) = llama.build(llama.LlamaConfig(layers=2), batch=8)
    step = Step(model=model, example_inputs=(tokens,), example_targets=(targets,), loss_fn=loss_fn)
    config = PlanConfig.from_options(pipeline=autopar.Pipeline(from_axis="dp"), memory_limit=2**21)
    mesh = autopar.Mesh({"dp": 4}, "cpu")
    found = _searched(step, config, mesh, monkeypatch, stand_in=True)
    alone = _searched(step, config, mesh, monkeypatch, stand_in=False)
    assert found.captured.batch_symbol is None
    assert found.plan.plan_hash() == alone.plan.plan_hash()
    assert found.plan.predicted == alone.plan.predicted
    assert found.plan.source.micro_batches == 4
    first = next(n for n in found.captured.gm.graph.nodes if n.name == found.captured.user_inputs[0])
    assert first.meta["val"].shape[0] == 2  # the plan's own micro-batch, concrete


def test_a_plan_that_cannot_move_onto_its_concrete_capture_is_searched_again(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """Where the concrete capture of the plan's size is not the stand-in's graph, the search runs again on
    concrete captures, and the account says so."""
    model, (tokens,), loss_fn, (targets,) = llama.build(llama.LlamaConfig(layers=1), batch=8)
    step = Step(model=model, example_inputs=(tokens,), example_targets=(targets,), loss_fn=loss_fn)
    config = PlanConfig.from_options(memory_limit=2**23, micro_batches=4)
    real = planner.on_concrete_capture
    monkeypatch.setattr(planner, "on_concrete_capture", lambda problems, step, limit: None
                        if step.captured.batch_symbol is not None else real(problems, step, limit))
    found = planner.plan(step, config, autopar.Mesh({"dp": 2}, "cpu"))
    assert found.captured.batch_symbol is None and found.plan.source.micro_batches == 4
    assert any(row.outcome == "searched again" for row in found.plan.account)


def test_a_stand_in_that_fails_to_prepare_leaves_every_count_concrete(monkeypatch: pytest.MonkeyPatch) -> None:
    """A symbolic graph that fails where the concrete one would not (an ``InputError`` preparing it) stands
    in for nothing: the count is prepared on its concrete capture, and so is every later one."""
    model, (tokens,), loss_fn, (targets,) = llama.build(llama.LlamaConfig(layers=1), batch=8)
    step = Step(model=model, example_inputs=(tokens,), example_targets=(targets,), loss_fn=loss_fn)
    real = problem_module.prepare

    def failing(step: Step, config: PlanConfig, place: Any, *args: Any) -> Any:
        if place.symbolic:
            raise autopar.InputError("a symbolic graph this test refuses")
        return real(step, config, place, *args)
    monkeypatch.setattr(problem_module, "prepare", failing)
    problems = Problems(step, PlanConfig.from_options())
    problems.stand_in = True
    mesh = autopar.Mesh({"dp": 2}, "cpu")
    for m in (2, 4):
        assert problems.at(problem_module.Place(mesh=mesh, micro_batches=m)).captured.batch_symbol is None
