"""The innermost level of the search: one ILP (``solver.ilp``) solved for a problem, under a memory
limit or none, returning a ``Solution`` or ``NoPlan`` (never raising for a plan that does not exist)."""

from __future__ import annotations

from autopar.search.account import Account
from autopar.search.problem import Problem
from autopar.solver.ilp import Built, NoPlan, Solution, build
from autopar.solver.ilp import solve as solve_ilp


def solve(problem: Problem, memory_limit: float | None, *, minimize_memory: bool = False, explain: bool = True,
          cutoff_s: float | None = None, enough_bytes: float | None = None, relaxed: bool = False,
          time_limit_s: float | None = None, account: Account | None = None, fixed: dict[str, int] | None = None
          ) -> Solution | NoPlan:
    """``problem``'s ILP (``solver.ilp.solve``'s options), its solution marked with the problem's scenario.
    ``time_limit_s``: HiGHS's limit, at most the problem's (an LP bound is given less); ``account``: where
    the search keeps what it tried (``search.account``)."""
    limit = problem.solver_time_limit_s if time_limit_s is None else min(time_limit_s, problem.solver_time_limit_s)
    built = None if fixed is not None else _model(problem, memory_limit, minimize_memory)
    result = solve_ilp(problem.graph, problem.folding, problem.ctx, memory_limit, minimize_memory=minimize_memory,
                       time_limit_s=limit, explain=explain, cutoff_s=cutoff_s, shares=problem.memory_shares,
                       enough_bytes=enough_bytes, relaxed=relaxed, fixed=fixed, prices=problem.edge_prices(),
                       built=built)
    if relaxed and built is not None and isinstance(result, Solution):  # not ruled out: its solve likely next
        problem.parts.kept_model = built
    if isinstance(result, Solution):
        result.scenario = problem.scenario
    if account is not None:
        # sizes, not wall seconds: a plan (its account included) is the same on every rank and run
        account.record("ilp", _what(problem, memory_limit, minimize_memory, relaxed), _outcome(result), None,
                       "" if isinstance(result, NoPlan) else
                       f"{result.num_variables:,} variables, {result.num_constraints:,} constraints")
    return result


def _model(problem: Problem, memory_limit: float | None, minimize_memory: bool) -> Built:
    """The problem's model: the one its last LP bound built, where that LP did not rule it out (an LP bound
    and the solve it lets through share one build), else a new one. One model is kept per prepared place,
    and only until the solve takes it."""
    kept, parts = problem.parts.kept_model, problem.parts
    if kept is not None and kept.of(problem.graph, problem.folding, memory_limit, minimize_memory,
                                    problem.memory_shares):
        parts.kept_model = None
        return kept
    return build(problem.graph, problem.folding, problem.ctx, memory_limit, minimize_memory=minimize_memory,
                 shares=problem.memory_shares, prices=problem.edge_prices())


def _what(problem: Problem, memory_limit: float | None, minimize_memory: bool, relaxed: bool) -> str:
    goal = "least memory" if minimize_memory else "LP bound" if relaxed else \
        "fastest" + ("" if memory_limit is None else " within the limit")
    return f"{goal}: {problem.scenario.describe()}"


def _outcome(result: Solution | NoPlan) -> str:
    return f"no plan ({result.kind})" if isinstance(result, NoPlan) else result.status
