"""``solve_step``: the fastest plan within the memory limit over the memory scenarios
(``autopar.scenarios``), the likeliest first, each bounded before it is solved."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.scenarios import Scenario, leanest, zero1_note
from autopar.solver.ilp import MemoryLimitError, Solution, SolverTimeLimitError, solve
from autopar.solver.nodes import PlanGraph
from autopar.step import PreparedStep, _stage, finish_step
from autopar.units import fmt_bytes


def solve_step(prepared: PreparedStep, progress: bool = False) -> Solution:
    """The cheapest plan within the memory limit over the memory scenarios (``scenarios``)."""
    with _stage("solve", prepared.timings, progress):
        try:
            return _search(prepared)
        except MemoryLimitError as exc:
            if not prepared.memory_limit_origin:
                raise
            raise MemoryLimitError(f"{exc} (the limit is {prepared.memory_limit_origin})") from exc


def _solve(prepared: PreparedStep, memory_limit: float | None, **kwargs: Any) -> Solution:
    solution = solve(prepared.graph, prepared.folding, prepared.ctx, memory_limit,
                     time_limit_s=prepared.solver_time_limit_s, **kwargs)
    solution.scenario = prepared.scenario
    return solution


def _search(prepared: PreparedStep) -> Solution:
    """Today's scenario unconstrained if its plan fits; else the fastest plan of every scenario."""
    scenarios = prepared.scenarios()
    first = prepared.under(scenarios[0]) if prepared.scenario != scenarios[0] else prepared
    if len(scenarios) == 1:
        return _solve(first, prepared.memory_limit)
    free = _solve(first, None)
    if free.memory_bytes <= prepared.memory_limit:
        return free
    best: Solution | None = None
    failed: list[str] = []
    faster: list[str] = []  # ZeRO-1 scenarios faster than the plan with memory to spare (not taken)
    quicker: Solution | None = None  # the fastest of them: the plan when nothing else fits
    bounds = _lower_bounds(prepared, scenarios)
    for scenario in sorted(scenarios, key=lambda s: bounds[s]):  # the likeliest first: they prune the rest
        if best is not None and bounds[scenario] >= best.objective_s:
            break  # no plan of this scenario, or of any after it, beats the best
        step = prepared.under(scenario)
        if best is not None and _node_bound(step.graph) >= best.objective_s:
            continue  # bounded at its own micro-batch count
        try:
            found = _solve(step, prepared.memory_limit, explain=False,
                           cutoff_s=None if best is None else best.objective_s)
        except MemoryLimitError:
            continue
        except (RuntimeError, SolverTimeLimitError) as exc:  # said in the plan, not hidden
            failed.append(f"memory scenario '{scenario.describe()}' not searched: {exc}")
            continue
        if scenario.zero1 != scenarios[0].zero1 and found.objective_s < free.objective_s:  # added by the search
            if quicker is None or found.objective_s < quicker.objective_s:
                quicker = found
            faster.append(zero1_note(scenario, found.objective_s, free.objective_s))
            continue
        if best is None or found.objective_s < best.objective_s:
            best = found
    if best is None and quicker is not None:  # a plan fits: ZeRO-1, faster than with memory to spare, not an error
        quicker.notes = failed + [zero1_note(quicker.scenario, quicker.objective_s, free.objective_s, taken=True)]
        return quicker
    if best is None:
        if failed:
            raise RuntimeError("; ".join(failed))
        raise _nothing_fits(prepared, scenarios)
    best.notes = failed + faster[:1]
    return best


def _lower_bounds(prepared: PreparedStep, scenarios: list[Scenario]) -> dict[Scenario, float]:
    """Seconds no plan of each scenario can beat: every node at its fastest strategy, with
    no collective (edges, gradient sync and exposed communication cost >= 0), priced with
    the fewest micro-batches searched, so that no scenario is captured again to be bounded.
    Running the batch as more micro-batches never makes a node faster (its FLOPs add up to
    the same, its bytes and fixed costs do not shrink), so that bounds every count."""
    fewest = min(s.micro_batches for s in scenarios)
    bounds: dict[Scenario, float] = {}
    by_rest: dict[Scenario, float] = {}
    for scenario in scenarios:
        rest = replace(scenario, micro_batches=fewest)
        if rest not in by_rest:
            by_rest[rest] = _node_bound(prepared.under(rest).graph)
        bounds[scenario] = by_rest[rest]
    return bounds


def _node_bound(graph: PlanGraph) -> float:
    """Every node at its fastest strategy, nothing else: no plan of ``graph`` is faster."""
    return sum(min(c.time + comm for c, comm in zip(node.costs, node.comm_times or [0.0] * len(node.costs)))
               for node in graph.nodes.values() if node.costs)


def _nothing_fits(prepared: PreparedStep, scenarios: list[Scenario]) -> MemoryLimitError:
    """The error when no scenario fits: what the leanest plan needs, and its largest parts."""
    lean = [(sol, p) for p in map(prepared.under, leanest(scenarios))
            for sol in [_solve(p, None, minimize_memory=True)]]
    solution, step = min(lean, key=lambda pair: pair[0].memory_bytes)
    predicted = finish_step(step, solution).plan.predicted
    parts = ", ".join(f"{kind} {fmt_bytes(b)}" for kind, b in
                      sorted(predicted.memory_parts.items(), key=lambda item: -item[1]) if b)
    return MemoryLimitError(
        f"no plan fits the memory limit of {fmt_bytes(prepared.memory_limit)} per device; the plan with the least "
        f"memory ({step.scenario.describe()}) needs {fmt_bytes(predicted.peak_memory_bytes)} per device: {parts}")

