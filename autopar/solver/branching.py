"""The placement MIP under a memory limit, branched on its memory row (a branch and bound over HiGHS's LPs).

Without its memory row the placement LP is integral on these graphs (the edges' transport columns make it
tight); the memory row alone makes it fractional: it lets a node mix a big fast strategy with a small slow
one. HiGHS's own branching does not see that row: on a Llama-3-70B stage plan (42,000 columns) it proved a
gap of 8% in 10-15 s, most of it strong branching over columns that change no memory. Branching first on
the fractional column that weighs most in the memory row (its weight times its fractionality) closes the
same gap in a handful of nodes, each an LP that HiGHS's dual simplex re-solves from its parent's basis.

Best first (the least bound, ties in the order made), pruned by the cutoff and the best plan found, proven
within HiGHS's own relative gap (``MIP_REL_GAP``). A search that outgrows ``MAX_NODES`` or its time gives
up and says so (``Branched.gave_up``), with the best plan it found for HiGHS's whole MIP to beat.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from autopar.solver.milp import INTEGRAL, MIP_REL_GAP, Model, Result, highs

MAX_NODES = 400
"""Nodes the branch and bound solves before it leaves the model to HiGHS's whole MIP."""

Bounds = tuple[tuple[int, float, float], ...]
"""A node's column bounds that differ from the model's: (column, lower, upper)."""


@dataclass(frozen=True)
class Branched:
    """What the branch and bound ended with: the result (a proven optimum, or 'infeasible': nothing under
    the cutoff), or ``gave_up`` with the best plan found so far (``values`` None where none)."""

    result: Result | None
    gave_up: str = ""
    values: list[float] | None = None
    objective: float = math.inf
    bound: float = -math.inf
    """Where it gave up: the least bound of the nodes left (no plan is cheaper)."""


Node = tuple[float, list[float], highspy.HighsBasis]
"""A node's LP optimum: objective, column values, and the basis its children start from."""


class _Lp:
    """One HiGHS LP, the model's relaxation without its columns held at 0, whose column bounds each node
    sets (by the model's column numbers)."""

    def __init__(self, model: Model, zero: Sequence[int]) -> None:
        h = highs(dual_lp=True)
        n = len(model.cost)
        held = np.zeros(n, dtype=bool)
        held[list(zero)] = True
        self.n, self.kept = n, np.flatnonzero(~held)
        self.local = np.full(n, -1, dtype=np.int64)  # model column -> the LP's, -1 where held at 0
        self.local[self.kept] = np.arange(len(self.kept))
        self.upper = np.array(model.upper, dtype=np.float64)
        h.addCols(len(self.kept), np.array(model.cost)[self.kept], np.zeros(len(self.kept)), self.upper[self.kept], 0,
                  np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([]))
        starts, indices, values, lower, upper = model.row_arrays()
        sizes = np.diff(np.append(starts, len(indices)))
        keep = self.local[indices] >= 0
        counts = np.bincount(np.repeat(np.arange(len(starts)), sizes)[keep], minlength=len(starts))
        row_starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int32)
        h.addRows(len(starts), lower, upper, int(keep.sum()), row_starts, self.local[indices[keep]].astype(np.int32),
                  values[keep])
        self.h, self.changed = h, np.array([], dtype=np.int32)
        self.current: highspy.HighsBasis | None = None
        """The basis HiGHS holds, as the last solve returned it (None: one no solve returned)."""

    def solve(self, bounds: Bounds, basis: highspy.HighsBasis | None, bar: float, time_limit_s: float) -> Node | str:
        """The LP's optimum under ``bounds`` where it is under ``bar``, else HiGHS's status ('infeasible':
        no plan within them; 'over': none under ``bar``, which the dual simplex's bound shows before its
        optimum); the dual simplex starts from ``basis`` (the parent's: a child's bounds cut its optimum
        off by little), or from the one HiGHS holds where that is it or None (no basis set: setting one
        factors it again, 10-20 ms of a 25,000-column LP whose re-solve takes a few iterations)."""
        if len(self.changed):  # back to the model's bounds, then the node's
            self.h.changeColsBounds(len(self.changed), self.changed, np.zeros(len(self.changed)),
                                    self.upper[self.kept[self.changed]])
        self.changed = self.local[[j for j, _, _ in bounds]].astype(np.int32)
        if bounds:
            self.h.changeColsBounds(len(bounds), self.changed, np.array([lo for _, lo, _ in bounds]),
                                    np.array([hi for _, _, hi in bounds]))
        if basis is not None and basis is not self.current:
            self.h.setBasis(basis)
        self.current = None
        self.h.setOptionValue("time_limit", max(time_limit_s, 0.0))
        self.h.setOptionValue("objective_bound", bar if math.isfinite(bar) else highspy.kHighsInf)
        self.h.run()
        status = self.h.getModelStatus()
        if status == highspy.HighsModelStatus.kObjectiveBound:
            return "over"
        if status != highspy.HighsModelStatus.kOptimal:
            return "infeasible" if status == highspy.HighsModelStatus.kInfeasible else str(status).rsplit(".", 1)[-1]
        values = np.zeros(self.n)
        values[self.kept] = self.h.getSolution().col_value
        self.current = self.h.getBasis()
        return float(self.h.getInfo().objective_function_value), values.tolist(), self.current


def branch_on_memory(model: Model, time_limit_s: float, cutoff: float | None = None, zero: Sequence[int] = (),
                     max_nodes: int | None = None) -> Branched:
    """``model``'s optimum under ``cutoff`` (module docstring); ``zero``: columns held at 0. Needs
    ``model.knapsack``, the memory row to branch on; ``max_nodes``: ``MAX_NODES`` where None."""
    assert model.knapsack is not None, "a model without a memory row"
    began, max_nodes = time.perf_counter(), MAX_NODES if max_nodes is None else max_nodes
    weight = model.rows[model.knapsack][0]
    lp = _Lp(model, zero)
    best, best_values = (math.inf if cutoff is None else cutoff), None
    queue: list[tuple[float, int, Bounds, list[float], highspy.HighsBasis]] = []
    made = nodes = 0
    waiting: list[tuple[Bounds, highspy.HighsBasis | None]] = [((), None)]  # the root, then each node's children
    while waiting or queue:
        for bounds, basis in waiting:
            solved = lp.solve(bounds, basis, _pruned_from(best), time_limit_s - (time.perf_counter() - began))
            if isinstance(solved, str) and solved not in ("infeasible", "over"):  # out of time, or failed: not pruned
                return Branched(None, f"the memory row's branch and bound stopped: an LP ended '{solved}'",
                                best_values, best if best_values is not None else math.inf, -math.inf)
            if not isinstance(solved, str) and solved[0] < _pruned_from(best):
                made += 1
                heapq.heappush(queue, (solved[0], made, bounds, *solved[1:]))
        waiting = []
        if not queue:
            break
        bound, _, bounds, values, basis = heapq.heappop(queue)
        if bound >= _pruned_from(best):
            continue
        if nodes >= max_nodes or time.perf_counter() - began > time_limit_s:
            why = f"{nodes} nodes" if nodes >= max_nodes else f"its time limit of {time_limit_s:g} s"
            return Branched(None, f"the memory row's branch and bound stopped at {why}", best_values,
                            best if best_values is not None else math.inf, bound)
        nodes += 1
        j = _branch_column(model, weight, values)
        if j is None:  # integral: a plan, the best so far (its bound is under the best's)
            best, best_values = bound, values
        else:
            waiting = [(child, basis) for child in _children(bounds, j, values[j], float(lp.upper[j]))]
    if best_values is None:
        return Branched(Result(values=None, objective=0.0, status="infeasible", gap=None, time_limit_s=time_limit_s))
    return Branched(Result(values=best_values, objective=best, status="optimal", gap=0.0, time_limit_s=time_limit_s))


def _pruned_from(best: float) -> float:
    """The bound at and above which a node holds no plan better than ``best`` by HiGHS's relative gap."""
    return best - MIP_REL_GAP * abs(best) if math.isfinite(best) else math.inf


def _branch_column(model: Model, weight: dict[int, float], values: list[float]) -> int | None:
    """The fractional integer column weighing most in the memory row times its fractionality (the most
    fractional where none weighs; the first of equals); None where every integer column is integral."""
    best, chosen = (-1.0, -1.0), None
    for j in model.integer:
        part = min(values[j] - math.floor(values[j]), math.ceil(values[j]) - values[j])
        if part > INTEGRAL:
            score = (abs(weight.get(j, 0.0)) * part, part)
            if score > best:
                best, chosen = score, j
    return chosen


def _children(bounds: Bounds, j: int, value: float, upper: float) -> tuple[Bounds, Bounds]:
    """``bounds`` with column j (at most ``upper`` in the model) at most floor(value), and at least ceil(value)."""
    lower = 0.0
    for k, lo, hi in bounds:
        if k == j:
            lower, upper = lo, hi
    rest = tuple(b for b in bounds if b[0] != j)
    return ((*rest, (j, lower, float(math.floor(value)))), (*rest, (j, float(math.ceil(value)), upper)))
