"""The parts of a split class (``Folding.tied``: blocks checkpointed or gathering again beside those that do
not, one strategy for all) share their strategy columns and their edges' pair columns in the placement ILP
(``solver.ilp._strategy_columns``, ``solver.edge_links.link_edges``): the same optimum as the parts priced
apart and held equal by rows, on a model far smaller."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import autopar
from autopar.memory.scenarios import Scenario
from autopar.search.problem import Place, Problem
from autopar.solver import ilp, milp
from examples import gpt, llama
from tests.planning import problems

pytestmark = pytest.mark.slow  # each a few solves of a tiny model: seconds

def _binding(problem: Problem) -> float:
    """A limit halfway between the leanest plan's bytes and the fastest plan's: the memory row decides."""
    fastest = ilp.solve(problem.graph, problem.folding, problem.ctx, None, shares=problem.memory_shares)
    leanest = ilp.solve(problem.graph, problem.folding, problem.ctx, None, minimize_memory=True,
                        shares=problem.memory_shares)
    assert isinstance(fastest, ilp.Solution) and isinstance(leanest, ilp.Solution)
    assert leanest.memory_bytes < fastest.memory_bytes
    return (fastest.memory_bytes + leanest.memory_bytes) / 2


def _apart(problem: Problem, limit: float | None, minimize_memory: bool) -> ilp.Built:
    """``problem``'s model with every part priced apart (nothing tied: each its own columns), each tied part's
    strategy columns held equal to its class's first part's by rows."""
    built = ilp.build(problem.graph, replace(problem.folding, tied={}), problem.ctx, limit,
                      minimize_memory=minimize_memory, shares=problem.memory_shares)
    for part, head in problem.folding.tied.items():
        built.model.rows.extend(({a: 1.0, b: -1.0}, 0.0, 0.0) for a, b in zip(built.x[part], built.x[head]))
    return built


def _problem(build: object, layers: int, scenario: Scenario, pipeline_ranks: int | None) -> Problem:
    model, inputs, loss_fn, targets = build(llama.LlamaConfig(layers=layers)) if build is llama.build \
        else build()  # type: ignore[operator]
    store = problems(model, inputs, loss_fn=loss_fn, example_targets=targets)
    place = Place(mesh=autopar.Mesh({"tp": 2}, "h100"), micro_batches=scenario.micro_batches,
                  pipeline_ranks=pipeline_ranks)
    return store.under(place, scenario, math.inf)


FULL_1_OF_2 = Scenario(checkpoint="full", checkpoint_blocks=1)
THREE_PARTS = Scenario(checkpoint="full", checkpoint_blocks=1, regather=True, regather_blocks=3)  # of 4 blocks


@pytest.mark.parametrize("build, layers, scenario, pipeline_ranks, limited, minimize_memory", [
    (gpt.build, 2, FULL_1_OF_2, None, False, False),
    (gpt.build, 2, FULL_1_OF_2, None, True, False),
    (llama.build, 2, Scenario(checkpoint="selective", checkpoint_blocks=1), None, True, False),
    (llama.build, 2, Scenario(regather=True, regather_blocks=1), None, False, True),
    (llama.build, 4, THREE_PARTS, None, True, False),
    (llama.build, 4, Scenario(micro_batches=2, checkpoint="selective", checkpoint_blocks=2), 2, True, False),
])
def test_tied_parts_solve_as_parts_held_equal(build: object, layers: int, scenario: Scenario,
                                              pipeline_ranks: int | None, limited: bool,
                                              minimize_memory: bool) -> None:
    problem = _problem(build, layers, scenario, pipeline_ranks)
    assert problem.folding.tied, "the scenario splits no class"
    limit = _binding(problem) if limited else None
    shared = ilp.build(problem.graph, problem.folding, problem.ctx, limit, minimize_memory=minimize_memory,
                       shares=problem.memory_shares)
    apart = _apart(problem, limit, minimize_memory)
    assert len(shared.model.cost) < len(apart.model.cost)
    one, other = milp.run(shared.model, 60.0), milp.run(apart.model, 60.0)
    assert one.status == other.status == "optimal"
    assert one.objective == pytest.approx(other.objective, rel=1e-7)
    # the shared model's relaxation holds the parts' pairs equal too: a bound as tight or tighter
    lp_one, lp_other = milp.run(shared.model, 60.0, relaxed=True), milp.run(apart.model, 60.0, relaxed=True)
    assert lp_one.objective >= lp_other.objective * (1 - 1e-9)


def test_a_tied_part_takes_its_class_choice() -> None:
    """Each part of a split class reads the one choice its shared columns make, as the runtime runs it."""
    problem = _problem(llama.build, 4, THREE_PARTS, None)
    solution = ilp.solve(problem.graph, problem.folding, problem.ctx, None)
    assert isinstance(solution, ilp.Solution)
    for part, head in problem.folding.tied.items():
        assert solution.choice[part] == solution.choice[head]
