"""The placement ILP, solved with HiGHS.

Variables: x[v, s] = 1 when (representative) node v runs strategy s. Each node picks
one strategy. An edge whose two ends both have several distinct placements at that
edge gets transport variables e[a, b] (producer placement group a, consumer group b)
tied to the x's by their marginals, priced by the reshard a -> b; when one end has a
single placement the edge's cost folds into the other end's x coefficients. With x
integral the marginals force e integral, so e stays continuous. Memory is one linear
row: the sum of every node's bytes at peak, weighted by how many nodes it stands for.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import highspy
import numpy as np
from highspy._core import _Highs

from autopar.cost.model import CostContext
from autopar.solver.blocks import Folding
from autopar.cost.model import gathered_parameter_bytes
from autopar.solver.graph import PARAM, PlanGraph, price_edge
from autopar.units import fmt_bytes

SCALE = 1e6
"""Objective in microseconds: keeps HiGHS tolerances meaningful for sub-second steps."""


class MemoryLimitError(ValueError):
    """No plan fits the memory limit; the message says what the leanest plan needs."""


@dataclass
class Solution:
    choice: dict[str, int]
    """Representative node -> index of its chosen strategy."""
    objective_s: float
    memory_bytes: float
    num_variables: int
    num_constraints: int
    build_seconds: float
    solve_seconds: float


@dataclass
class _Edge:
    producer: str
    out_index: int
    consumer: str
    arg: int
    count: int


def aggregate_edges(graph: PlanGraph, folding: Folding) -> list[_Edge]:
    counts: dict[tuple[str, int, str, int], int] = defaultdict(int)
    rep = folding.representative
    for name in graph.order:
        for arg, (src, idx) in enumerate(graph.nodes[name].args):
            counts[(rep[src], idx, rep[name], arg)] += 1
    return [_Edge(p, i, c, a, n) for (p, i, c, a), n in counts.items()]


class _Model:
    def __init__(self) -> None:
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, cost: float, integer: bool) -> int:
        self.cost.append(cost)
        self.upper.append(1.0)
        if integer:
            self.integer.append(len(self.cost) - 1)
        return len(self.cost) - 1


def solve(graph: PlanGraph, folding: Folding, ctx: CostContext, memory_limit: float | None,
          *, minimize_memory: bool = False, time_limit_s: float = 120.0) -> Solution:
    start = time.perf_counter()
    reps = [n for n in graph.order if folding.representative[n] == n]
    mult = folding.multiplicity
    model = _Model()
    x: dict[str, list[int]] = {}
    memory_row: dict[int, float] = {}
    for v in reps:
        node = graph.nodes[v]
        x[v] = []
        for cost in node.costs:
            weight = cost.memory if minimize_memory else cost.time * SCALE
            j = model.var(mult[v] * weight, integer=True)
            x[v].append(j)
            memory_row[j] = mult[v] * cost.memory
        model.rows.append(({j: 1.0 for j in x[v]}, 1.0, 1.0))
    cache: dict = {}  # the same reshard recurs on many edges
    for edge in aggregate_edges(graph, folding):
        _add_edge(model, graph, ctx, edge, x, cache, memory_row, minimize_memory)
    if memory_limit is not None and not minimize_memory:
        model.rows.append((memory_row, -highspy.kHighsInf, float(memory_limit)))
    build = time.perf_counter() - start
    values, objective = _run(model, time_limit_s)
    if values is None:
        if memory_limit is not None and not minimize_memory:
            leanest = solve(graph, folding, ctx, None, minimize_memory=True)  # raises if pins conflict
            raise MemoryLimitError(
                f"no plan fits the memory limit of {fmt_bytes(memory_limit)} per device; the plan with "
                f"the least memory needs {fmt_bytes(leanest.memory_bytes)} per device")
        raise ValueError("no plan satisfies the pinned placements together (constraints, data axes or "
                         "input_sharded conflict on some edge)")
    choice = {v: int(np.argmax([values[j] for j in x[v]])) for v in reps}
    memory = sum(weight * values[j] for j, weight in memory_row.items())
    return Solution(choice, objective if minimize_memory else objective / SCALE, memory,
                    len(model.cost), len(model.rows), build, time.perf_counter() - start - build)


def _add_edge(model: _Model, graph: PlanGraph, ctx: CostContext, edge: _Edge, x: dict[str, list[int]],
              cache: dict, memory_row: dict[int, float], minimize_memory: bool) -> None:
    """Link the edge's two ends; its objective is reshard time (or, when minimizing memory,
    the memory it keeps: a parameter gathered in forward stays gathered until backward)."""
    prod, cons = graph.nodes[edge.producer], graph.nodes[edge.consumer]
    groups_p: dict[object, list[int]] = defaultdict(list)
    for s, strat in enumerate(prod.strategies):
        groups_p[strat.outputs[edge.out_index]].append(s)
    groups_c: dict[object, list[int]] = defaultdict(list)
    for s, strat in enumerate(cons.strategies):
        active = tuple(strat.is_active(i) for i in range(ctx.mesh.ndim))
        groups_c[(strat.inputs[edge.arg], active)].append(s)
    keys_p, keys_c = list(groups_p), list(groups_c)
    meta = prod.outputs[edge.out_index]

    def held(a: object, b: tuple) -> float:
        return gathered_parameter_bytes(meta, a, b[0], ctx, from_parameter=prod.kind == PARAM) * edge.count

    def price(a: object, b: tuple) -> float:
        key = (meta, prod.kind, prod.needs_grad, a, b)
        if key not in cache:
            cache[key] = price_edge(graph, edge.producer, edge.out_index, edge.consumer, edge.arg,
                                    prod.strategies[groups_p[a][0]], cons.strategies[groups_c[b][0]], ctx).time
        return cache[key] * SCALE * edge.count

    mem = [[held(a, b) for b in keys_c] for a in keys_p]
    cost = mem if minimize_memory else [[price(a, b) for b in keys_c] for a in keys_p]

    def add(j: int, a: int, b: int) -> None:
        model.cost[j] += cost[a][b]
        if mem[a][b]:
            memory_row[j] = memory_row.get(j, 0.0) + mem[a][b]
    inputs_taken = {placement for placement, _ in keys_c}
    if (cons.follower and edge.producer != edge.consumer and len(keys_p) > 1 and len(keys_c) > 1
            and all(a in inputs_taken for a in keys_p)):  # every producer choice stays usable
        _add_follower_edge(model, edge, x, groups_p, groups_c, add)
        return
    if edge.producer == edge.consumer:  # one decision on both ends
        where_p = {s: i for i, a in enumerate(keys_p) for s in groups_p[a]}
        where_c = {s: i for i, b in enumerate(keys_c) for s in groups_c[b]}
        for s, j in enumerate(x[edge.producer]):
            add(j, where_p[s], where_c[s])
        return
    if len(keys_p) == 1 or len(keys_c) == 1:
        for a, ka in enumerate(keys_p):
            for b, kb in enumerate(keys_c):
                if len(keys_p) == 1:
                    for s in groups_c[kb]:
                        add(x[edge.consumer][s], a, b)
                else:
                    for s in groups_p[ka]:
                        add(x[edge.producer][s], a, b)
        return
    e = [[model.var(0.0, integer=False) for b in range(len(keys_c))] for a in range(len(keys_p))]
    for a in range(len(keys_p)):
        for b in range(len(keys_c)):
            add(e[a][b], a, b)
    for a, ka in enumerate(keys_p):
        row = {e[a][b]: 1.0 for b in range(len(keys_c))}
        row.update({x[edge.producer][s]: -1.0 for s in groups_p[ka]})
        model.rows.append((row, 0.0, 0.0))
    for b, kb in enumerate(keys_c):
        row = {e[a][b]: 1.0 for a in range(len(keys_p))}
        row.update({x[edge.consumer][s]: -1.0 for s in groups_c[kb]})
        model.rows.append((row, 0.0, 0.0))


def _add_follower_edge(model: _Model, edge: _Edge, x: dict[str, list[int]], groups_p: dict, groups_c: dict,
                       add: Callable[[int, int, int], None]) -> None:
    """A view or elementwise op takes its input as produced: resharding before it costs
    the same as after it, so only matching placements are linked (far fewer variables)."""
    keys_p, keys_c = list(groups_p), list(groups_c)
    flow_in: dict[int, dict[int, float]] = {a: {} for a in range(len(keys_p))}
    for b, (placement, _active) in enumerate(keys_c):
        a = next((i for i, k in enumerate(keys_p) if k == placement), None)
        if a is None:  # no producer strategy delivers this input: rule the consumer strategies out
            model.rows.append(({x[edge.consumer][s]: 1.0 for s in groups_c[keys_c[b]]}, 0.0, 0.0))
            continue
        e = model.var(0.0, integer=False)
        add(e, a, b)
        flow_in[a][e] = 1.0
        row = {e: 1.0}
        row.update({x[edge.consumer][s]: -1.0 for s in groups_c[keys_c[b]]})
        model.rows.append((row, 0.0, 0.0))
    for a, ka in enumerate(keys_p):
        row = dict(flow_in[a])
        row.update({x[edge.producer][s]: -1.0 for s in groups_p[ka]})
        model.rows.append((row, 0.0, 0.0))


def _run(model: _Model, time_limit_s: float) -> tuple[list[float] | None, float]:
    # The base class: highspy.Highs installs Python callbacks (unused here) and prints a
    # banner to stdout doing so, which would land in the CLI's output.
    h = _Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", 1e-7)
    h.setOptionValue("time_limit", float(time_limit_s))
    n = len(model.cost)
    h.addCols(n, np.array(model.cost), np.zeros(n), np.array(model.upper), 0,
              np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([]))
    starts, indices, values, lower, upper = [], [], [], [], []
    for row, lo, hi in model.rows:
        starts.append(len(indices))
        for j, v in row.items():
            indices.append(j)
            values.append(v)
        lower.append(lo)
        upper.append(hi)
    h.addRows(len(model.rows), np.array(lower), np.array(upper), len(indices),
              np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32), np.array(values))
    if model.integer:
        h.changeColsIntegrality(len(model.integer), np.array(model.integer, dtype=np.int32),
                                np.array([highspy.HighsVarType.kInteger] * len(model.integer)))
    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        if status in (highspy.HighsModelStatus.kInfeasible,):
            return None, 0.0
        if h.getInfo().primal_solution_status != 2:  # no feasible point found in time
            return None, 0.0
    return list(h.getSolution().col_value), h.getInfo().objective_function_value
