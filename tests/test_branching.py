"""The placement MIP branched on its memory row (``autopar.solver.branching``): the optimum HiGHS's own
branch and bound finds, under a cutoff or none, with columns held at 0, with general integer columns; a
search that outgrows its nodes says so and HiGHS finishes it (``solver.warm_start.whole``)."""

from __future__ import annotations

import math
import random

import pytest

from autopar.solver import branching, milp
from autopar.solver.branching import branch_on_memory
from autopar.solver.milp import RESHARDS, Model
from autopar.solver.warm_start import whole
from tests.pairwise import cycle, pairwise


def _integral_and_fits(model: Model, values: list[float]) -> bool:
    weights, _, limit = model.rows[model.knapsack]  # type: ignore[index]
    return all(abs(values[j] - round(values[j])) <= 1e-6 for j in model.integer) and \
        sum(w * values[j] for j, w in weights.items()) <= limit + 1e-6


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("above", [None, 1.05, 1.0001, 0.9999])
def test_branching_on_the_memory_row_finds_highs_optimum(seed: int, above: float | None) -> None:
    model, _ = pairwise(seed, 12, cycle(12), knapsack=True)
    optimum = milp.run(model, 60.0).objective
    cutoff = None if above is None else optimum * above
    plain = milp.run(model, 60.0, cutoff)
    branched = branch_on_memory(model, 60.0, cutoff)
    assert branched.result is not None and not branched.gave_up
    assert branched.result.status == plain.status == ("infeasible" if above is not None and above < 1 else "optimal")
    if plain.values is not None:
        assert branched.result.values is not None and _integral_and_fits(model, branched.result.values)
        assert branched.result.objective == pytest.approx(plain.objective, rel=1e-7)
        assert branched.result.objective == pytest.approx(
            sum(c * v for c, v in zip(model.cost, branched.result.values)), rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_columns_held_at_zero_are_never_chosen(seed: int) -> None:
    model, x = pairwise(seed, 10, cycle(10), knapsack=True)
    rng = random.Random(seed)
    zero = sorted({cols[rng.randrange(6)] for cols in x.values()} | {cols[rng.randrange(6)] for cols in x.values()})
    plain = milp.run(model, 60.0, zero=zero)
    branched = branch_on_memory(model, 60.0, zero=zero).result
    assert branched is not None and branched.status == plain.status
    if plain.values is not None:  # else nothing fits without them
        assert branched.values is not None and all(branched.values[j] == 0.0 for j in zero)
        assert branched.objective == pytest.approx(plain.objective, rel=1e-7)


@pytest.mark.parametrize("seed", range(8))
def test_general_integer_columns_branch_on_floor_and_ceiling(seed: int) -> None:
    """A column counting 0..7 (a bucket count's kind) that pays back time and weighs in the memory row:
    the LP takes a fraction of it, the branch and bound an integer, as HiGHS does."""
    model, _ = pairwise(seed, 8, cycle(8), knapsack=True)
    weights, lo, limit = model.rows[model.knapsack]  # type: ignore[index]
    count = model.var(-random.Random(seed).uniform(1.0, 4.0), integer=True, upper=7.0, term=RESHARDS)
    model.rows[model.knapsack] = ({**weights, count: 1.37}, lo, limit + 3.3)  # type: ignore[index]
    lp = milp.run(model, 60.0, relaxed=True)
    plain = milp.run(model, 60.0)
    branched = branch_on_memory(model, 60.0).result
    assert branched is not None and branched.values is not None and plain.values is not None
    assert _integral_and_fits(model, branched.values)
    assert branched.objective == pytest.approx(plain.objective, rel=1e-7)
    assert lp.objective <= branched.objective


def test_a_search_that_stops_early_says_so_and_highs_finishes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = pairwise(3, 12, cycle(12), knapsack=True)
    plain = milp.run(model, 60.0)
    stopped = branch_on_memory(model, 60.0, max_nodes=1)
    assert stopped.result is None and "stopped at 1 nodes" in stopped.gave_up
    assert stopped.bound <= plain.objective * (1 + 1e-9)
    assert stopped.values is None or stopped.objective >= plain.objective * (1 - 1e-9)
    monkeypatch.setattr(branching, "MAX_NODES", 1)
    finished = whole(model, 60.0, math.inf, [], milp.run(model, 60.0, relaxed=True).objective, lean=True)
    assert finished.status == "optimal" and finished.objective == pytest.approx(plain.objective, rel=1e-7)


def test_the_branch_column_weighs_most_in_memory_times_its_fraction() -> None:
    model = Model()
    for _ in range(4):
        model.var(0.0, integer=True)
    weights = {0: 10.0, 1: 1.0, 2: 100.0}
    assert branching._branch_column(model, weights, [0.5, 0.5, 0.02, 1.0]) == 0  # 5.0 over 2.0 and 0.5
    assert branching._branch_column(model, weights, [0.5, 0.5, 0.4, 1.0]) == 2
    assert branching._branch_column(model, {}, [0.2, 0.5, 1.0, 0.0]) == 1  # none weighs: the most fractional
    assert branching._branch_column(model, weights, [0.0, 1.0, 1.0 - 1e-7, 0.0]) is None
