"""The start HiGHS is given (``autopar.solver.warm_start``): exact where message passing is
(a tree), and never a different optimum than the solve without it."""

from __future__ import annotations

import itertools
import random

import pytest

import autopar
from autopar.solver import ilp
from autopar.solver.warm_start import PairTerms, likely_strategies
from examples import gpt, llama


def _chain(seed: int, nodes: int = 5, strategies: int = 4) -> tuple[dict[str, list[int]], list[float], PairTerms]:
    """A chain of nodes, each pair of neighbours priced by a random matrix over 2 placement groups."""
    rng = random.Random(seed)
    x: dict[str, list[int]] = {}
    cost: list[float] = []
    for v in range(nodes):
        x[f"n{v}"] = list(range(len(cost), len(cost) + strategies))
        cost += [rng.uniform(0, 10) for _ in range(strategies)]
    terms = PairTerms(strategy_columns=len(cost))
    for v in range(nodes - 1):
        groups_p = {"a": [0, 1], "b": [2, 3]}
        groups_c = {"a": [0, 2], "b": [1, 3]}
        columns = {}
        for ab in itertools.product(range(2), range(2)):
            columns[ab] = len(cost)
            cost.append(rng.uniform(0, 20))
        terms.add_edge(f"n{v}", f"n{v + 1}", groups_p, groups_c, columns, {})
    return x, cost, terms


def _price(choice: dict[str, int], x: dict[str, list[int]], cost: list[float], terms: PairTerms) -> float:
    total = sum(cost[x[v][s]] for v, s in choice.items())
    for p in terms.pairs:
        total += sum(cost[c] for c in p.columns[(p.group_p[choice[p.producer]], p.group_c[choice[p.consumer]])])
    return total


@pytest.mark.parametrize("seed", range(8))
def test_on_a_chain_the_first_choice_is_the_optimum(seed: int) -> None:
    x, cost, terms = _chain(seed)
    likely = likely_strategies(x, cost, terms, keep=2)
    best = min((dict(zip(x, combo)) for combo in itertools.product(*(range(len(c)) for c in x.values()))),
               key=lambda choice: _price(choice, x, cost, terms))
    assert _price({v: s[0] for v, s in likely.items()}, x, cost, terms) == pytest.approx(_price(best, x, cost, terms))
    assert all(len(s) == 2 and len(set(s)) == 2 for s in likely.values())


@pytest.mark.slow
@pytest.mark.parametrize("build, mesh", [(gpt.build, {"dp": 2, "tp": 2}), (llama.build, {"dp": 2, "tp": 2}),
                                         (llama.build, {"tp": 4})])
def test_the_start_changes_speed_not_the_optimum(build: object, mesh: dict[str, int],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs, loss_fn, targets = build()  # type: ignore[operator]
    kwargs = {"loss_fn": loss_fn, "example_targets": targets}
    monkeypatch.setattr(ilp, "NARROW_FROM_COLUMNS", 0)  # these models are small: narrowed only when told
    started = autopar.plan(model, autopar.Mesh(mesh, "h100"), inputs, **{"pipeline": False, **kwargs})
    # every strategy kept: no narrowed solve, so HiGHS runs from its own heuristics
    monkeypatch.setattr(ilp, "likely_strategies", lambda x, cost, terms, keep: {v: list(range(len(c)))
                                                                               for v, c in x.items()})
    cold = autopar.plan(model, autopar.Mesh(mesh, "h100"), inputs, **{"pipeline": False, **kwargs})
    assert started.predicted.step_time_s == pytest.approx(cold.predicted.step_time_s, rel=1e-6)
    assert started.solver["status"] == cold.solver["status"] == "optimal"
