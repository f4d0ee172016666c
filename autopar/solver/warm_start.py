"""The placement MIP solved from its LP relaxation.

HiGHS spends most of a large model's solve on presolve and on the root LP of the presolved model, and
proves a plan optimal quickly once it holds a good one, which its own heuristics find late. The LP
relaxation, unpresolved (HiGHS's dual simplex), is a fraction of that, and it leads the solve
(``run_from_lp``): its optimum is often integral on a model whose layers are alike, and otherwise its
support and reduced costs name each node's likely strategies (a small MIP gives a plan from them) and
the columns no plan as good as that one uses (fixed at 0 before the whole MIP runs). A solve that seeks
only plans under a cutoff (``run_under``) fixes the columns no such plan uses alike, with no plan of its
own to find first. What is left of a model with a memory row is branched on that row (``whole``,
``solver.branching``) where its LP bound is not already close.

The plan returned is still the proven optimum of the whole MIP (HiGHS's, or the branch and bound's over
HiGHS's LPs, within HiGHS's gap): this changes speed only.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from autopar.solver.branching import branch_on_memory
from autopar.solver.milp import INTEGRAL, Model, Result, run

NARROW_KEEP = 4
"""Strategies per node the narrowed solve keeps at least (``lp_likely``)."""
LP_LED_FROM_COLUMNS = 10_000
"""Models with fewer columns are solved at once, unless their LP relaxation was solved before (an LP
bound's): HiGHS finds their optimum in a fraction of a second, and an LP and a narrowed solve first
only add to it (a memory search's many small solves)."""

BRANCH_FROM_GAP = 0.01
"""A MIP with a memory row whose cutoff is within this fraction of its LP bound is left to HiGHS: its
presolve and root close such a gap in a fraction of the memory row's branch and bound (Llama-3-70B's
stages: 0.1 s against 0.2-0.5 s at a 0.07% gap; at 6-49%, 0.7-16 s against 0.6-3.6 s)."""
FIX_SLACK = 1e-6
"""Relative room left above a plan's objective when reduced costs rule columns out (``run_from_lp``):
more than HiGHS's tolerances on the LP's duals and on the MIP's proof (``mip_rel_gap`` 1e-7)."""


def run_from_lp(model: Model, x: dict[str, list[int]], time_limit_s: float, relaxation: Result | None) -> Result:
    """HiGHS on ``model``, led by its LP relaxation (``relaxation`` where solved before):

    * an LP optimum whose strategy columns are integral is a plan, and optimal: no MIP is run;
    * else the MIP narrowed to each node's strategies the LP uses, and those its reduced costs
      price least (``lp_likely``), gives a plan (a small MIP, solved in a fraction of the whole);
    * a column whose reduced cost d is over that plan's gap to the LP bound is 0 in every plan at
      least as good (each plan's objective is at least the bound plus d times the column), so the
      whole MIP runs with those columns fixed at 0, cut off above that plan: its optimum, or that plan
      where nothing beats it, is the whole model's. Fixed are the strategy columns and the edges'
      transport columns, 0 or 1 in every integral plan (``Model.implied_integer``).
    """
    began = time.perf_counter()
    def left() -> float:  # the limit is for all the runs together
        return max(time_limit_s - (time.perf_counter() - began), 0.01 * time_limit_s)
    lp = relaxation if relaxation is not None else run(model, time_limit_s, relaxed=True)
    if lp.values is None or lp.reduced_costs is None:  # infeasible (the MIP too), or out of time
        return lp if lp.status == "infeasible" else replace(run(model, left()), time_limit_s=time_limit_s)
    if all(abs(lp.values[j] - round(lp.values[j])) <= INTEGRAL for j in model.integer):
        return replace(lp, status="optimal", gap=0.0, reduced_costs=None, time_limit_s=time_limit_s)
    likely = lp_likely(x, lp.values, lp.reduced_costs)
    narrow = run(model, left(), zero=[j for v, cols in x.items() for s, j in enumerate(cols) if s not in likely[v]],
                 lean=True)
    if narrow.values is None:  # nothing among the likeliest: HiGHS's own heuristics find a plan
        return replace(run(model, left()), time_limit_s=time_limit_s)
    price = sum(c * v for c, v in zip(model.cost, narrow.values))  # its plan's, as the solve below prices it
    slack = FIX_SLACK * max(1.0, abs(price))
    fixed = _ruled_out(model, lp, price)
    # the narrowed plan as a bound, not as a start: HiGHS (1.16) misprices a start in a presolved space
    # whose columns were fixed by their bounds (a GPT plan: 692.87 priced 691.34 there, and "optimal")
    result = whole(model, left(), price + slack, fixed, lp.objective, lean=True)
    if result.values is None and result.status == "infeasible":  # none beats it: the narrowed plan is optimal
        result = replace(narrow, objective=price, status="optimal", gap=0.0)
    elif result.values is None:  # out of time before beating it: the narrowed plan, its gap to the LP bound
        result = replace(narrow, objective=price, status=result.status,
                         gap=(price - lp.objective) / max(abs(price), 1e-12))
    return replace(result, time_limit_s=time_limit_s)


def run_under(model: Model, time_limit_s: float, cutoff: float, relaxation: Result | None) -> Result:
    """HiGHS on ``model`` for a plan cheaper than ``cutoff`` (``run``'s), the columns its LP relaxation
    (``relaxation`` where solved before) rules out fixed at 0: a column whose reduced cost d is over the
    cutoff's gap to the LP bound is 0 in every plan under the cutoff (each plan's objective is at least the
    bound plus d times the column). Fixed are the columns 0 or 1 in every integral plan, as in ``run_from_lp``."""
    began = time.perf_counter()
    lp = relaxation if relaxation is not None else run(model, time_limit_s, relaxed=True)
    if lp.values is None or lp.reduced_costs is None:  # infeasible (the MIP too), or out of time
        return lp if lp.status == "infeasible" else run(model, time_limit_s, cutoff)
    if lp.objective > cutoff:  # its bound is over the cutoff: no plan under it (as ``run`` says so)
        return Result(values=None, objective=0.0, status="infeasible", gap=None, time_limit_s=time_limit_s)
    left = max(time_limit_s - (time.perf_counter() - began), 0.01 * time_limit_s)
    return replace(whole(model, left, cutoff, _ruled_out(model, lp, cutoff), lp.objective, lean=False),
                   time_limit_s=time_limit_s)


def whole(model: Model, time_limit_s: float, cutoff: float, zero: list[int], bound: float, *, lean: bool) -> Result:
    """The whole MIP under ``cutoff`` with the ``zero`` columns fixed at 0 (``lean``: ``run``'s; ``bound``:
    its LP relaxation's optimum). A model with a memory row, the cutoff over its LP bound by more than
    ``BRANCH_FROM_GAP``, is branched on that row first (``solver.branching``); where that stops early, HiGHS
    runs for what beats the best plan it found, which is the optimum where nothing does."""
    began = time.perf_counter()
    if model.knapsack is None or (math.isfinite(cutoff) and cutoff - bound <= BRANCH_FROM_GAP * abs(cutoff)):
        return run(model, time_limit_s, cutoff, zero=zero, lean=lean)
    branched = branch_on_memory(model, time_limit_s, cutoff, zero)
    if branched.result is not None:
        return branched.result
    left = max(time_limit_s - (time.perf_counter() - began), 0.01 * time_limit_s)
    bar = min(cutoff, branched.objective + FIX_SLACK * max(1.0, abs(branched.objective)))
    result = run(model, left, bar, zero=zero, lean=lean)
    if result.values is not None or branched.values is None or result.status not in ("infeasible", "time_limit"):
        return result
    proven = result.status == "infeasible"  # nothing beats the branch and bound's plan
    gap = 0.0 if proven else (branched.objective - branched.bound) / max(abs(branched.objective), 1e-12)
    return Result(values=branched.values, objective=branched.objective, status="optimal" if proven else "time_limit",
                  gap=gap, time_limit_s=time_limit_s)


def _ruled_out(model: Model, lp: Result, bound: float) -> list[int]:
    """The columns, 0 or 1 in every integral plan, that no plan as cheap as ``bound`` (up to ``FIX_SLACK``)
    uses: their reduced cost at the LP optimum ``lp`` is over the bound's gap to it."""
    assert lp.reduced_costs is not None
    over = bound - lp.objective + FIX_SLACK * max(1.0, abs(bound))
    return [j for j in (*model.integer, *model.implied_integer) if lp.reduced_costs[j] > over]


def lp_likely(x: dict[str, list[int]], values: list[float], reduced_costs: list[float],
              keep: int = NARROW_KEEP) -> dict[str, list[int]]:
    """Node -> the strategies its LP optimum uses, then those of least reduced cost, ``keep`` at least."""
    likely = {}
    for v, cols in x.items():
        used = [s for s, j in enumerate(cols) if values[j] > INTEGRAL]
        rest = sorted((s for s in range(len(cols)) if s not in used), key=lambda s: (reduced_costs[cols[s]], s))
        likely[v] = used + rest[:max(keep - len(used), 0)]
    return likely
