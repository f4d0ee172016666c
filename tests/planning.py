"""Helpers for tests of the search's levels: a step's problem prepared at a place of the search, as the
planner prepares it (``search.problem``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from torch import nn

from autopar.config import PlanConfig
from autopar.hardware import get_profile
from autopar.mesh import Mesh
from autopar.search.context import search_context
from autopar.search.memory import Solved
from autopar.search.planned import PlannedStep, finish
from autopar.search.problem import Place, Problem, Problems, Step, first_place, scenarios
from autopar.solver.ilp import Solution

STEP_ARGS = ("loss_fn", "example_kwargs", "example_targets")

def problems(model: nn.Module, inputs: tuple[Any, ...], **options: Any) -> Problems:
    """The problems of ``model``'s step (``loss_fn``, ``example_targets``... among ``options``) under the rest."""
    step = Step(model=model, example_inputs=inputs, **{k: v for k, v in options.items() if k in STEP_ARGS})
    return Problems(step, PlanConfig.from_options(**{k: v for k, v in options.items() if k not in STEP_ARGS}))

def problem_at(model: nn.Module, mesh: Mesh, inputs: tuple[Any, ...], *, m: int = 1,
               pipeline_ranks: int | None = None, symbolic: bool = False, limit: float | None = None,
               **options: Any) -> Problem:
    """The step's problem at a place (m micro-batches), under its first scenario, within ``limit`` (None: the
    config's)."""
    store = problems(model, inputs, **options)
    place = Place(mesh=mesh, micro_batches=m, pipeline_ranks=pipeline_ranks, symbolic=symbolic)
    first = scenarios(store.at(place))[0]
    return store.under(place, first, store.config.memory.limit(mesh) if limit is None else limit)



def solved(model: nn.Module, mesh: Mesh, inputs: tuple[Any, ...], **options: Any) -> tuple[PlannedStep, Solution]:
    """The step planned without a pipeline (its layouts' memory searches), and the solution of its ILP."""
    store = problems(model, inputs, **options)
    config = store.config
    found = search_context(store, first_place(config, mesh), config.memory.limit(mesh))
    assert isinstance(found, Solved), found
    return finish(found.problem, found.solution), found.solution


def assert_one_price(plan: Any) -> None:
    """The plan's predicted step is its ILP's objective (by term), and the collectives it lists, with its
    compute, add up to the same seconds: what the runtime runs is what was priced."""
    predicted = plan.predicted
    assert plan.solver["objective_s"] == pytest.approx(predicted.step_time_s, rel=1e-9)
    assert sum(predicted.terms.values()) == pytest.approx(predicted.step_time_s, rel=1e-12)
    assert predicted.compute_time_s + predicted.comm_time_s == pytest.approx(predicted.step_time_s, rel=1e-9)


H100_STATE_ONCE = dataclasses.replace(get_profile("h100"), name="h100-state-once", optimizer_traffic=2.0)
"""h100 with the optimizer's update moving its state once each way (the cpu profile's figure), for tests of
ZeRO-1 chosen for memory: there it costs time (its reduce-scatter and all-gather wait where DDP's all-reduce
hides behind backward). With the GPU's foreach AdamW (5x the state's bytes), sharding the update saves more
than those collectives cost on a large parameter, and every parameter would be ZeRO-1 whatever the limit."""
