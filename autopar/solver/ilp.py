"""The placement ILP, solved with HiGHS.

Variables: x[v, s] = 1 when (representative) node v runs strategy s. Each node picks
one strategy. An edge whose two ends both have several distinct placements at that
edge gets transport variables e[a, b] (producer placement group a, consumer group b)
tied to the x's by their marginals, priced by the reshard a -> b; when one end has a
single placement the edge's cost folds into the other end's x coefficients. With x
integral the marginals force e integral, so e stays continuous. Gradient all-reduces are
priced once per parameter and per bucket (``grad_terms``). Memory is one linear row: the
sum of every node's bytes at peak, weighted by how many nodes it stands for. HiGHS runs in
``milp``; a run stopped by its time limit returns its best plan with the gap, and says so.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autopar.cost.collectives import grad_placement_at_consumer
from autopar.cost.model import CostContext, EdgeCost, backward_time
from autopar.errors import InputError, MemoryLimitError, SolverTimeLimitError
from autopar.problem.folding import Folding
from autopar.solver.edge_prices import EdgePrices
from autopar.solver.grad_terms import GradSyncTerms
from autopar.solver.group_terms import GroupTerms
from autopar.problem.graph import edge_flags
from autopar.problem.nodes import OP, PARAM, PlanGraph
from autopar.solver.recompute_rows import add_recompute_peak
from autopar.solver.backward_rows import add_backward_peak
from autopar.pipeline.stage_memory import MemoryShares
from autopar.solver.milp import COMPUTE, INF, MEMORY, OWN, RESHARDS, SCALE, Model, Result, run
from autopar.solver.overlap import OverlapTerms
from autopar.solver.sharing import EdgeKey, sharing_classes
from autopar.solver.warm_start import (NARROW_FROM_COLUMNS, NARROW_KEEP, PairTerms, likely_strategies, merge_tied,
                                       run_started)
from autopar.units import fmt_bytes

ENOUGH_SLACK = 1e-9
"""How far over ``enough_bytes`` a least-memory solve's plan may be and still count (HiGHS's bound is strict)."""
MEMORY_UNIT = 2**20
"""The memory row counts MiB: coefficients far from 1 (2.4e10 bytes of a big model's state)
break HiGHS's numerics, and coarser units fall under its smallest matrix value (1e-9)."""


@dataclass
class Solution:
    choice: dict[str, int]
    """Representative node -> index of its chosen strategy."""
    objective_s: float
    memory_bytes: float
    num_variables: int
    num_constraints: int
    build_seconds: float
    """Seconds building its model took (an LP bound and the solve after it share one: ``Built``)."""
    solve_seconds: float
    status: str = "optimal"
    """'optimal', or 'time_limit' when HiGHS stopped at its time limit with this plan."""
    gap: float | None = 0.0
    """Relative gap to the best bound HiGHS proved (0 when optimal)."""
    time_limit_s: float = 0.0
    scenario: Any = None
    """The memory scenario (``autopar.memory.scenarios.Scenario``) the plan was solved under; None: the
    step's own."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about how this plan was found (scenarios HiGHS failed on)."""
    zero1_params: int = 0
    """Parameters (folded instances counted) whose chosen strategy is a ZeRO-1 twin (``Strategy.zero1``)."""
    terms: dict[str, float] = field(default_factory=dict)
    """The objective in seconds by name (``milp.TERMS``): what the predicted step adds up; empty for a
    least-memory plan or an LP bound."""
    search: dict[str, int] = field(default_factory=dict)
    """How a memory search found it (``autopar.search``): scenarios, and how many were solved
    under the limit, skipped as not fitting, bounded out, or bounded by a free solve; empty
    when the first plan fit."""


@dataclass(frozen=True)
class NoPlan:
    """Why an ILP gave no plan (what a solve returns instead of a ``Solution``)."""

    kind: str
    """'memory' (nothing fits the limit, or nothing beats the cutoff), 'bound' (an LP relaxation's optimum
    is over the cutoff), 'time_limit' (none found in time), 'pins' (the pinned placements conflict) or
    'failed' (HiGHS stopped otherwise)."""
    message: str

    def error(self) -> Exception:
        """The error a user gets when this is the last word."""
        kinds = {"memory": MemoryLimitError, "time_limit": SolverTimeLimitError, "pins": InputError}
        return kinds.get(self.kind, RuntimeError)(self.message)


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



def _strategy_columns(model: Model, graph: PlanGraph, reps: list[str], mult: dict[str, int],
                      minimize_memory: bool) -> tuple[dict[str, list[int]], dict[int, float]]:
    """One binary column per strategy of each representative node, exactly one chosen per node,
    priced by its time (or memory) times the node's multiplicity; the columns and their bytes."""
    x: dict[str, list[int]] = {}
    memory_row: dict[int, float] = {}
    for v in reps:
        node = graph.nodes[v]
        x[v] = []
        own_comm = node.comm_times or [0.0] * len(node.costs)
        for cost, comm in zip(node.costs, own_comm):
            j = model.var(0.0, integer=True)
            if minimize_memory:
                model.add_cost(j, mult[v] * cost.memory, MEMORY)
            else:
                model.add_cost(j, mult[v] * cost.time * SCALE, COMPUTE)
                model.add_cost(j, mult[v] * comm * SCALE, OWN)
            x[v].append(j)
            memory_row[j] = mult[v] * cost.memory
        model.rows.append(({j: 1.0 for j in x[v]}, 1.0, 1.0))
    return x, memory_row

@dataclass(frozen=True, eq=False)
class Built:
    """One problem's model, built once (``build``), solved by ``solve`` as often as asked: an LP bound
    and then the ILP of the same problem share it. ``solve`` checks it is of the problem it is given."""

    graph: PlanGraph
    folding: Folding
    memory_limit: float | None
    minimize_memory: bool
    shares: MemoryShares | None
    model: Model
    x: dict[str, list[int]]
    memory_row: dict[int, float]
    terms: PairTerms
    sync: GradSyncTerms
    seconds: float
    """How long building it took."""

    def of(self, graph: PlanGraph, folding: Folding, memory_limit: float | None, minimize_memory: bool,
           shares: MemoryShares | None) -> bool:
        return (self.graph is graph and self.folding is folding and self.memory_limit == memory_limit
                and self.minimize_memory == minimize_memory and self.shares is shares)


def build(graph: PlanGraph, folding: Folding, ctx: CostContext, memory_limit: float | None, *,
          minimize_memory: bool = False, shares: MemoryShares | None = None, prices: EdgePrices | None = None
          ) -> Built:
    """The model ``solve`` runs (its arguments as there)."""
    start = time.perf_counter()
    reps = [n for n in graph.order if folding.representative[n] == n]
    mult = folding.multiplicity
    model = Model()
    x, memory_row = _strategy_columns(model, graph, reps, mult, minimize_memory)
    _one_state_family(model, graph, reps, x)
    for v, w in folding.tied.items():  # one plan in every instance of a split class
        model.rows.extend(({a: 1.0, b: -1.0}, 0.0, 0.0) for a, b in zip(x[v], x[w]))
    terms = PairTerms(strategy_columns=len(model.cost))
    prices = prices or EdgePrices(ctx)  # the same reshard recurs on many edges
    assert prices.key == EdgePrices.key_of(ctx), "edge prices kept for another context"
    sync = GradSyncTerms(model, graph, ctx, mult, x, priced=not minimize_memory)
    overlap = OverlapTerms(model, graph, folding, ctx, priced=not minimize_memory)
    groups = GroupTerms(model, graph, ctx, mult, sync, overlap, priced=not minimize_memory)
    _link_edges(model, graph, folding, ctx, x, prices, memory_row, minimize_memory, (sync, overlap, groups), terms)
    sync.add_bucket_rows()
    sync.add_gather_rows(x)
    if shares is None:  # a pipeline's stage mesh holds no bucket buffers (``search.planned.with_pipeline``)
        sync.add_buffer_memory(memory_row)
    sync.add_overlap_row({j: mult[v] * backward_time(cost, ctx) * SCALE for v in reps if graph.nodes[v].kind == OP
                          for j, cost in zip(x[v], graph.nodes[v].costs)})
    overlap.add_rows(x)
    overlap.add_memory(memory_row, minimize_memory)
    add_recompute_peak(model, graph, reps, x, mult, memory_row, minimize_memory)
    add_backward_peak(model, graph, folding, ctx, x, memory_row, minimize_memory)
    memory_row = _memory_use(model, graph, x, memory_row, memory_limit, minimize_memory, shares)
    return Built(graph, folding, memory_limit, minimize_memory, shares, model, x, memory_row, terms, sync,
                 time.perf_counter() - start)


def solve(graph: PlanGraph, folding: Folding, ctx: CostContext, memory_limit: float | None,
          *, minimize_memory: bool = False, time_limit_s: float = 120.0, explain: bool = True,
          cutoff_s: float | None = None, shares: MemoryShares | None = None,
          enough_bytes: float | None = None, relaxed: bool = False, fixed: dict[str, int] | None = None,
          prices: EdgePrices | None = None, built: Built | None = None) -> Solution | NoPlan:
    """The cheapest plan within ``memory_limit`` (or the leanest, ``minimize_memory``), or ``NoPlan``
    saying why there is none: with ``explain`` its message says what the leanest plan needs (another
    solve). With ``cutoff_s`` only a plan faster than that counts (else ``NoPlan``, unexplained).
    ``shares``: the memory row is one pipeline rank's share of the step's (``MemoryShares``).
    ``enough_bytes``, with ``minimize_memory``: stop at the first plan needing no more (status
    'target_reached'), or ``NoPlan`` ('memory') once none can (HiGHS prunes every branch whose bound is
    over it): whether some plan fits a limit takes a fraction of the leanest plan's proof.
    ``relaxed``: the LP relaxation's optimum only (status 'relaxed'; its choice means nothing), a
    bound no plan within the limit beats; ``NoPlan`` when even the relaxation does not fit, or ('bound')
    once the relaxation is known to be over ``cutoff_s``. ``fixed``:
    each representative node's strategy given (status 'repriced'): the objective and its terms of that
    choice, nothing searched. A solution's ``terms`` are its objective by name (``milp.TERMS``). ``prices``:
    edge prices kept from solves before (``EdgePrices.key`` equal to ``ctx``'s). ``built``: this problem's
    model built before (``build``; not with ``fixed``)."""
    given = fixed
    if fixed is not None:  # one strategy per node: the model of that choice alone, a fraction of the whole
        assert built is None, "a fixed choice builds its own narrowed model"
        graph, fixed = _narrowed(graph, folding, fixed), {v: 0 for v in fixed}
    if built is None:
        built = build(graph, folding, ctx, memory_limit, minimize_memory=minimize_memory, shares=shares,
                      prices=prices)
    assert built.of(graph, folding, memory_limit, minimize_memory, shares), "a model built for another problem"
    model, x, memory_row, terms, sync = built.model, built.x, built.memory_row, built.terms, built.sync
    start = time.perf_counter()
    result = _run(model, x, folding, time_limit_s, None if cutoff_s is None else cutoff_s * SCALE,
                  minimize_memory, enough_bytes, relaxed, fixed,
                  lambda: [c + sync.seconds.get(j, 0.0) for j, c in enumerate(model.cost)], terms)
    if result.values is None:
        if relaxed and result.status == "over_cutoff":
            return NoPlan("bound", f"its LP relaxation is over the cutoff of {cutoff_s:.6g} s")
        if (not explain or cutoff_s is not None) and result.status == "infeasible" and memory_limit is not None:
            return NoPlan("memory", f"no plan fits the memory limit of {fmt_bytes(memory_limit)} per device")
        if minimize_memory and enough_bytes is not None and result.status == "infeasible":
            return NoPlan("memory", f"no plan needs {fmt_bytes(enough_bytes)} per device or less")
        return _no_plan(graph, folding, ctx, memory_limit, minimize_memory, result.status, time_limit_s)
    values = result.values
    reps, mult = list(x), folding.multiplicity
    choice = {v: int(np.argmax([values[j] for j in x[v]])) for v in reps}
    memory = sum(weight * values[j] for j, weight in memory_row.items())
    zero1 = sum(mult[v] for v in reps if graph.nodes[v].strategies[choice[v]].zero1 is not None)
    choice = dict(given) if given is not None else choice  # the narrowed graph's index 0 is the choice given
    named = {} if minimize_memory or relaxed else {k: v / SCALE for k, v in model.term_values(values).items()}
    return Solution(choice, result.objective if minimize_memory else result.objective / SCALE, memory,
                    len(model.cost), len(model.rows), built.seconds, time.perf_counter() - start,
                    status="repriced" if fixed is not None else result.status, gap=result.gap,
                    time_limit_s=time_limit_s, zero1_params=zero1, terms=named)


def _link_edges(model: Model, graph: PlanGraph, folding: Folding, ctx: CostContext, x: dict[str, list[int]],
                prices: EdgePrices, memory_row: dict[int, float], minimize_memory: bool,
                rows: tuple[GradSyncTerms, OverlapTerms, GroupTerms], terms: PairTerms) -> None:
    """Every edge's ends tied and priced (``_add_edge``); a reshard that several edges share
    (``sharing_classes``) paid once per tensor (``_add_shared``)."""
    classes = sharing_classes(graph, folding)
    solo: dict[EdgeKey, int] = defaultdict(int)
    for keys, count in classes.items():
        if len(keys) == 1:
            solo[keys[0]] += count
    shared_keys = {k for keys in classes if len(keys) > 1 for k in keys}
    links: dict[EdgeKey, _Link] = {}
    for edge in aggregate_edges(graph, folding):
        key = (edge.producer, edge.out_index, edge.consumer, edge.arg)
        link = _add_edge(model, graph, ctx, edge, x, prices, memory_row, minimize_memory, rows,
                         count=solo.get(key, 0), transport=key in shared_keys, terms=terms)
        if link is not None:
            links[key] = link
    for keys, count in classes.items():
        if len(keys) > 1:
            _add_shared(model, [links[k] for k in keys], count, memory_row, terms,
                        MEMORY if minimize_memory else RESHARDS)


def _narrowed(graph: PlanGraph, folding: Folding, choice: dict[str, int]) -> PlanGraph:
    """``graph`` with each node's chosen strategy only (``choice``: by representative): its model prices
    that choice as the whole model does, every term a function of the chosen strategies alone."""
    nodes = {}
    for name, node in graph.nodes.items():
        s = choice[folding.representative[name]]
        nodes[name] = replace(node, strategies=[node.strategies[s]], costs=[node.costs[s]],
                              comm_times=node.comm_times[s:s + 1], recompute_memory=node.recompute_memory[s:s + 1])
    return replace(graph, nodes=nodes)


def _run(model: Model, x: dict[str, list[int]], folding: Folding, time_limit_s: float, cutoff: float | None,
         minimize_memory: bool, enough_bytes: float | None, relaxed: bool, fixed: dict[str, int] | None,
         start_costs: Callable[[], list[float]], terms: PairTerms) -> Result:
    """HiGHS on ``model`` as ``solve`` asks: the given choice fixed, the LP relaxation, a narrowed start, or
    plain. A start pays for a plan to be found, not for a bound (a memory search's cutoff solves, mostly
    pruned at the root) nor for the leanest plan."""
    if fixed is not None:
        return run(model, time_limit_s, zero=[j for v, js in x.items() for s, j in enumerate(js) if s != fixed[v]])
    if relaxed:
        result = run(model, time_limit_s, cutoff, relaxed=True)
        return replace(result, status="relaxed") if result.status == "optimal" else result  # else no bound
    if len(model.cost) >= NARROW_FROM_COLUMNS and cutoff is None and not minimize_memory:
        likely = likely_strategies(x, start_costs(), terms, keep=NARROW_KEEP)
        merge_tied(likely, folding.tied)
        return run_started(model, x, likely, time_limit_s, cutoff)
    if minimize_memory and enough_bytes is not None:  # only whether some plan needs no more: HiGHS prunes above it
        return run(model, time_limit_s, enough_bytes * (1.0 + ENOUGH_SLACK), target=enough_bytes)
    return run(model, time_limit_s, cutoff)


def _one_state_family(model: Model, graph: PlanGraph, reps: list[str], x: dict[str, list[int]]) -> None:
    """Where parameters may have ZeRO-1 and offloaded twins both (``state_twins``), a plan uses
    one kind: the runtime's optimizers do not combine them. Binary f: ZeRO-1 twins only with f,
    offloaded ones only without (each sum counts at most one chosen strategy per parameter)."""
    zero1: list[int] = []
    offload: list[int] = []
    with_zero1 = with_offload = 0
    for v in reps:
        node = graph.nodes[v]
        if node.kind != PARAM:
            continue
        z = [j for j, s in zip(x[v], node.strategies) if s.zero1 is not None]
        o = [j for j, s in zip(x[v], node.strategies) if s.offload]
        zero1 += z
        offload += o
        with_zero1 += bool(z)
        with_offload += bool(o)
    if zero1 and offload:
        f = model.var(0.0, integer=True)
        model.rows.append(({**{j: 1.0 for j in zero1}, f: -float(with_zero1)}, -INF, 0.0))
        model.rows.append(({**{j: 1.0 for j in offload}, f: float(with_offload)}, -INF, float(with_offload)))


def _memory_use(model: Model, graph: PlanGraph, x: dict[str, list[int]], memory_row: dict[int, float],
                memory_limit: float | None, minimize_memory: bool, shares: MemoryShares | None) -> dict[int, float]:
    """The memory row (a pipeline rank's share of it with ``shares``) made the objective
    (``minimize_memory``) or a row under ``memory_limit``; returned as the solution reads it."""
    if shares is not None:
        memory_row = shares.weigh(graph, x, memory_row)
    if minimize_memory:  # the objective is exactly the memory row (terms priced nowhere else included)
        model.cost = [memory_row.get(j, 0.0) for j in range(len(model.cost))]
        model.terms = {j: {MEMORY: c} for j, c in enumerate(model.cost) if c}
    elif memory_limit is not None:
        row = {j: b / MEMORY_UNIT for j, b in memory_row.items()}
        model.rows.append((row, -INF, float(memory_limit) / MEMORY_UNIT))
    return memory_row


def _no_plan(graph: PlanGraph, folding: Folding, ctx: CostContext, memory_limit: float | None,
             minimize_memory: bool, status: str, time_limit_s: float) -> NoPlan:
    """Why no plan came back: the time limit, the memory limit, or conflicting pins."""
    if status == "time_limit":
        return NoPlan("time_limit", f"the ILP solver (HiGHS) found no plan within its time limit of {time_limit_s:g} "
                      "s; raise the limit (solver_time_limit_s=...)")
    if status != "infeasible":
        return NoPlan("failed", f"the ILP solver (HiGHS) stopped without a plan: status {status}")
    if memory_limit is not None and not minimize_memory:
        leanest = solve(graph, folding, ctx, None, minimize_memory=True, time_limit_s=time_limit_s)
        if isinstance(leanest, NoPlan):
            return leanest
        return NoPlan("memory", f"no plan fits the memory limit of {fmt_bytes(memory_limit)} per device; the plan "
                      f"with the least memory needs {fmt_bytes(leanest.memory_bytes)} per device")
    return NoPlan("pins", "no plan satisfies the pinned placements together (constraints, data axes or "
                  "input_sharded conflict on some edge)")


@dataclass
class _Link:
    """An edge's transport variables, for reshards shared with sibling edges."""

    e: list[list[int]]
    """e[a][b]: producer placement group a feeds consumer group b."""
    target: list[tuple]
    """Consumer group b -> what it asks for: (placement, gradient placement sent back)."""
    cost: list[list[float]]
    """cost[a][b]: reshard objective for one real tensor."""
    mem: list[list[float]]
    """mem[a][b]: bytes it holds until backward."""


def _add_edge(model: Model, graph: PlanGraph, ctx: CostContext, edge: _Edge, x: dict[str, list[int]],
              prices: EdgePrices, memory_row: dict[int, float], minimize_memory: bool,
              rows: tuple[GradSyncTerms, OverlapTerms, GroupTerms], *, count: int, transport: bool,
              terms: PairTerms) -> _Link | None:
    """Link the edge's two ends; its objective is reshard time (or, when minimizing memory,
    the memory it keeps: a parameter gathered in forward stays gathered until backward),
    ``count`` times for tensors that reshard for this edge alone. With ``transport`` the edge
    gets explicit pair variables, returned for pricing reshards shared with other edges.
    ``terms`` learns the edge's pair columns (for the start HiGHS is given); ``rows``: the terms
    priced beyond the edge (gradient syncs, overlap windows, grouped collectives' calls)."""
    sync, overlap, groups = rows
    prod, cons = graph.nodes[edge.producer], graph.nodes[edge.consumer]
    grad = graph.sends_gradient(edge.producer, edge.consumer)
    groups_p: dict[object, list[int]] = defaultdict(list)
    for s, strat in enumerate(prod.strategies):
        groups_p[strat.outputs[edge.out_index]].append(s)
    groups_c: dict[object, list[int]] = defaultdict(list)
    for s, strat in enumerate(cons.strategies):
        active = tuple(strat.is_active(i) for i in range(ctx.mesh.ndim))
        groups_c[(strat.inputs[edge.arg], active)].append(s)
    keys_p, keys_c = list(groups_p), list(groups_c)
    meta = prod.outputs[edge.out_index]
    assert meta is not None
    flags = edge_flags(graph, edge.producer, edge.consumer, edge.arg)
    unit_mem = prices.held(meta, flags, keys_p, keys_c)
    unit_cost = unit_mem if minimize_memory else [
        [t * SCALE for t in row]
        for row in prices.times(meta, flags, keys_p, keys_c, [cons.strategies[groups_c[b][0]] for b in keys_c])]
    mem = [[m * count for m in row] for row in unit_mem]
    cost = [[c * count for c in row] for row in unit_cost]

    syncing = sync.edge(edge.producer, groups_p, keys_c, grad)
    def price(a: int, b: int) -> EdgeCost:
        return prices.cost(meta, flags, keys_p[a], keys_c[b], cons.strategies[groups_c[keys_c[b]][0]])
    window = overlap.edge((edge.producer, edge.out_index, edge.consumer, edge.arg), count, price)
    unwaited = sync.unwaited(edge.producer, count, price) if grad else None
    grouping = groups.edge(edge.producer, edge.consumer, price)

    columns: dict[tuple[int, int], int] = {}

    def add(j: int, a: int, b: int) -> None:
        """Variable j is 1 exactly when this edge runs producer group a into consumer group b."""
        columns[(a, b)] = j
        model.add_cost(j, cost[a][b], MEMORY if minimize_memory else RESHARDS)
        if mem[a][b]:
            memory_row[j] = memory_row.get(j, 0.0) + mem[a][b]
        syncing.note(j, a, b)
        if window is not None:
            window(j, a, b)
        if unwaited is not None:
            unwaited(j, a, b)
        if grouping is not None:
            grouping.note(j, a, b)
    link = None
    if edge.arg in cons.as_produced:  # written in place (or a view written through): never resharded
        if transport:
            link = _transport(model, edge, x, groups_p, groups_c, add, ctx, grad, unit_cost, unit_mem)
        link = _add_as_produced_edge(model, edge, x, groups_p, groups_c, add, link)
    elif transport:
        link = _transport(model, edge, x, groups_p, groups_c, add, ctx, grad, unit_cost, unit_mem)
    else:
        _link_ends(model, edge, x, groups_p, groups_c, add, grad, cons.follower)
    syncing.close()
    if grouping is not None:
        grouping.close()
    if edge.arg in cons.as_produced:  # pairs of differing placements are ruled out
        columns = {(a, b): j for (a, b), j in columns.items() if keys_p[a] == keys_c[b][0]}
    terms.add_edge(edge.producer, edge.consumer, groups_p, groups_c, columns, syncing.columns())
    return link


def _link_ends(model: Model, edge: _Edge, x: dict[str, list[int]], groups_p: dict, groups_c: dict,
               add: Callable[[int, int, int], None], needs_grad: bool, follower: bool) -> None:
    """Tie an edge's ends with as few variables as its shape allows."""
    keys_p, keys_c = list(groups_p), list(groups_c)
    inputs_taken = {placement for placement, _ in keys_c}
    if (follower and edge.producer != edge.consumer and len(keys_p) > 1 and len(keys_c) > 1
            and all(a in inputs_taken for a in keys_p)):  # every producer choice stays usable
        _add_follower_edge(model, edge, x, groups_p, groups_c, add)
        return None
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
    _transport(model, edge, x, groups_p, groups_c, add, None, needs_grad, [], [])


def _transport(model: Model, edge: _Edge, x: dict[str, list[int]], groups_p: dict, groups_c: dict,
               add: Callable[[int, int, int], None], ctx: CostContext | None, needs_grad: bool,
               unit_cost: list[list[float]], unit_mem: list[list[float]]) -> _Link | None:
    """Pair variables e[a][b] whose marginals are the two ends' choices (and, given ``ctx``,
    the link for pricing reshards shared with sibling edges)."""
    keys_p, keys_c = list(groups_p), list(groups_c)
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
    if ctx is None:
        return None
    train = ctx.train and needs_grad
    target = [(placement, tuple(grad_placement_at_consumer(r, act) for r, act in zip(placement, active))
               if train else None) for placement, active in keys_c]
    return _Link(e, target, unit_cost, unit_mem)


def _add_shared(model: Model, links: list[_Link], count: int, memory_row: dict[int, float],
                terms: PairTerms, term: str) -> None:
    """y[a, t] >= every sibling edge's e[a][b] asking for t: each reshard paid once per tensor.
    The shared copy is held until backward if any of its consumers saves it, so y carries the
    largest of the siblings' prices (they differ only in what each consumer keeps or replays)."""
    ids: dict[tuple, int] = {}  # targets as ints: hashing placements per (a, b) pair was the cost here
    targets = [[ids.setdefault(t, len(ids)) for t in link.target] for link in links]
    cost: dict[tuple[int, int], float] = defaultdict(float)
    mem: dict[tuple[int, int], float] = defaultdict(float)
    for link, target in zip(links, targets):
        mine_cost: dict[tuple[int, int], float] = {}  # per link, the last group asking for a target counts
        mine_mem: dict[tuple[int, int], float] = {}
        for a, (cost_row, mem_row) in enumerate(zip(link.cost, link.mem)):
            for t, c, m in zip(target, cost_row, mem_row):
                mine_cost[(a, t)], mine_mem[(a, t)] = c, m
        for key, c in mine_cost.items():
            cost[key] = max(cost[key], c)
            mem[key] = max(mem[key], mine_mem[key])
    y: dict[tuple[int, int], int] = {}
    for link, target in zip(links, targets):
        for a, row in enumerate(link.e):
            for b, e_ab in enumerate(row):
                key = (a, target[b])
                if key not in y:
                    y[key] = model.var(cost[key] * count, integer=False, term=term)
                    if mem[key]:
                        memory_row[y[key]] = memory_row.get(y[key], 0.0) + mem[key] * count
                model.rows.append(({y[key]: 1.0, e_ab: -1.0}, 0.0, INF))
                terms.extra[e_ab].append(y[key])


def _add_follower_edge(model: Model, edge: _Edge, x: dict[str, list[int]], groups_p: dict, groups_c: dict,
                       add: Callable[[int, int, int], None]) -> None:
    """A view or elementwise op takes its input as produced: resharding before it costs
    the same as after it, so only matching placements are linked (far fewer variables)."""
    keys_p, keys_c = list(groups_p), list(groups_c)
    flow_in: dict[int, dict[int, float]] = {a: {} for a in range(len(keys_p))}
    index_p = {k: i for i, k in enumerate(keys_p)}  # distinct keys: a scan per consumer group was quadratic
    for b, (placement, _active) in enumerate(keys_c):
        a = index_p.get(placement)
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


def _add_as_produced_edge(model: Model, edge: _Edge, x: dict[str, list[int]], groups_p: dict, groups_c: dict,
                          add: Callable[[int, int, int], None], link: _Link | None) -> _Link | None:
    """The consumer takes the input exactly as produced: only equal placements are linked
    (with transport variables already made for a shared reshard, the others are fixed to 0)."""
    keys_p, keys_c = list(groups_p), list(groups_c)
    if link is not None:
        for a, ka in enumerate(keys_p):
            for b, (placement, _active) in enumerate(keys_c):
                if ka != placement:
                    model.rows.append(({link.e[a][b]: 1.0}, 0.0, 0.0))
        return link
    if edge.producer == edge.consumer:  # one decision on both ends: rule out the strategies that differ
        for s in range(len(x[edge.consumer])):
            a = next(i for i, k in enumerate(keys_p) if s in groups_p[k])
            b = next(i for i, k in enumerate(keys_c) if s in groups_c[k])
            if keys_p[a] != keys_c[b][0]:
                model.rows.append(({x[edge.consumer][s]: 1.0}, 0.0, 0.0))
            else:
                add(x[edge.consumer][s], a, b)
        return None
    _add_follower_edge(model, edge, x, groups_p, groups_c, add)
    return None
