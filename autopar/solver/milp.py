"""A mixed-integer linear program as HiGHS solves it, and what the solver says of the result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain

import highspy
import numpy as np
from highspy._core import _Highs

INF = highspy.kHighsInf
PROBING = 1 << 15
"""HiGHS's presolve rule bit (``presolve_rule_off``) for probing (HiGHS 1.16 logs it as
"Rule 15 (set bit 15 = 32768): Probing")."""
DUAL_SIMPLEX = 1
"""HiGHS's ``simplex_strategy`` for the dual simplex: the one whose objective bounds an LP's optimum from
below at every iteration, so an LP bound over a cutoff is known before it is solved."""
MIP_REL_GAP = 1e-7
"""The relative gap between a plan and the best bound at which a MIP's plan counts as optimal."""
INTEGRAL = 1e-6
"""How far from an integer an integer column of an LP's solution may be and still count as integral (a
strategy column as chosen): HiGHS's own MIP feasibility tolerance."""
SCALE = 1e6
"""Objective units per second: microseconds keep HiGHS's tolerances meaningful for sub-second steps."""

LEAN_OPTIONS: dict[str, bool] = {"mip_heuristic_run_feasibility_jump": False, "mip_detect_symmetry": False,
                                 "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
                                 "mip_heuristic_run_root_reduced_cost": False}
"""For the runs of a solve led by its LP relaxation (``warm_start.run_from_lp``): the narrowed MIP is
small, and the whole one runs cut off just above the narrowed plan, which it mostly proves optimal, so
neither needs feasibility jump (a heuristic for a first plan) nor symmetry detection (both close at or
near the root, where orbits are not used), nor the sub-MIP heuristics searching near the root's solution
for a plan. None changes an optimum. A MIP with no plan in hand keeps them: they find the plan that
prunes its tree."""


COMPUTE, OWN, RESHARDS, GRAD_SYNC, WINDOWS = "compute", "own collectives", "reshards", "gradient sync", \
    "gathers in windows"
TERMS = (COMPUTE, OWN, RESHARDS, GRAD_SYNC, WINDOWS)
MEMORY = "memory"
"""The term of a least-memory objective's columns (``solve(minimize_memory=True)``): bytes, not seconds."""
"""What the objective adds up, by name: the ops' compute, the collectives inside ops (a loss's count
reduction, an expert layer's all-to-alls, ring steps), the reshards between ops (forward and backward),
gradient synchronization as exposed (buckets, reduce-scatters; beside backward where the hardware
overlaps), and the prefetched gathers' exposure in their windows (``solver.overlap``)."""


class Model:
    """Columns (cost, upper bound, integrality; lower bounds are 0) and rows (lo <= a.x <= hi); each
    column's cost is the sum of named terms (``TERMS``), kept beside it."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.implied_integer: list[int] = []
        """Continuous columns whose rows make them 0 or 1 wherever the integer columns are integral (an
        edge's transport columns): a bound that fixes integer columns may fix these alike."""
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.knapsack: int | None = None
        """The memory row's index, where the model has one (a limit on the plan's bytes)."""
        self.terms: dict[int, dict[str, float]] = {}
        """Column -> term -> its share of the column's cost."""
        self._rows_made = -1
        self._row_arrays: tuple[np.ndarray, ...] = ()

    def var(self, cost: float, integer: bool, upper: float = 1.0, term: str | None = None,
            implied_integer: bool = False) -> int:
        """A column costing ``cost`` (of ``term``; a cost of 0 needs none); ``implied_integer``: continuous,
        but integral wherever the integer columns are (``Model.implied_integer``)."""
        assert term is not None or cost == 0.0, "a priced column names its term"
        j = len(self.cost)
        self.cost.append(0.0)
        self.upper.append(upper)
        if integer:
            self.integer.append(j)
        elif implied_integer:
            self.implied_integer.append(j)
        if cost:
            self.add_cost(j, cost, term)  # type: ignore[arg-type]
        return j

    def columns(self, n: int, implied_integer: bool = False) -> int:
        """n continuous columns in [0, 1] costing nothing yet, numbered from the one returned (``var``'s, in bulk)."""
        first = len(self.cost)
        self.cost.extend([0.0] * n)
        self.upper.extend([1.0] * n)
        if implied_integer:
            self.implied_integer.extend(range(first, first + n))
        return first

    def add_cost(self, j: int, amount: float, term: str) -> None:
        """Add ``amount`` of ``term`` to column j's cost."""
        self.cost[j] += amount
        terms = self.terms.get(j)
        if terms is None:
            self.terms[j] = {term: amount}
        else:
            terms[term] = terms.get(term, 0.0) + amount

    def row_arrays(self) -> tuple[np.ndarray, ...]:
        """The rows as HiGHS takes them (starts, indices, values, lower, upper), made once per model: a
        solve led by the LP runs HiGHS on one model up to three times."""
        if self._rows_made != len(self.rows):  # rows are only ever appended
            rows = self.rows
            sizes = np.fromiter((len(r) for r, _, _ in rows), dtype=np.int64, count=len(rows))
            starts = np.zeros(len(rows), dtype=np.int32)
            np.cumsum(sizes[:-1], out=starts[1:])
            self._row_arrays = (starts, np.fromiter(chain.from_iterable(r for r, _, _ in rows), dtype=np.int32),
                                np.fromiter(chain.from_iterable(r.values() for r, _, _ in rows), dtype=np.float64),
                                np.fromiter((lo for _, lo, _ in rows), dtype=np.float64, count=len(rows)),
                                np.fromiter((hi for _, _, hi in rows), dtype=np.float64, count=len(rows)))
            self._rows_made = len(rows)
        return self._row_arrays

    def term_values(self, values: Sequence[float]) -> dict[str, float]:
        """Each term's part of the objective at ``values`` (objective units)."""
        out: dict[str, float] = dict.fromkeys(TERMS, 0.0)
        for j, terms in self.terms.items():
            if values[j]:
                for term, c in terms.items():
                    out[term] = out.get(term, 0.0) + c * values[j]
        return out


@dataclass(frozen=True, kw_only=True)
class Result:
    """What one HiGHS run ended with."""

    values: list[float] | None
    """Column values of the best plan found; None when none was found."""
    objective: float
    status: str
    """'optimal', 'time_limit' (stopped with or without a plan), 'infeasible', 'target_reached'
    (stopped at a plan meeting ``run``'s ``target``), or HiGHS's own status text for anything else."""
    gap: float | None
    """Relative gap between the plan found and the best bound (0 when proven optimal; None
    when no plan was found)."""
    reduced_costs: list[float] | None = None
    """An LP relaxation's optimal reduced costs (``run(relaxed=True)``), else None."""
    time_limit_s: float


def highs(*, dual_lp: bool = False) -> _Highs:
    """A HiGHS instance as every solve here sets one: silent, one thread, seed 0; with ``dual_lp``, an LP
    solved unpresolved by the dual simplex (on these models HiGHS's LP presolve costs more than the dual
    simplex's whole solve, and the dual simplex stops once its bound passes a cutoff)."""
    # The base class: highspy.Highs installs Python callbacks (unused here) and prints a
    # banner to stdout doing so, which would land in the CLI's output.
    h = _Highs()
    options: dict[str, object] = {"output_flag": False, "threads": 1, "random_seed": 0}
    if dual_lp:
        options.update(presolve="off", solver="simplex", simplex_strategy=DUAL_SIMPLEX)
    for option, value in options.items():
        h.setOptionValue(option, value)
    return h


def run(model: Model, time_limit_s: float, cutoff: float | None = None, *, start: dict[int, float] | None = None,
        zero: Sequence[int] = (), lean: bool = False, target: float | None = None, relaxed: bool = False) -> Result:
    """Solve ``model``; with ``cutoff`` (objective units) only a plan cheaper than it counts:
    HiGHS prunes by it and reports 'infeasible' when there is none. ``start``: values of some
    columns to start from (HiGHS completes the rest, or ignores a start that breaks a row).
    ``zero``: columns held at 0 (a narrowed model). ``lean``: skip the search aids a run that
    closes at its root does not use (``LEAN_OPTIONS``). ``target``: stop at the first plan whose
    objective is at most this (HiGHS's ``objective_target``; status 'target_reached'). ``relaxed``:
    the LP relaxation (no column integral), with its reduced costs: its optimum bounds the model's from
    below; with ``cutoff``, status 'over_cutoff' as soon as the dual simplex's objective (a bound on the
    optimum) passes it."""
    h = highs(dual_lp=relaxed)
    h.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    # probing binaries took most of HF Llama-3-8B's 1.3 s presolve; the strategy rows are
    # one-of-n choices whose implications the root LP and the start give HiGHS anyway
    h.setOptionValue("presolve_rule_off", PROBING)
    h.setOptionValue("time_limit", float(time_limit_s))
    for option, value in LEAN_OPTIONS.items() if lean else ():
        h.setOptionValue(option, value)
    if cutoff is not None:
        h.setOptionValue("objective_bound", float(cutoff))
    if target is not None:
        h.setOptionValue("objective_target", float(target))
    n = len(model.cost)
    upper = np.array(model.upper)
    upper[list(zero)] = 0.0
    h.addCols(n, np.array(model.cost), np.zeros(n), upper, 0,
              np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([]))
    starts, indices, values, lower, upper = model.row_arrays()
    h.addRows(len(model.rows), lower, upper, len(indices), starts, indices, values)
    if model.integer and not relaxed:
        h.changeColsIntegrality(len(model.integer), np.array(model.integer, dtype=np.int32),
                                np.array([highspy.HighsVarType.kInteger] * len(model.integer)))
    if start:
        h.setSolution(len(start), np.array(list(start), dtype=np.int32), np.array(list(start.values())))
    h.run()
    result = interpret(h.getModelStatus(), h.getInfo(), lambda: list(h.getSolution().col_value), time_limit_s)
    if relaxed and result.status == "optimal":
        result = replace(result, reduced_costs=list(h.getSolution().col_dual))
    if cutoff is not None and result.values is not None and result.objective > cutoff:
        # HiGHS prunes by the bound but may keep (and call optimal) an incumbent above it
        # that a heuristic found first (the Llama-3-70B shape: 589 s against a 7.9 s bound)
        return Result(values=None, objective=0.0, status="infeasible" if result.status == "optimal" else result.status,
                      gap=None, time_limit_s=time_limit_s)
    return result


def interpret(status: highspy.HighsModelStatus, info: object, solution: object, time_limit_s: float) -> Result:
    """Turn HiGHS's status into a Result: a plan is returned only when a feasible one exists."""
    statuses = highspy.HighsModelStatus
    feasible = getattr(info, "primal_solution_status", 0) == 2  # kSolutionStatusFeasible
    if status == statuses.kOptimal:
        name = "optimal"
    elif status == statuses.kTimeLimit:
        name = "time_limit"
    elif status == statuses.kInfeasible:
        name, feasible = "infeasible", False
    elif status == statuses.kObjectiveTarget:
        name = "target_reached"
    elif status == statuses.kObjectiveBound:  # an LP's dual objective passed the cutoff: the optimum is over it
        name, feasible = "over_cutoff", False
    else:
        name = str(status).rsplit(".", 1)[-1]
    if not feasible:
        return Result(values=None, objective=0.0, status=name, gap=None, time_limit_s=time_limit_s)
    gap = 0.0 if name == "optimal" else float(getattr(info, "mip_gap", float("inf")))
    return Result(values=solution(), objective=float(getattr(info, "objective_function_value")),  # type: ignore[operator]
                  status=name, gap=gap, time_limit_s=time_limit_s)
