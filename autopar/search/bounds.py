"""Lower bounds on the memory scenarios' plans, for the memory search's branch and bound
(``search.memory``): seconds no plan of a scenario can beat, and whether some plan of it fits."""

from __future__ import annotations

import math
from dataclasses import replace

from autopar.cost.model import step_repeats
from autopar.memory.scenarios import Scenario
from autopar.problem.nodes import PlanGraph
from autopar.search import ilp
from autopar.search.account import Account
from autopar.search.problem import Place, Problem, Problems
from autopar.solver.ilp import NoPlan, Solution

LP_TIME_LIMIT_S = 10.0
"""Seconds an LP bound may take; past it the scenario is solved unbounded."""


def relaxation(scenario: Scenario) -> Scenario:
    """The scenario without checkpointing or gathering again in backward: for every plan it
    predicts no more time than ``scenario`` does (``Bounds``), so its free optimum bounds
    the scenario's."""
    return replace(scenario, checkpoint="none", checkpoint_blocks=None, regather=False, regather_blocks=None)


def lp_floor(step: Problem, memory_limit: float | None, beat_s: float, account: Account) -> float | None:
    """Seconds no plan of ``step`` within ``memory_limit`` (None: no memory row) beats, by its LP relaxation,
    which HiGHS's dual simplex stops once it passes ``beat_s``: ``beat_s`` then, its optimum where solved, 0
    where not in time (no bound: a solve decides); None where even the relaxation does not fit."""
    relaxed = ilp.solve(step, memory_limit, explain=False, relaxed=True, time_limit_s=LP_TIME_LIMIT_S,
                        account=account, cutoff_s=None if math.isinf(beat_s) else beat_s)
    if isinstance(relaxed, NoPlan):
        return None if relaxed.kind == "memory" else beat_s if relaxed.kind == "bound" else 0.0
    return relaxed.objective_s if relaxed.status == "relaxed" else 0.0


class Bounds:
    """Seconds no plan of a scenario can beat, the larger of three bounds:
    - every node at its fastest strategy, with no collective (edges, gradient sync and exposed
      communication cost >= 0), priced with the fewest micro-batches searched, so that no scenario
      is captured again to be bounded: running the batch as more micro-batches never makes a node
      faster (its FLOPs add up to the same, its bytes and fixed costs do not shrink);
    - once its relaxation (``relaxation``: same micro-batches, ZeRO-1 and offload) is solved
      without the memory row (or, where a plan to beat is known, bounded by that solve's LP
      relaxation: ``bound_relaxation``), that optimum (or bound) plus the least recompute the
      scenario adds. For any plan, checkpointing adds each replayed op's forward time and its
      replayed reshards, gathering again adds collectives and windows whose exposure is >= 0, and
      the windows a checkpointed block's recompute could hide are those of the gradient buckets
      only, which hide at most ``grad_sync_overlap`` of the last micro-batch's share of it. So the
      scenario predicts at least the relaxation's time plus (1 - eff / repeats) x its least recompute
      (tested against free solves);
    - once it is the least bound left, its own ILP's LP relaxation under the memory limit
      (``solve_lp``): the only bound that sees memory, so the one that rules out scenarios a
      tight limit makes slow."""

    def __init__(self, problems: Problems, place: Place, limit: float, scenarios: list[Scenario]) -> None:
        self.problems, self.place, self.limit = problems, place, limit
        fewest = min(s.micro_batches for s in scenarios)
        by_rest: dict[Scenario, float] = {}
        self.node: dict[Scenario, float] = {}
        for scenario in scenarios:
            rest = replace(scenario, micro_batches=fewest, regather=False, regather_blocks=None)  # regathers: edges
            if rest not in by_rest:
                step = self.step(rest)
                by_rest[rest] = step.parts.by_graph.kept("node bound", step.graph, lambda: node_bound(step.graph))
            self.node[scenario] = by_rest[rest]
        self.free: dict[Scenario, float | None] = {}
        """Relaxation -> its optimum without the memory row, or a bound no plan of it beats (None when
        neither is proven)."""
        self.full: dict[Scenario, float] = {}
        self.lp: dict[Scenario, float] = {}
        """Scenario -> its LP relaxation's optimum under the memory limit (``solve_lp``)."""

    def step(self, scenario: Scenario) -> Problem:
        """The problem priced under ``scenario``, within the search's limit."""
        return self.problems.under(self.place, scenario, self.limit)

    def of(self, scenario: Scenario) -> float:
        return max(self._free_bound(scenario), self.lp.get(scenario, 0.0))

    def _free_bound(self, scenario: Scenario) -> float:
        if scenario in self.full:
            return self.full[scenario]
        group = relaxation(scenario)
        if group not in self.free:
            return self.node[scenario]
        free = self.free[group]
        bound = 0.0 if free is None else free + self._recompute_floor(scenario, group)
        self.full[scenario] = max(self.node[scenario], bound)
        return self.full[scenario]

    def solve_lp(self, scenario: Scenario, beat_s: float = math.inf) -> bool:
        """Bound ``scenario`` by its LP relaxation under the memory limit (no plan within the limit
        beats it; 0 when not solved to optimality); False when even the relaxation does not fit. Only
        whether it beats ``beat_s`` (the best plan's seconds) is asked: an LP known to be over it stops
        there, its bound ``beat_s``."""
        floor = lp_floor(self.step(scenario), self.limit, beat_s, self.problems.account)
        if floor is None:
            return False
        self.lp[scenario] = floor
        return True

    def has(self, group: Scenario) -> bool:
        return group in self.free

    def relaxed(self, group: Scenario, solution: Solution) -> None:
        """Record ``solution``, a free solve of ``group``, if ``group`` is a relaxation."""
        if group == relaxation(group):
            self.free[group] = solution.objective_s if solution.status == "optimal" else None

    def bound_relaxation(self, group: Scenario, beat_s: float) -> bool:
        """Whether no plan of ``group``, a relaxation, beats ``beat_s`` without the memory row, by its LP
        relaxation (HiGHS's dual simplex, stopped once past ``beat_s``): then its scenarios' bounds are no
        faster than ``beat_s`` either and the free solve is not needed. Far cheaper than that solve, and in
        practice as tight (the placement LP's vertices are nearly integral). No LP is needed where a
        relaxation alike but for fewer micro-batches, their count dividing ``group``'s, is bounded or solved
        at ``beat_s`` or more: cutting each of its micro-batches into equal ones makes no plan faster (each
        op's FLOPs add up to the same; its bytes read, fixed costs, reshards and unhidden gradient sync do
        not shrink; every split of the smaller rows divides the larger), as a pipeline's stage plans are
        bounded (``search.stage_plans.PipelineSearch.free_plan``)."""
        coarser = self._coarser_bound(group)
        if coarser >= beat_s:
            self.free[group] = coarser
            return True
        floor = lp_floor(self.step(group), None, beat_s, self.problems.account)
        over = floor is not None and floor >= beat_s
        if over:
            self.free[group] = beat_s
        return over

    def _coarser_bound(self, group: Scenario) -> float:
        """The largest bound (or optimum) of a relaxation like ``group`` but for fewer micro-batches, their
        count dividing ``group``'s: no plan of ``group`` beats it (``bound_relaxation``); 0 where none is."""
        m = group.micro_batches
        return max((b for g, b in self.free.items() if b is not None and g.micro_batches < m
                    and m % g.micro_batches == 0 and replace(g, micro_batches=m) == group), default=0.0)

    def solve_relaxation(self, group: Scenario) -> Solution | NoPlan:
        """Solve ``group`` without the memory row and record its bound; its solution, or why there is none."""
        solution = ilp.solve(self.step(group), None, explain=False, account=self.problems.account)
        if isinstance(solution, NoPlan):
            self.free[group] = None
            return solution
        self.relaxed(group, solution)
        return solution

    def _recompute_floor(self, scenario: Scenario, group: Scenario) -> float:
        """(1 - eff / repeats) x the least recompute seconds any plan of ``scenario`` adds."""
        if scenario.checkpoint == "none":
            return 0.0
        step, base = self.step(scenario), self.step(group)  # its checkpointing and base graph decide it
        return base.parts.by_graph.kept(("recompute floor", scenario.checkpoint, scenario.checkpoint_blocks),
                                        base.graph, lambda: _recompute_floor(step, base))


def _recompute_floor(step: Problem, base: Problem) -> float:
    """``Bounds._recompute_floor`` of ``step`` over ``base``, its relaxation."""
    eff = step.ctx.mesh.hardware.grad_sync_overlap if step.ctx.train else 0.0
    added = sum(min(c.time - b.time for c, b in zip(node.costs, base.graph.nodes[name].costs))
                for name, node in step.graph.nodes.items() if node.costs)
    return max(0.0, 1.0 - eff / step_repeats(step.ctx)) * max(0.0, added)


def node_bound(graph: PlanGraph) -> float:
    """Every node at its fastest strategy, nothing else: no plan of ``graph`` is faster."""
    return sum(min(c.time + comm for c, comm in zip(node.costs, node.comm_times or [0.0] * len(node.costs)))
               for node in graph.nodes.values() if node.costs)


def leanest_over(step: Problem) -> bool:
    """Every node at its leanest strategy is over the problem's limit (all other memory terms are >= 0, so
    no plan fits); on a pipeline's stage mesh each node counts at the busiest rank's share (``MemoryShares``),
    as the solve's memory row does."""
    shares, graph = step.memory_shares, step.graph
    least = step.parts.by_graph.kept("least memory", graph, lambda: _least_memory(graph))
    return sum(bytes_ * (1.0 if shares is None else shares.weight(graph.nodes[name]))
               for name, bytes_ in least.items()) > step.memory_limit


def _least_memory(graph: PlanGraph) -> dict[str, float]:
    """Each priced node's least memory over its strategies."""
    return {name: min(c.memory for c in node.costs) for name, node in graph.nodes.items() if node.costs}


def may_fit(step: Problem, leanest: dict[Scenario, Solution], fit: list[Scenario], account: Account | None = None
            ) -> bool:
    """Whether some plan of the problem's scenario fits its limit. Solving for the least memory, stopped
    at the first plan that fits (HiGHS's objective target), proves a scenario that cannot fit far sooner
    than the fastest plan under the limit is proven infeasible. Before that, every node at its leanest
    strategy (``leanest_over``): when that is over the limit no solve is needed. No solve either for a
    scenario that saves at least what one in ``fit`` (scenarios with a plan that fits) saves
    (``Scenario.saves_at_least``): the solve under the limit decides. ``leanest`` gains the least-memory
    plans found (what a no-fit error reports)."""
    if leanest_over(step):
        return False
    if any(step.scenario.saves_at_least(other) for other in fit):
        return True
    lean = ilp.solve(step, None, explain=False, minimize_memory=True, enough_bytes=step.memory_limit, account=account)
    if isinstance(lean, NoPlan):  # none needs the limit or less: no fit; else not proven, the solve under it decides
        return lean.kind != "memory"
    if lean.status == "optimal":
        leanest[step.scenario] = lean
    fits = lean.status != "optimal" or lean.memory_bytes <= step.memory_limit
    if fits and lean.status in ("optimal", "target_reached"):
        fit.append(step.scenario)
    return fits
