"""The memory level of the search: the fastest plan within the memory limit over the memory scenarios
(``memory.scenarios``: micro-batches, checkpointing, re-gathering, offload, ZeRO-1), a branch and bound.
With memory to spare the first scenario's free plan fits and is the plan (one solve). Otherwise the
scenario with the least lower bound (``search.bounds``: a free solve of its relaxation, then its own
LP relaxation under the limit) is solved next, one whose leanest plan does not fit is skipped, and the
search ends when no bound is below the best plan found or the caller's cutoff."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from autopar.errors import MemoryLimitError
from autopar.memory.scenarios import Scenario, leanest, zero1_note
from autopar.search import ilp
from autopar.search.account import Account
from autopar.search.bounds import Bounds, leanest_over, lp_floor, may_fit, relaxation
from autopar.search.planned import finish
from autopar.search.problem import Place, Problem, Problems, scenarios
from autopar.solver.ilp import NoPlan, Solution
from autopar.units import fmt_bytes, fmt_time

TIE = 1e-6
"""A scenario's solve under the limit seeks plans faster than the best found by more than this fraction:
the search keeps the first of equal plans anyway, and HiGHS's cutoff (its objective bound) lets equal
plans through, proving each optimal again."""


@dataclass(frozen=True, kw_only=True)
class Bound:
    """What a caller already has: no plan slower than ``cutoff_s`` is wanted, and ``hint`` (a scenario
    but for its micro-batch count, another count's choice) is solved first, a likely good incumbent."""

    cutoff_s: float = math.inf
    hint: Scenario | None = None


@dataclass(frozen=True)
class Solved:
    """A level's plan: the problem it was solved on (under its scenario) and the solution."""

    problem: Problem
    solution: Solution


@dataclass(frozen=True)
class Pruned:
    """A level gave no plan: why, and the error its user gets when nothing else gives one."""

    reason: str
    error: Exception
    bounded: bool = False
    """No plan of it beats the caller's cutoff (``Bound.cutoff_s``), as a bound proved without solving."""


def search_memory(problems: Problems, place: Place, limit: float, bound: Bound = Bound()) -> Solved | Pruned:
    """The fastest plan at ``place`` within ``limit`` over its memory scenarios (module docstring)."""
    candidates = scenarios(problems.at(place))
    first = problems.under(place, candidates[0], limit)
    if math.isinf(limit) and _over_cutoff(problems, place, first, bound.cutoff_s):
        why = f"no plan of it predicts less than {fmt_time(bound.cutoff_s)} (its LP relaxation's bound)"
        return Pruned(why, MemoryLimitError(why), bounded=True)
    if len(candidates) == 1:
        return _one(first, limit, problems.account)
    free = problems.solved_free(place, candidates[0], lambda: ilp.solve(first, None, account=problems.account))
    free = free if isinstance(free, NoPlan) else replace(free)  # a copy: a result's notes are set on it
    if isinstance(free, NoPlan):
        return Pruned(free.message, free.error())
    if free.memory_bytes <= limit:
        problems.account.record("memory", candidates[0].describe(), "chosen", free.objective_s,
                                f"fits with memory to spare (1 of {len(candidates)} scenarios solved)")
        return Solved(first, free)
    found = _Found(candidates[0], free.objective_s)
    bounds = Bounds(problems, place, limit, candidates)
    bounds.relaxed(candidates[0], free)
    waiting = list(candidates)
    hint = next((s for s in waiting if bound.hint is not None
                 and replace(s, micro_batches=bound.hint.micro_batches) == bound.hint), None)
    found.counts.update(scenarios=len(candidates), free_solves=1, lp_bounds=0, solved=0, not_fitting=0,
                        bounded_out=0)
    while waiting:
        scenario = hint if hint in waiting else min(waiting, key=bounds.of)  # ties: the candidates' order
        beat_s = min(bound.cutoff_s, found.best.solution.objective_s if found.best is not None else math.inf)
        if bounds.of(scenario) >= beat_s:  # no plan of this scenario, or of any still waiting, beats it
            found.counts["bounded_out"] += len(waiting)
            found.fates.update({s: ("bounded out", bounds.of(s), f"its bound is no faster than {fmt_time(beat_s)}")
                                for s in waiting})
            break
        with problems.account.inside(f"scenario {candidates.index(scenario) + 1} of {len(candidates)}"):
            _advance(scenario, bounds, found, waiting, beat_s, limit)
    found.account(problems.account, candidates)
    return found.result(problems, place, limit, candidates, bound.cutoff_s)


def free_plan(problems: Problems, place: Place, limit: float) -> tuple[float, bool]:
    """The step's time at ``place`` planned without the memory limit, under its first memory scenario (the
    free solve ``search_memory`` starts from, solved once for both), and whether that plan fits ``limit``:
    a plan under the limit is in practice no faster. Infinite where there is no such plan."""
    candidates = scenarios(problems.at(place))
    first = problems.under(place, candidates[0], math.inf)
    free = problems.solved_free(place, candidates[0], lambda: ilp.solve(first, None, account=problems.account))
    return (math.inf, False) if isinstance(free, NoPlan) else (free.objective_s, free.memory_bytes <= limit)


def _over_cutoff(problems: Problems, place: Place, free: Problem, cutoff_s: float) -> bool:
    """Whether no plan of ``free`` (``place`` under its first scenario, no memory limit: what the search
    returns there) predicts less than ``cutoff_s``: its free solve's optimum where solved, else its LP
    relaxation (no plan beats it), which HiGHS stops once it passes the cutoff. A pipeline's stage plans
    are bounded so before any is solved (``search.stage_plans``)."""
    if math.isinf(cutoff_s):
        return False
    floor, solved = problems.free_floor(place, free.scenario)
    if solved or floor >= cutoff_s:
        return floor >= cutoff_s
    floor = lp_floor(free, None, cutoff_s, problems.account) or 0.0  # 0: no bound, the solve decides
    problems.bounded_free(place, free.scenario, floor)
    return floor >= cutoff_s


def _one(problem: Problem, limit: float, account: Account) -> Solved | Pruned:
    """Everything pinned: the one scenario's plan under the limit."""
    solution = ilp.solve(problem, limit, account=account)
    if isinstance(solution, NoPlan):
        return Pruned(solution.message, _with_origin(solution.error(), problem))
    return Solved(problem, solution)


def _advance(scenario: Scenario, bounds: Bounds, found: _Found, waiting: list[Scenario], beat_s: float,
             limit: float) -> None:
    """One step of the branch and bound on ``scenario``, the least bound waiting: bound its group by a
    free solve (by that solve's LP first, where a plan to beat is known: ``Bounds.bound_relaxation``), then
    itself by its LP under the limit (if it may fit at all), then solve it."""
    counts, account = found.counts, bounds.problems.account
    group = relaxation(scenario)
    if not bounds.has(group) and math.isfinite(beat_s) and bounds.bound_relaxation(group, beat_s):
        counts["lp_bounds"] += 1  # no plan of the group beats the best: its free solve is not needed
        return
    if not bounds.has(group):  # one free solve bounds every scenario of its group
        relaxed = bounds.solve_relaxation(group)
        counts["free_solves"] += 1
        if isinstance(relaxed, NoPlan):
            found.failed.append(f"memory scenario '{group.describe()}' not bounded: {relaxed.message}")
        elif relaxed.status == "optimal" and group in waiting and relaxed.memory_bytes <= limit:
            found.add(group, bounds.step(group), relaxed)  # its free plan fits: that is the group's own optimum
            waiting.remove(group)
            counts["solved"] += 1
        return
    if scenario not in bounds.lp:
        if _bounded(scenario, bounds, found, beat_s):
            counts["lp_bounds"] += 1
        else:
            _does_not_fit(scenario, found, waiting)
        return
    step = bounds.step(scenario)
    if scenario not in found.checked and not _fits(step, found, account):  # asked only of what is solved
        _does_not_fit(scenario, found, waiting)
        return
    waiting.remove(scenario)
    counts["solved"] += 1
    solution = ilp.solve(step, limit, explain=False, cutoff_s=None if math.isinf(beat_s) else beat_s * (1 - TIE),
                         account=account)
    if isinstance(solution, Solution):
        found.add(scenario, step, solution)
    elif solution.kind != "memory":  # said in the plan, not hidden
        found.failed.append(f"memory scenario '{scenario.describe()}' not searched: {solution.message}")
        found.fates[scenario] = ("failed", None, solution.message)
    else:
        found.fates[scenario] = ("pruned", None, "no plan within the limit beats the best found")


def _bounded(scenario: Scenario, bounds: Bounds, found: _Found, beat_s: float) -> bool:
    """``scenario`` bounded by its LP under the limit, where some plan of it may fit (False: none does).
    Without a plan to beat, the least-memory solve first: it proves a scenario that cannot fit quickly.
    With one, the LP alone (stopped once past it): past it, the scenario is out whether it fits or not,
    and one the LP leaves in is asked whether some plan fits only once it is the least bound left, about
    to be solved (``_advance``): most are bounded out by a plan found before then, and a least-memory
    solve (a MIP) costs more than their LP."""
    step, account = bounds.step(scenario), bounds.problems.account
    if math.isinf(beat_s) or leanest_over(step):
        return _fits(step, found, account) and bounds.solve_lp(scenario, beat_s)
    return bounds.solve_lp(scenario, beat_s)


def _fits(step: Problem, found: _Found, account: Account) -> bool:
    """``may_fit``, noting that the scenario was asked."""
    found.checked.add(step.scenario)
    return may_fit(step, found.leanest, found.fit, account)


def _does_not_fit(scenario: Scenario, found: _Found, waiting: list[Scenario]) -> None:
    waiting.remove(scenario)
    found.counts["not_fitting"] += 1
    found.fates[scenario] = ("does not fit", None, "its leanest plan is over the limit")


class _Found:
    """The plans the search found: the best, the ZeRO-1 ones it does not take (faster than the
    plan with memory to spare: searched as a memory saving only), what failed."""

    def __init__(self, first: Scenario, free_s: float) -> None:
        self.first, self.free_s = first, free_s
        self.best: Solved | None = None
        self.quicker: Solved | None = None
        self.faster: list[str] = []
        self.failed: list[str] = []
        self.fit: list[Scenario] = []
        """Scenarios with a plan that fits (``may_fit``'s and ``add``'s)."""
        self.leanest: dict[Scenario, Solution] = {}
        """Scenario -> its least-memory plan, where ``may_fit`` solved for it (a no-fit error reuses them)."""
        self.checked: set[Scenario] = set()
        """Scenarios asked whether some plan of theirs fits (``_fits``)."""
        self.counts: Counter[str] = Counter()
        """Scenarios, free solves, and scenarios solved under the limit, skipped because their
        leanest plan does not fit, or left when the search stopped (``Solution.search``)."""
        self.fates: dict[Scenario, tuple[str, float | None, str]] = {}
        """Scenario -> what came of it, its plan's or bound's seconds, and why (the search's account)."""

    def add(self, scenario: Scenario, problem: Problem, found: Solution) -> None:
        self.fit.append(scenario)
        self.fates[scenario] = ("planned", found.objective_s, f"{found.memory_bytes / 2**20:,.1f} MiB")
        # ZeRO-1 added by the search (not pinned) on some parameters, and faster than with memory to spare
        if scenario.zero1 != self.first.zero1 and found.zero1_params and found.objective_s < self.free_s:
            if self.quicker is None or found.objective_s < self.quicker.solution.objective_s:
                self.quicker = Solved(problem, found)
            self.faster.append(zero1_note(scenario, found.objective_s, self.free_s))
        elif self.best is None or found.objective_s < self.best.solution.objective_s:
            self.best = Solved(problem, found)

    def account(self, account: Account, candidates: list[Scenario]) -> None:
        """One row per scenario the search reached, in the candidates' order, the chosen one said so."""
        chosen = self.best or self.quicker
        for scenario in candidates:
            if scenario in self.fates:
                outcome, seconds, why = self.fates[scenario]
                if chosen is not None and scenario == chosen.solution.scenario:
                    outcome = "chosen"
                account.record("memory", scenario.describe(), outcome, seconds, why)

    def result(self, problems: Problems, place: Place, limit: float, candidates: list[Scenario],
               cutoff_s: float) -> Solved | Pruned:
        if self.best is None and self.quicker is not None:  # ZeRO-1 fits, faster than with memory to spare
            quicker = self.quicker.solution
            quicker.notes = self.failed + [zero1_note(quicker.scenario, quicker.objective_s, self.free_s, taken=True)]
            return Solved(self.quicker.problem, replace(quicker, search=dict(self.counts)))
        if self.best is None:
            if self.failed:
                return Pruned("; ".join(self.failed), RuntimeError("; ".join(self.failed)))
            if math.isfinite(cutoff_s):  # the caller has a plan that fits: no need to say why none does
                why = f"no plan of {len(candidates)} memory scenarios fits and predicts less than {cutoff_s:.6g} s"
                return Pruned(why, MemoryLimitError(why))
            error = _nothing_fits(problems, place, limit, candidates, self.leanest)
            return Pruned(str(error), error)
        self.best.solution.notes = self.failed + self.faster[:1]
        return Solved(self.best.problem, replace(self.best.solution, search=dict(self.counts)))


def _nothing_fits(problems: Problems, place: Place, limit: float, candidates: list[Scenario],
                  solved: dict[Scenario, Solution]) -> Exception:
    """The error when no scenario fits: what the leanest plan needs, and its largest parts
    (``solved``: least-memory plans the search already has)."""
    lean: list[tuple[Solution, Problem]] = []
    for scenario in leanest(candidates):
        problem = problems.under(place, scenario, limit)
        solution = solved.get(scenario) or ilp.solve(problem, None, minimize_memory=True, account=problems.account)
        if isinstance(solution, NoPlan):
            return solution.error()
        lean.append((solution, problem))
    solution, problem = min(lean, key=lambda pair: pair[0].memory_bytes)
    priced = ilp.solve(problem, None, fixed=solution.choice)  # the leanest plan's step, by the ILP's terms
    if isinstance(priced, NoPlan):
        return priced.error()
    predicted = finish(problem, replace(priced, memory_bytes=solution.memory_bytes)).plan.predicted
    parts = ", ".join(f"{kind} {fmt_bytes(b)}" for kind, b in
                      sorted(predicted.memory_parts.items(), key=lambda item: -item[1]) if b)
    return _with_origin(MemoryLimitError(
        f"no plan fits the memory limit of {fmt_bytes(limit)} per device; the plan with the least "
        f"memory ({problem.scenario.describe()}) needs {fmt_bytes(predicted.peak_memory_bytes)} per device: {parts}"),
        problem)


def _with_origin(error: Exception, problem: Problem) -> Exception:
    """A memory-limit error saying where the limit comes from, where the user did not give it."""
    if isinstance(error, MemoryLimitError) and problem.memory_limit_origin:
        return MemoryLimitError(f"{error} (the limit is {problem.memory_limit_origin})")
    return error
