"""``solve_step``: the fastest plan within the memory limit over the memory scenarios
(``autopar.memory.scenarios``), a branch and bound: the scenario with the least lower bound is
solved next (``_Bounds``: a free solve of its relaxation, then its own LP relaxation under the
limit), the search ends when none is below the best plan found, and a scenario whose leanest
plan does not fit is not solved for time (``_may_fit``)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Any

from autopar.cost.model import step_repeats
from autopar.memory.scenarios import Scenario, leanest, zero1_note
from autopar.errors import MemoryLimitError, SolverTimeLimitError
from autopar.solver.ilp import Solution, solve
from autopar.problem.nodes import PlanGraph
from autopar.step import PreparedStep, _stage, finish_step, paused_gc
from autopar.units import fmt_bytes


TIE = 1e-6
"""A scenario's solve under the limit seeks plans faster than the best found by more than this
fraction: the search keeps the first of equal plans anyway, and HiGHS's cutoff (its objective
bound) lets equal plans through, proving each optimal again (the 4-layer example Llama on a pp=2
stage mesh: 2-3 s per scenario)."""


LP_TIME_LIMIT_S = 10.0
"""Seconds an LP bound may take (0.05-3 s seen); past it the scenario is solved unbounded."""


def solve_step(prepared: PreparedStep, progress: bool = False) -> Solution:
    """The cheapest plan within the memory limit over the memory scenarios (``memory.scenarios``),
    and over both layouts of the context axes when the step has a zig-zag one
    (``PreparedStep.zigzag``: the faster plan is kept, the contiguous one on a tie)."""
    with _stage("solve", prepared.timings, progress), paused_gc():
        try:
            return _search_layouts(prepared)
        except MemoryLimitError as exc:
            if not prepared.memory_limit_origin:
                raise
            raise MemoryLimitError(f"{exc} (the limit is {prepared.memory_limit_origin})") from exc


def _search_layouts(prepared: PreparedStep) -> Solution:
    if prepared.zigzag is None:
        return _search(prepared)
    unfit: MemoryLimitError | None = None
    contiguous: Solution | None = None
    try:
        contiguous = _search(prepared)
    except MemoryLimitError as exc:
        unfit = exc  # zig-zag may fit: its busiest rank keeps fewer keys
    try:
        zigzag = _search(prepared.zigzag)
    except MemoryLimitError:
        if contiguous is None:
            raise unfit from None
        return contiguous
    if contiguous is not None and contiguous.objective_s <= zigzag.objective_s:
        return contiguous
    zigzag.zigzag = True
    return zigzag


def _solve(prepared: PreparedStep, memory_limit: float | None, **kwargs: Any) -> Solution:
    solution = solve(prepared.graph, prepared.folding, prepared.ctx, memory_limit,
                     time_limit_s=prepared.solver_time_limit_s, shares=prepared.memory_shares, **kwargs)
    solution.scenario = prepared.scenario
    return solution


def _search(prepared: PreparedStep) -> Solution:
    """Today's scenario unconstrained if its plan fits; else the fastest plan of every
    scenario, best first: each scenario's lower bound (``_Bounds``) decides what is solved
    next (``PreparedStep.try_first`` before any), and the search ends when no bound is below
    the best plan found or ``PreparedStep.cutoff_s``."""
    scenarios = prepared.scenarios()
    first = prepared.under(scenarios[0]) if prepared.scenario != scenarios[0] else prepared
    if len(scenarios) == 1:
        return _solve(first, prepared.memory_limit)
    free = _solve(first, None)
    if free.memory_bytes <= prepared.memory_limit:
        return free
    found = _Found(scenarios[0], free.objective_s)
    bounds = _Bounds(prepared, scenarios)
    bounds.relaxed(scenarios[0], free)
    waiting = list(scenarios)
    hint = _tried_first(prepared.try_first, waiting)
    counts = found.counts
    counts.update(scenarios=len(scenarios), free_solves=1, lp_bounds=0, solved=0, not_fitting=0, bounded_out=0)
    while waiting:
        # ties: the candidate order (cheapest-looking first)
        scenario = hint if hint in waiting else min(waiting, key=bounds.of)
        beat_s = min(prepared.cutoff_s, found.best.objective_s if found.best is not None else math.inf)
        if bounds.of(scenario) >= beat_s:
            counts["bounded_out"] += len(waiting)
            break  # no plan of this scenario, or of any still waiting, beats the best (or the cutoff)
        group = relaxation(scenario)
        if not bounds.has(group):  # bound its group first: one free solve bounds up to 18 scenarios
            relaxed = bounds.solve_relaxation(group, found)
            counts["free_solves"] += 1
            if relaxed is not None and group in waiting and relaxed.memory_bytes <= prepared.memory_limit:
                found.add(group, relaxed)  # its free plan fits: that is the group's own optimum
                waiting.remove(group)
                counts["solved"] += 1
            continue
        if scenario not in bounds.lp:  # then, if it may fit, its LP relaxation under the limit (sees memory)
            # the least-memory solve first: it proves a scenario that cannot fit in about a second,
            # where an LP took 15-120 s to (Llama-3-70B on a pp=8 stage mesh, m=16)
            if _may_fit(bounds.step(scenario), found.leanest, found.fit) and bounds.solve_lp(scenario):
                counts["lp_bounds"] += 1
            else:
                waiting.remove(scenario)
                counts["not_fitting"] += 1
            continue
        waiting.remove(scenario)
        step = bounds.step(scenario)
        counts["solved"] += 1
        try:
            found.add(scenario, _solve(step, prepared.memory_limit, explain=False,
                                       cutoff_s=None if math.isinf(beat_s) else beat_s * (1 - TIE)))
        except MemoryLimitError:
            continue
        except (RuntimeError, SolverTimeLimitError) as exc:  # said in the plan, not hidden
            found.failed.append(f"memory scenario '{scenario.describe()}' not searched: {exc}")
    return found.result(prepared, scenarios)


def _tried_first(hint: Scenario | None, scenarios: list[Scenario]) -> Scenario | None:
    """The scenario among ``memory.scenarios`` that is ``hint`` but for its micro-batch count, if any."""
    if hint is None:
        return None
    return next((s for s in scenarios if replace(s, micro_batches=hint.micro_batches) == hint), None)


def _may_fit(step: PreparedStep, leanest: dict[Scenario, Solution], fit: list[Scenario]) -> bool:
    """Whether some plan of the step's scenario fits the limit: the least-memory solve stops at
    the first plan that does (HiGHS's objective target), or proves the leanest does not. Solving for the least
    memory proves a scenario that cannot fit in a few seconds where the fastest plan under the
    limit may take minutes to prove infeasible (Llama-3-70B shape, 64 H100s, full
    checkpointing of 40 of 80 blocks: least memory 104.8 GiB in 2.7 s; fastest within 80 GiB
    still unproven after 120 s; on a pp=8 stage mesh, 90.8 GiB in 1.3 s against 67 s). Every node at its leanest
    strategy first: all other memory terms are >= 0, so when that sum is over the limit no solve is needed (that
    104.8 GiB scenario: 81.8 GiB). On a pipeline's stage mesh each node counts at the busiest rank's share
    (``MemoryShares``), as the solve's memory row does: whole, a 96-block model's state on a
    stage mesh of pp=32 was over the limit where its share, 3 blocks, is not. No solve either
    for a scenario that saves at least what one in ``fit`` (scenarios with a plan that fits)
    saves (``Scenario.saves_at_least``): the solve under the limit decides (Llama-3-70B, pp=8,
    m=64: 17 least-memory solves of 1-2 s each left out)."""
    shares = step.memory_shares
    least = sum(min(c.memory for c in node.costs) * (1.0 if shares is None else shares.weight(node))
                for node in step.graph.nodes.values() if node.costs)
    if least > step.memory_limit:
        return False
    if any(step.scenario.saves_at_least(other) for other in fit):
        return True
    try:  # stopped at the first plan that fits: whether one does is all this asks
        lean = _solve(step, None, explain=False, minimize_memory=True, enough_bytes=step.memory_limit)
    except (RuntimeError, SolverTimeLimitError):  # not proven either way: the solve under the limit decides
        return True
    if lean.status == "optimal":  # the leanest plan: what a no-fit error reports
        leanest[step.scenario] = lean
    fits = lean.status != "optimal" or lean.memory_bytes <= step.memory_limit
    if fits and lean.status in ("optimal", "target_reached"):
        fit.append(step.scenario)
    return fits


def relaxation(scenario: Scenario) -> Scenario:
    """The scenario without checkpointing or gathering again in backward: for every plan it
    predicts no more time than ``scenario`` does (``_Bounds``), so its free optimum bounds
    the scenario's."""
    return replace(scenario, checkpoint="none", checkpoint_blocks=None, regather=False, regather_blocks=None)


class _Found:
    """The plans the search found: the best, the ZeRO-1 ones it does not take (faster than the
    plan with memory to spare: searched as a memory saving only), what failed."""

    def __init__(self, first: Scenario, free_s: float) -> None:
        self.first, self.free_s = first, free_s
        self.best: Solution | None = None
        self.quicker: Solution | None = None
        self.faster: list[str] = []
        self.failed: list[str] = []
        self.fit: list[Scenario] = []
        """Scenarios with a plan that fits (``_may_fit``; ``found.add``'s)."""
        self.leanest: dict[Scenario, Solution] = {}
        """Scenario -> its least-memory plan, where ``_may_fit`` solved for it (``_nothing_fits`` reuses them)."""
        self.counts: Counter[str] = Counter()
        """Scenarios, free solves, and scenarios solved under the limit, skipped because their
        leanest plan does not fit, or left when the search stopped (``Solution.search``)."""

    def add(self, scenario: Scenario, found: Solution) -> None:
        self.fit.append(scenario)
        # ZeRO-1 added by the search (not pinned) on some parameters, and faster than with memory to spare
        if scenario.zero1 != self.first.zero1 and found.zero1_params and found.objective_s < self.free_s:
            if self.quicker is None or found.objective_s < self.quicker.objective_s:
                self.quicker = found
            self.faster.append(zero1_note(scenario, found.objective_s, self.free_s))
        elif self.best is None or found.objective_s < self.best.objective_s:
            self.best = found

    def result(self, prepared: PreparedStep, scenarios: list[Scenario]) -> Solution:
        if self.best is None and self.quicker is not None:  # ZeRO-1 fits, faster than with memory to spare
            self.quicker.notes = self.failed + [zero1_note(self.quicker.scenario, self.quicker.objective_s,
                                                           self.free_s, taken=True)]
            return replace(self.quicker, search=dict(self.counts))
        if self.best is None:
            if self.failed:
                raise RuntimeError("; ".join(self.failed))
            if math.isfinite(prepared.cutoff_s):  # the caller has a plan that fits: no need to say why none does
                raise MemoryLimitError(f"no plan of {len(scenarios)} memory scenarios fits and predicts less than "
                                       f"{prepared.cutoff_s:.6g} s")
            raise _nothing_fits(prepared, scenarios, self.leanest)
        self.best.notes = self.failed + self.faster[:1]
        return replace(self.best, search=dict(self.counts))


class _Bounds:
    """Seconds no plan of a scenario can beat, the larger of two bounds:
    - every node at its fastest strategy, with no collective (edges, gradient sync and
      exposed communication cost >= 0), priced with the fewest micro-batches searched, so
      that no scenario is captured again to be bounded: running the batch as more
      micro-batches never makes a node faster (its FLOPs add up to the same, its bytes and
      fixed costs do not shrink);
    - once its relaxation (``relaxation``: same micro-batches, ZeRO-1 and offload) is solved
      without the memory row, that optimum plus the least recompute the scenario adds.
      For any plan, checkpointing adds each replayed op's forward time and its replayed
      reshards, gathering again adds collectives and windows whose exposure is >= 0, and
      the windows a checkpointed block's recompute could hide are those of the gradient
      buckets only (regathers are windowed under blocks that do not recompute: the first
      blocks checkpoint), which hide at most ``grad_sync_overlap`` of the last
      micro-batch's share of it. So the scenario predicts at least the relaxation's time
      plus (1 - eff / repeats) x its least recompute (tested against free solves);
    - once it is the least bound left, its own ILP's LP relaxation under the memory limit
      (``solve_lp``): the only bound that sees memory, so the one that rules out scenarios a
      tight limit makes slow (the 4-layer example Llama on a pp=2 stage mesh: the relaxations
      bound every scenario at 0.086 s, their LPs at 0.111-0.176 s against plans of 0.114-0.206 s;
      the memory search 28 s -> 2.2 s, the same plan)."""

    def __init__(self, prepared: PreparedStep, scenarios: list[Scenario]) -> None:
        self.prepared = prepared
        self.steps: dict[Scenario, PreparedStep] = {}
        fewest = min(s.micro_batches for s in scenarios)
        by_rest: dict[Scenario, float] = {}
        self.node: dict[Scenario, float] = {}
        for scenario in scenarios:
            # gathering again prices edges, not nodes
            rest = replace(scenario, micro_batches=fewest, regather=False, regather_blocks=None)
            if rest not in by_rest:
                by_rest[rest] = _node_bound(self.step(rest).graph)
            self.node[scenario] = by_rest[rest]
        self.free: dict[Scenario, float | None] = {}
        """Relaxation -> its optimum without the memory row (None when not proven)."""
        self.full: dict[Scenario, float] = {}
        self.lp: dict[Scenario, float] = {}
        """Scenario -> its LP relaxation's optimum under the memory limit (``solve_lp``)."""
        self.floors: dict[tuple[int, str, int | None], float] = {}

    def step(self, scenario: Scenario) -> PreparedStep:
        """The step priced under ``scenario``, built once however many bounds and solves read it."""
        if scenario not in self.steps:
            self.steps[scenario] = self.prepared.under(scenario)
        return self.steps[scenario]

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

    def solve_lp(self, scenario: Scenario) -> bool:
        """Bound ``scenario`` by its LP relaxation under the memory limit (no plan within the limit
        beats it; 0 when not solved to optimality); False when even the relaxation does not fit."""
        step = replace(self.step(scenario),
                       solver_time_limit_s=min(LP_TIME_LIMIT_S, self.prepared.solver_time_limit_s))
        try:
            relaxed = _solve(step, self.prepared.memory_limit, explain=False, relaxed=True)
        except MemoryLimitError:
            return False
        except (RuntimeError, SolverTimeLimitError):  # no bound: the solve under the limit decides
            relaxed = None
        self.lp[scenario] = relaxed.objective_s if relaxed is not None and relaxed.status == "relaxed" else 0.0
        return True

    def has(self, group: Scenario) -> bool:
        return group in self.free

    def relaxed(self, group: Scenario, solution: Solution) -> None:
        """Record ``solution``, a free solve of ``group``, if ``group`` is a relaxation."""
        if group == relaxation(group):
            self.free[group] = solution.objective_s if solution.status == "optimal" else None

    def solve_relaxation(self, group: Scenario, found: _Found) -> Solution | None:
        """Solve ``group`` without the memory row and record its bound; its proven optimum, or None."""
        try:
            solution = _solve(self.step(group), None, explain=False)
        except (RuntimeError, SolverTimeLimitError) as exc:
            found.failed.append(f"memory scenario '{group.describe()}' not bounded: {exc}")
            self.free[group] = None
            return None
        self.relaxed(group, solution)
        return solution if solution.status == "optimal" else None

    def _recompute_floor(self, scenario: Scenario, group: Scenario) -> float:
        """(1 - eff / repeats) x the least recompute seconds any plan of ``scenario`` adds."""
        if scenario.checkpoint == "none":
            return 0.0
        key = (scenario.micro_batches, scenario.checkpoint, scenario.checkpoint_blocks)  # all it depends on
        if key not in self.floors:
            step, base = self.step(scenario), self.step(group)
            eff = step.ctx.mesh.hardware.grad_sync_overlap if step.ctx.train else 0.0
            added = sum(min(c.time - b.time for c, b in zip(node.costs, base.graph.nodes[name].costs))
                        for name, node in step.graph.nodes.items() if node.costs)
            self.floors[key] = max(0.0, 1.0 - eff / step_repeats(step.ctx)) * max(0.0, added)
        return self.floors[key]


def _node_bound(graph: PlanGraph) -> float:
    """Every node at its fastest strategy, nothing else: no plan of ``graph`` is faster."""
    return sum(min(c.time + comm for c, comm in zip(node.costs, node.comm_times or [0.0] * len(node.costs)))
               for node in graph.nodes.values() if node.costs)


def _nothing_fits(prepared: PreparedStep, scenarios: list[Scenario],
                  solved: dict[Scenario, Solution] | None = None) -> MemoryLimitError:
    """The error when no scenario fits: what the leanest plan needs, and its largest parts
    (``solved``: least-memory plans the search already has)."""
    solved = solved or {}
    lean = [(solved.get(p.scenario) or _solve(p, None, minimize_memory=True), p)
            for p in map(prepared.under, leanest(scenarios))]
    solution, step = min(lean, key=lambda pair: pair[0].memory_bytes)
    predicted = finish_step(step, solution).plan.predicted
    parts = ", ".join(f"{kind} {fmt_bytes(b)}" for kind, b in
                      sorted(predicted.memory_parts.items(), key=lambda item: -item[1]) if b)
    return MemoryLimitError(
        f"no plan fits the memory limit of {fmt_bytes(prepared.memory_limit)} per device; the plan with the least "
        f"memory ({step.scenario.describe()}) needs {fmt_bytes(predicted.peak_memory_bytes)} per device: {parts}")

