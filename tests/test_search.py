"""The memory search is a branch and bound over scenarios: its bounds never exceed what a
scenario can reach, and what it prunes never changes the plan (against solving every
scenario)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import autopar
from autopar.api.planning import prepare
from autopar.errors import MemoryLimitError
from autopar.search import ilp
from autopar.search.bounds import Bounds, relaxation
from autopar.search.memory import Bound, Pruned, Solved, _Found, search_memory
from autopar.search.problem import Place, Problems, scenarios
from autopar.solver.ilp import NoPlan, Solution, solve
from examples import gpt
from tests.planning import problems as step_problems

pytestmark = pytest.mark.slow

MiB = 2**20
LIMITS_MIB = (9.3, 5.2)
"""The plan with memory to spare needs 10.4 MiB: ZeRO-1, then checkpointing and gathering again."""
PLACE = Place(mesh=autopar.Mesh({"dp": 2}, "h100"))


def _problems() -> Problems:
    """The GPT example (2 blocks, batch 2) on dp=2 h100s, whose gradient buckets hide
    under backward; offload pinned off to keep the scenarios few (23: the default, then 22 with ZeRO-1 chosen per
    parameter on dp)."""
    model, inputs, loss_fn, targets = gpt.build(batch=2)
    return step_problems(model, inputs, loss_fn=loss_fn, example_targets=targets, offload=False)


def test_a_scenarios_bound_never_exceeds_its_free_optimum() -> None:
    """With every relaxation solved, each scenario's bound (relaxation + least recompute) is
    at most its own free optimum, and tighter than the node bound alone for most."""
    store = _problems()
    candidates = scenarios(store.at(PLACE))
    bounds = Bounds(store, PLACE, math.inf, candidates)
    for group in dict.fromkeys(map(relaxation, candidates)):
        assert isinstance(bounds.solve_relaxation(group), Solution)
    tighter = 0
    for scenario in candidates:
        free = ilp.solve(store.under(PLACE, scenario, math.inf), None)
        assert isinstance(free, Solution)
        assert bounds.of(scenario) <= free.objective_s * (1 + 1e-9), scenario
        tighter += bounds.of(scenario) > bounds.node[scenario] * (1 + 1e-6)
    assert tighter >= len(candidates) // 2


def test_a_relaxation_bounded_by_its_lp_is_never_faster_than_the_bound() -> None:
    """``Bounds.bound_relaxation`` rules a relaxation out only where its free optimum is no faster than the
    plan to beat: never just below that optimum; and the LP is tight enough to rule it out just above."""
    store = _problems()
    candidates = scenarios(store.at(PLACE))
    for group in dict.fromkeys(map(relaxation, candidates)):
        free = Bounds(store, PLACE, math.inf, candidates).solve_relaxation(group)
        assert isinstance(free, Solution)
        assert not Bounds(store, PLACE, math.inf, candidates).bound_relaxation(group, free.objective_s * 1.001)
        below = Bounds(store, PLACE, math.inf, candidates)
        assert below.bound_relaxation(group, free.objective_s * 0.99)
        assert all(below.of(s) >= free.objective_s * 0.99 for s in candidates if relaxation(s) == group)


def test_a_relaxation_is_bounded_by_one_with_fewer_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relaxation's free optimum is no faster than the same relaxation's at a micro-batch count dividing its
    own; so once that one is ruled out (by its LP) against a plan to beat, ``Bounds.bound_relaxation`` rules
    the finer count out without its LP, and its scenarios' bounds say so."""
    import autopar.search.bounds as bounds_module

    store = _problems()
    candidates = scenarios(store.at(PLACE))
    groups = list(dict.fromkeys(map(relaxation, candidates)))
    free = {g: Bounds(store, PLACE, math.inf, candidates).solve_relaxation(g) for g in groups}
    pairs = [(k, g) for k in groups for g in groups if k.micro_batches < g.micro_batches
             and g.micro_batches % k.micro_batches == 0 and replace(k, micro_batches=g.micro_batches) == g]
    assert pairs
    solved_lp: list[int] = []
    lp_floor = bounds_module.lp_floor
    monkeypatch.setattr(bounds_module, "lp_floor", lambda step, *a: solved_lp.append(
        step.scenario.micro_batches) or lp_floor(step, *a))
    for coarse, fine in pairs:
        slow, fast = free[fine], free[coarse]
        assert isinstance(slow, Solution) and isinstance(fast, Solution)
        assert slow.objective_s >= fast.objective_s * (1 - 1e-9)
        bounds, beat = Bounds(store, PLACE, math.inf, candidates), fast.objective_s * 0.99
        solved_lp.clear()
        assert bounds.bound_relaxation(coarse, beat) and solved_lp == [coarse.micro_batches]
        assert bounds.bound_relaxation(fine, beat) and solved_lp == [coarse.micro_batches]
        assert all(bounds.of(s) >= beat for s in candidates if relaxation(s) == fine)
        assert not Bounds(store, PLACE, math.inf, candidates).bound_relaxation(fine, slow.objective_s * 1.001)


def _every_scenario(store: Problems, limit: float) -> Solved | Pruned:
    """The search's answer by solving every scenario under the limit, nothing pruned."""
    candidates = scenarios(store.at(PLACE))
    free = ilp.solve(store.under(PLACE, candidates[0], limit), None)
    assert isinstance(free, Solution)
    found = _Found(candidates[0], free.objective_s)
    for scenario in candidates:
        problem = store.under(PLACE, scenario, limit)
        solution = ilp.solve(problem, limit, explain=False)
        if isinstance(solution, Solution):
            found.add(scenario, problem, solution)
    return found.result(store, PLACE, limit, candidates, math.inf)


@pytest.mark.parametrize("limit_mib", LIMITS_MIB)
def test_pruning_never_changes_the_plan(limit_mib: float) -> None:
    store, limit = _problems(), limit_mib * MiB
    every = _every_scenario(store, limit)
    searched = search_memory(store, PLACE, limit)
    assert isinstance(every, Solved) and isinstance(searched, Solved)
    assert searched.solution.objective_s == pytest.approx(every.solution.objective_s, rel=1e-9)
    assert searched.solution.memory_bytes <= limit
    counts = searched.solution.search  # every scenario accounted for, and the bounds spared solves
    assert counts["solved"] + counts["not_fitting"] + counts["bounded_out"] == counts["scenarios"] == 23
    assert counts["bounded_out"] >= 10


@pytest.mark.parametrize("limit_mib", LIMITS_MIB)
def test_a_scenario_tried_first_or_a_cutoff_above_the_best_never_changes_the_plan(limit_mib: float) -> None:
    """What a pipeline search passes a stage plan's memory search (``Bound``: a scenario solved first, a
    cutoff) changes the order of solves, never the plan; a cutoff below the best plan's time leaves no plan,
    said as a memory-limit error."""
    store, limit = _problems(), limit_mib * MiB
    best = search_memory(store, PLACE, limit)
    assert isinstance(best, Solved)
    for scenario in (scenarios(store.at(PLACE))[-1], best.solution.scenario):
        hinted = search_memory(store, PLACE, limit, Bound(hint=replace(scenario, micro_batches=7)))
        assert isinstance(hinted, Solved)
        assert hinted.solution.objective_s == pytest.approx(best.solution.objective_s, rel=1e-9)
        assert hinted.solution.scenario == best.solution.scenario
    capped = search_memory(_problems(), PLACE, limit, Bound(cutoff_s=best.solution.objective_s * 1.001))
    assert isinstance(capped, Solved)
    assert capped.solution.objective_s == pytest.approx(best.solution.objective_s, rel=1e-9)
    # given a plan to beat, a relaxation its LP puts past it is not solved (``Bounds.bound_relaxation``)
    assert capped.solution.search["free_solves"] < best.solution.search["free_solves"]
    below = search_memory(store, PLACE, limit, Bound(cutoff_s=best.solution.objective_s * 0.999))
    assert isinstance(below, Pruned) and isinstance(below.error, MemoryLimitError)
    assert "predicts less than" in below.reason


def test_with_a_plan_to_beat_a_scenario_is_asked_whether_it_fits_only_when_it_is_solved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a plan to beat, a scenario's first step is its LP bound alone: a least-memory solve (a MIP)
    is asked of it only once it is the least bound left and about to be solved, since most that the LP
    leaves in are bounded out by a plan found before then."""
    from autopar.search import memory
    asked: list[object] = []
    real = memory.may_fit

    def fit(step: object, *args: object, **kwargs: object) -> bool:
        asked.append(step.scenario)  # type: ignore[attr-defined]
        return real(step, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(memory, "may_fit", fit)
    store, limit = _problems(), LIMITS_MIB[0] * MiB
    best = search_memory(store, PLACE, limit)
    assert isinstance(best, Solved)
    scenario, beat_s = best.solution.scenario, best.solution.objective_s * 2  # a plan to beat, slower than its own
    candidates = scenarios(store.at(PLACE))
    bounds, found, waiting = Bounds(store, PLACE, limit, candidates), _Found(candidates[0], math.inf), [scenario]
    bounds.free[relaxation(scenario)] = 0.0  # its group bounded: the next step is its own LP
    asked.clear()
    memory._advance(scenario, bounds, found, waiting, beat_s, limit)
    assert scenario in bounds.lp and bounds.lp[scenario] < beat_s and waiting == [scenario] and not asked
    memory._advance(scenario, bounds, found, waiting, beat_s, limit)  # the least bound left: solved
    assert asked == [scenario] and not waiting and found.best is not None
    assert found.best.solution.objective_s == pytest.approx(best.solution.objective_s, rel=1e-9)


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
    """``Bounds.solve_lp``: the LP relaxation under the limit is below every scenario's best
    plan within it, above the free relaxation's bound for most, and absent where the
    relaxation does not fit either."""
    store, limit = _problems(), LIMITS_MIB[0] * MiB
    candidates = scenarios(store.at(PLACE))
    bounds = Bounds(store, PLACE, limit, candidates)
    tighter = 0
    for scenario in candidates:
        solution = ilp.solve(store.under(PLACE, scenario, limit), limit, explain=False)
        best = solution.objective_s if isinstance(solution, Solution) else None
        fits = bounds.solve_lp(scenario)
        assert fits or best is None, scenario
        if best is not None:
            assert bounds.lp[scenario] <= best * (1 + 1e-9), scenario
            tighter += bounds.lp[scenario] > bounds.node[scenario] * (1 + 1e-6)
    assert tighter >= len(candidates) // 2


def test_checkpointing_the_first_blocks_keeps_one_plan_for_every_block() -> None:
    """With only the first of the GPT's 2 blocks checkpointed, the two blocks are priced apart
    (``split_folding``) but tied to one strategy per op, as folded blocks run one plan: made
    dearer in the second block alone, an op's strategy changes in both or in neither (untied, the
    second block's leaves it)."""
    model, inputs, loss_fn, targets = gpt.build(batch=2)
    prepared = prepare(model, autopar.Mesh({"dp": 2, "tp": 2}, "h100"), inputs, loss_fn=loss_fn,
                       example_targets=targets, checkpoint="full", checkpoint_blocks=1, micro_batches=1, offload=False)
    graph, folding, ctx = prepared.graph, prepared.folding, prepared.ctx
    assert len(folding.tied) > 10  # every op of the block that records for backward
    chosen = solve(graph, folding, ctx, None).choice
    part = next(p for p in folding.tied if len(graph.nodes[p].strategies) > 1)
    first = folding.tied[part]
    node = graph.nodes[part]
    costs = list(node.costs)
    costs[chosen[part]] = replace(costs[chosen[part]], time=costs[chosen[part]].time + 1.0)
    dearer = replace(graph, nodes={**graph.nodes, part: replace(node, costs=costs)})
    tied = solve(dearer, folding, ctx, None)
    assert tied.choice[part] == tied.choice[first]
    # untied, the second block's op leaves its dearer strategy whatever the first block's does (which may
    # move too where another strategy costs the same: the plan has equal-cost choices), never at more cost
    untied = solve(dearer, replace(folding, tied={}), ctx, None)
    assert untied.choice[part] != chosen[part] and untied.objective_s <= tied.objective_s + 1e-12




def test_an_lp_bound_and_the_solve_it_lets_through_share_one_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """An LP bound that does not rule its problem out leaves its model for the solve that follows
    (``search.ilp``): one build for both, the same plan as a solve of its own; one that rules it out keeps
    none."""
    from autopar.search import ilp as search_ilp
    built: list[object] = []
    real = search_ilp.build

    def counted(*args: object, **kwargs: object) -> object:
        built.append(args[0])
        return real(*args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(search_ilp, "build", counted)
    store = _problems()
    first = store.first(PLACE, math.inf)
    alone = search_ilp.solve(first, None)
    assert isinstance(alone, Solution) and len(built) == 1
    relaxed = search_ilp.solve(first, None, relaxed=True, cutoff_s=alone.objective_s * 2)
    assert isinstance(relaxed, Solution) and relaxed.status == "relaxed" and len(built) == 2
    after = search_ilp.solve(first, None)
    assert isinstance(after, Solution) and len(built) == 2  # the LP's model
    assert after.choice == alone.choice and after.objective_s == alone.objective_s
    ruled_out = search_ilp.solve(first, None, relaxed=True, cutoff_s=alone.objective_s / 2)
    assert isinstance(ruled_out, NoPlan) and ruled_out.kind == "bound"
    assert first.parts.kept_model is None
