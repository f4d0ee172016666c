"""The MIP solved from its LP relaxation (``autopar.solver.warm_start.run_from_lp``): every path it takes
(an integral LP, a narrowed plan and reduced-cost fixing) ends at the optimum HiGHS finds without it."""

from __future__ import annotations

import pytest

import autopar
from autopar.search.problem import Place, scenarios
from autopar.solver import ilp, milp
from autopar.solver.warm_start import lp_likely, run_from_lp, run_under
from examples import gpt, llama
from tests.pairwise import cycle, pairwise
from tests.planning import problems


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("knapsack", [False, True])
def test_the_lp_led_solve_finds_highs_optimum(seed: int, knapsack: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = pairwise(seed, 10, cycle(10), knapsack)
    runs: list[dict[str, object]] = []
    real_run = milp.run

    def counted(*args: object, **kwargs: object) -> milp.Result:
        runs.append(kwargs)
        return real_run(*args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr("autopar.solver.warm_start.run", counted)
    led = run_from_lp(model, x, 60.0, None)
    plain = real_run(model, 60.0)
    assert led.status == plain.status == "optimal"
    assert led.objective == pytest.approx(plain.objective, rel=1e-9)
    assert led.values is not None
    assert all(abs(led.values[j] - round(led.values[j])) <= 1e-6 for j in model.integer)
    assert runs[0].get("relaxed") and len(runs) in (1, 2, 3)  # the LP integral, or a narrowed plan and the fixed MIP
    if knapsack:  # the memory row leaves the LP fractional: a narrowed plan, then the whole MIP with columns
        # fixed, branched on the memory row (no ``run``), or by HiGHS where that plan is within BRANCH_FROM_GAP
        assert len(runs) in (2, 3) and not runs[1].get("relaxed")
        assert len(runs) == 2 or runs[2]["zero"]
    elif len(runs) > 1:  # reduced costs fix columns of the whole MIP
        assert len(runs) == 3 and runs[2]["zero"]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("above", [1.0001, 1.05, 0.9999])
def test_a_cutoff_solve_fixing_columns_by_reduced_costs_is_the_plain_one(seed: int, above: float) -> None:
    """With a cutoff just over the optimum (or further, or under it), the solve whose LP's reduced costs
    fix columns finds the plain cutoff solve's optimum (or, as it, no plan), from its own LP or one given."""
    model, x = pairwise(seed, 10, cycle(10), knapsack=True)
    optimum = milp.run(model, 60.0).objective
    plain = milp.run(model, 60.0, optimum * above)
    lp = milp.run(model, 60.0, relaxed=True)
    for relaxation in (None, lp):
        fixed = run_under(model, 60.0, optimum * above, relaxation)
        assert fixed.status == plain.status == ("optimal" if above > 1 else "infeasible")
        assert fixed.objective == pytest.approx(plain.objective, rel=1e-9)
    slack = 1e-6 * optimum * above
    assert above < 1 or any(c > optimum * above - lp.objective + slack for c in lp.reduced_costs)  # some fixed


def test_each_path_is_taken() -> None:
    """A tree's pairwise LP is integral (the local polytope is exact there); cycles and a knapsack row
    leave it fractional, and reduced costs then fix columns before the whole MIP runs."""
    tree, x = pairwise(0, 8, [(v, v + 1) for v in range(7)], knapsack=False)
    lp = milp.run(tree, 60.0, relaxed=True)
    assert lp.values is not None and all(abs(lp.values[j] - round(lp.values[j])) <= 1e-6 for j in tree.integer)
    fractional = 0
    for seed in range(12):
        model, x = pairwise(seed, 10, cycle(10), knapsack=True)
        lp = milp.run(model, 60.0, relaxed=True)
        assert lp.values is not None and lp.reduced_costs is not None
        fractional += any(abs(lp.values[j] - round(lp.values[j])) > 1e-6 for j in model.integer)
    assert fractional >= 3


def test_likely_strategies_are_the_lp_support_then_least_reduced_cost() -> None:
    x = {"a": [0, 1, 2, 3, 4], "b": [5, 6]}
    values = [0.0, 0.5, 0.0, 0.5, 0.0, 1.0, 0.0]
    reduced = [3.0, 0.0, 1.0, 0.0, 1.0, 0.0, 9.0]
    assert lp_likely(x, values, reduced, keep=4) == {"a": [1, 3, 2, 4], "b": [0, 1]}
    assert lp_likely(x, values, reduced, keep=1) == {"a": [1, 3], "b": [0]}


@pytest.mark.slow
@pytest.mark.parametrize("build, mesh", [(gpt.build, {"dp": 2, "tp": 2}), (llama.build, {"dp": 2, "tp": 2}),
                                         (llama.build, {"tp": 4})])
def test_the_lp_led_solve_changes_speed_not_the_optimum(build: object, mesh: dict[str, int],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs, loss_fn, targets = build()  # type: ignore[operator]
    kwargs = {"loss_fn": loss_fn, "example_targets": targets, "pipeline": False}
    monkeypatch.setattr(ilp, "LP_LED_FROM_COLUMNS", 0)  # these models are small: led by the LP only when told
    led = autopar.plan(model, autopar.Mesh(mesh, "h100"), inputs, **kwargs)
    monkeypatch.setattr(ilp, "LP_LED_FROM_COLUMNS", 10**9)
    cold = autopar.plan(model, autopar.Mesh(mesh, "h100"), inputs, **kwargs)
    assert led.predicted.step_time_s == pytest.approx(cold.predicted.step_time_s, rel=1e-6)
    assert led.solver["status"] == cold.solver["status"] == "optimal"


@pytest.mark.slow
def test_the_lp_led_solve_under_a_binding_limit_is_the_plain_optimum() -> None:
    """GPT on dp2 x tp2 under 13 MB, where the memory row binds: the ILP of the first memory scenario and of
    partly checkpointed ones (split classes, ``test_tied_parts``) solved led by its LP and plainly gives one
    optimum."""
    model, inputs, loss_fn, targets = gpt.build()
    store = problems(model, inputs, loss_fn=loss_fn, example_targets=targets)
    place = Place(mesh=autopar.Mesh({"dp": 2, "tp": 2}, "h100"))
    solved = 0
    every = scenarios(store.at(place))
    for scenario in [every[0], *[s for s in every if s.checkpoint_blocks is not None][:2]]:
        problem = store.under(place, scenario, 13e6)
        built = ilp.build(problem.graph, problem.folding, problem.ctx, 13e6, shares=problem.memory_shares)
        led, plain = run_from_lp(built.model, built.x, 60.0, None), milp.run(built.model, 60.0)
        assert (led.values is None) == (plain.values is None)
        if plain.values is not None:
            solved += 1
            assert led.objective == pytest.approx(plain.objective, rel=1e-7)
    assert solved == 3


@pytest.mark.slow
def test_a_narrowed_plan_that_is_optimal_is_priced_as_it_is() -> None:
    """GPT on dp=2 under 9.3 MiB, ZeRO-1 chosen per parameter: the narrowed plan is the optimum, and a start
    given to HiGHS with columns fixed was priced 0.2% under itself there (HiGHS 1.16): the led solve's
    objective is its plan's, as the unled solve's is."""
    model, inputs, loss_fn, targets = gpt.build(batch=2)
    store = problems(model, inputs, loss_fn=loss_fn, example_targets=targets, offload=False)
    place, limit = Place(mesh=autopar.Mesh({"dp": 2}, "h100")), 9.3 * 2**20
    problem = store.under(place, scenarios(store.at(place))[1], limit)
    built = ilp.build(problem.graph, problem.folding, problem.ctx, limit, shares=problem.memory_shares)
    led = run_from_lp(built.model, built.x, 60.0, None)
    plain = milp.run(built.model, 60.0)
    assert led.values is not None and plain.values is not None
    assert led.objective == pytest.approx(plain.objective, rel=1e-9)
    assert led.objective == pytest.approx(sum(c * v for c, v in zip(built.model.cost, led.values)), rel=1e-9)
