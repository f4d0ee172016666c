"""The memory search is a branch and bound over scenarios: its bounds never exceed what a
scenario can reach, and what it prunes never changes the plan (against solving every
scenario)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import search
from autopar.api import prepare_step
from autopar.errors import MemoryLimitError
from autopar.solver.ilp import Solution, solve
from autopar.step import PreparedStep
from examples import gpt

MiB = 2**20
LIMITS_MIB = (9.3, 5.2)
"""The plan with memory to spare needs 10.4 MiB: ZeRO-1, then checkpointing and gathering again."""


def _prepared(limit_mib: float | None) -> PreparedStep:
    """The GPT example (2 blocks, batch 2) on dp=2 h100s, whose gradient buckets hide
    under backward; offload pinned off to keep the scenarios few (23: the default, then 22 with ZeRO-1 chosen per
    parameter on dp)."""
    model, inputs, loss_fn, targets = gpt.build(batch=2)
    return prepare_step(model, autopar.Mesh({"dp": 2}, "h100"), inputs, loss_fn=loss_fn,
                        example_targets=targets, offload=False,
                        memory_limit=None if limit_mib is None else limit_mib * MiB)


def test_a_scenarios_bound_never_exceeds_its_free_optimum() -> None:
    """With every relaxation solved, each scenario's bound (relaxation + least recompute) is
    at most its own free optimum, and tighter than the node bound alone for most."""
    prepared = _prepared(None)
    scenarios = prepared.scenarios()
    bounds = search._Bounds(prepared, scenarios)
    found = search._Found(scenarios[0], 1.0)
    for group in dict.fromkeys(map(search.relaxation, scenarios)):
        bounds.solve_relaxation(group, found)
    assert not found.failed
    tighter = 0
    for scenario in scenarios:
        free = search._solve(prepared.under(scenario), None)
        assert bounds.of(scenario) <= free.objective_s * (1 + 1e-9), scenario
        tighter += bounds.of(scenario) > bounds.node[scenario] * (1 + 1e-6)
    assert tighter >= len(scenarios) // 2


def _every_scenario(prepared: PreparedStep) -> Solution:
    """The search's answer by solving every scenario under the limit, nothing pruned."""
    scenarios = prepared.scenarios()
    found = search._Found(scenarios[0], search._solve(prepared.under(scenarios[0]), None).objective_s)
    for scenario in scenarios:
        try:
            found.add(scenario, search._solve(prepared.under(scenario), prepared.memory_limit, explain=False))
        except MemoryLimitError:
            pass
    return found.result(prepared, scenarios)


@pytest.mark.parametrize("limit_mib", LIMITS_MIB)
def test_pruning_never_changes_the_plan(limit_mib: float) -> None:
    prepared = _prepared(limit_mib)
    every = _every_scenario(prepared)
    searched = search.solve_step(prepared)
    assert searched.objective_s == pytest.approx(every.objective_s, rel=1e-9)
    assert searched.memory_bytes <= prepared.memory_limit
    counts = searched.search  # every scenario accounted for, and the bounds spared solves
    assert counts["solved"] + counts["not_fitting"] + counts["bounded_out"] == counts["scenarios"] == 23
    assert counts["bounded_out"] >= 10


@pytest.mark.parametrize("limit_mib", LIMITS_MIB)
def test_a_scenario_tried_first_or_a_cutoff_above_the_best_never_changes_the_plan(limit_mib: float) -> None:
    """What a pipeline search passes a stage plan's memory search (``PreparedStep.try_first``,
    ``cutoff_s``) changes the order of solves, never the plan; a cutoff below the best plan's time
    leaves no plan, said as a memory-limit error."""
    prepared = _prepared(limit_mib)
    best = search.solve_step(prepared)
    for scenario in (prepared.scenarios()[-1], best.scenario):
        hinted = search.solve_step(replace(prepared, try_first=replace(scenario, micro_batches=7)))
        assert hinted.objective_s == pytest.approx(best.objective_s, rel=1e-9)
        assert hinted.scenario == best.scenario
    capped = search.solve_step(replace(prepared, cutoff_s=best.objective_s * 1.001))
    assert capped.objective_s == pytest.approx(best.objective_s, rel=1e-9)
    with pytest.raises(MemoryLimitError, match="predicts less than"):
        search.solve_step(replace(prepared, cutoff_s=best.objective_s * 0.999))


def test_a_scenario_saves_at_least_what_it_checkpoints_and_regathers_beyond_another() -> None:
    from autopar.memory.scenarios import Scenario

    plain, some = Scenario(micro_batches=4), Scenario(micro_batches=4, checkpoint="full", checkpoint_blocks=20)
    every = replace(some, checkpoint_blocks=None, regather=True, regather_blocks=79)
    assert some.saves_at_least(plain) and every.saves_at_least(some) and every.saves_at_least(every)
    assert not plain.saves_at_least(some) and not some.saves_at_least(every)
    assert not replace(some, checkpoint="selective").saves_at_least(some)  # another policy: not comparable
    assert not replace(some, regather=True, regather_blocks=79).saves_at_least(replace(plain, regather=True))
    assert not some.saves_at_least(replace(plain, micro_batches=8))


def test_a_scenarios_lp_bound_never_exceeds_its_optimum_under_the_limit() -> None:
    """``_Bounds.solve_lp``: the LP relaxation under the limit is below every scenario's best
    plan within it, above the free relaxation's bound for most, and absent where the
    relaxation does not fit either."""
    prepared = _prepared(LIMITS_MIB[0])
    scenarios = prepared.scenarios()
    bounds = search._Bounds(prepared, scenarios)
    tighter = 0
    for scenario in scenarios:
        try:
            best = search._solve(prepared.under(scenario), prepared.memory_limit, explain=False).objective_s
        except MemoryLimitError:
            best = None
        fits = bounds.solve_lp(scenario)
        assert fits or best is None, scenario
        if best is not None:
            assert bounds.lp[scenario] <= best * (1 + 1e-9), scenario
            tighter += bounds.lp[scenario] > bounds.node[scenario] * (1 + 1e-6)
    assert tighter >= len(scenarios) // 2


def test_checkpointing_the_first_blocks_keeps_one_plan_for_every_block() -> None:
    """With only the first of the GPT's 2 blocks checkpointed, the two blocks are priced apart
    (``split_folding``) but tied to one strategy per op, as folded blocks run one plan: made
    dearer in the second block alone, an op's strategy changes in both or in neither (and
    untied, in the second only)."""
    model, inputs, loss_fn, targets = gpt.build(batch=2)
    prepared = prepare_step(model, autopar.Mesh({"dp": 2, "tp": 2}, "h100"), inputs, loss_fn=loss_fn,
                            example_targets=targets, checkpoint="full", checkpoint_blocks=1, micro_batches=1,
                            offload=False)
    graph, folding, ctx = prepared.graph, prepared.folding, prepared.ctx
    assert len(folding.tied) > 10  # every op of the block that records for backward
    chosen = solve(graph, folding, ctx, None).choice
    part = next(p for p in folding.tied if len(graph.nodes[p].strategies) > 1)
    first = folding.tied[part]
    node = graph.nodes[part]
    costs = list(node.costs)
    costs[chosen[part]] = replace(costs[chosen[part]], time=costs[chosen[part]].time + 1.0)
    dearer = replace(graph, nodes={**graph.nodes, part: replace(node, costs=costs)})
    tied = solve(dearer, folding, ctx, None).choice
    assert tied[part] == tied[first]
    untied = solve(dearer, replace(folding, tied={}), ctx, None).choice
    assert untied[part] != untied[first]


