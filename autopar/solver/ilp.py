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
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from autopar.cost.model import CostContext, backward_time
from autopar.errors import InputError, MemoryLimitError, SolverTimeLimitError
from autopar.problem.folding import Folding
from autopar.solver.edge_links import link_edges
from autopar.solver.edge_prices import EdgePrices
from autopar.solver.grad_terms import GradSyncTerms
from autopar.solver.group_terms import GroupTerms
from autopar.problem.nodes import OP, PARAM, PlanGraph
from autopar.solver.recompute_rows import add_recompute_peak
from autopar.solver.backward_rows import add_backward_peak
from autopar.pipeline.stage_memory import MemoryShares
from autopar.solver.milp import COMPUTE, INF, MEMORY, OWN, SCALE, Model, Result, run
from autopar.solver.overlap import OverlapTerms
from autopar.solver.warm_start import LP_LED_FROM_COLUMNS, run_from_lp, run_under
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


def _strategy_columns(model: Model, graph: PlanGraph, reps: list[str], folding: Folding, minimize_memory: bool
                      ) -> tuple[dict[str, list[int]], dict[int, float]]:
    """One binary column per strategy of each representative node, exactly one chosen per node,
    priced by its time (or memory) times the node's multiplicity; the columns and their bytes. A part
    of a split class (``Folding.tied``: one strategy for every part) shares its first part's columns,
    its prices added to theirs: columns the solver would otherwise keep equal by rows."""
    x: dict[str, list[int]] = {}
    memory_row: dict[int, float] = defaultdict(float)
    mult = folding.multiplicity
    for v in sorted(reps, key=lambda v: v in folding.tied):  # each class's first part before the others
        node = graph.nodes[v]
        head = folding.tied.get(v)
        if head is None:
            x[v] = [model.var(0.0, integer=True) for _ in node.costs]
            model.rows.append(({j: 1.0 for j in x[v]}, 1.0, 1.0))
        else:
            assert len(node.costs) == len(x[head]), "a tied part with other strategies than its class's"
            x[v] = x[head]
        own_comm = node.comm_times or [0.0] * len(node.costs)
        for j, cost, comm in zip(x[v], node.costs, own_comm):
            if minimize_memory:
                model.add_cost(j, mult[v] * cost.memory, MEMORY)
            else:
                model.add_cost(j, mult[v] * cost.time * SCALE, COMPUTE)
                model.add_cost(j, mult[v] * comm * SCALE, OWN)
            memory_row[j] += mult[v] * cost.memory
    return {v: x[v] for v in reps}, dict(memory_row)

@dataclass(eq=False)
class Built:
    """One problem's model, built once (``build``), solved by ``solve`` as often as asked: an LP bound
    and then the ILP of the same problem share it, and its LP relaxation once solved. ``solve`` checks it
    is of the problem it is given."""

    graph: PlanGraph
    folding: Folding
    memory_limit: float | None
    minimize_memory: bool
    shares: MemoryShares | None
    model: Model
    x: dict[str, list[int]]
    memory_row: dict[int, float]
    seconds: float
    """How long building it took."""
    relaxation: Result | None = None
    """Its LP relaxation's optimum, once solved to the end (not stopped at a cutoff): an LP bound and
    the ILP after it read the one solve (``warm_start.run_from_lp``)."""

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
    x, memory_row = _strategy_columns(model, graph, reps, folding, minimize_memory)
    _one_state_family(model, graph, reps, x)
    prices = prices or EdgePrices(ctx)  # the same reshard recurs on many edges
    assert prices.key == EdgePrices.key_of(ctx), "edge prices kept for another context"
    sync = GradSyncTerms(model, graph, ctx, mult, x, priced=not minimize_memory)
    overlap = OverlapTerms(model, graph, folding, ctx, priced=not minimize_memory)
    groups = GroupTerms(model, graph, ctx, mult, sync, overlap, priced=not minimize_memory)
    link_edges(model, graph, folding, ctx, x, prices, memory_row, minimize_memory, (sync, overlap, groups))
    sync.add_bucket_rows()
    sync.add_gather_rows(x)
    if shares is None:  # a pipeline's stage mesh holds no bucket buffers (``search.planned.with_pipeline``)
        sync.add_buffer_memory(memory_row)
    backward: dict[int, float] = defaultdict(float)  # tied parts share columns: their seconds add up
    for v in reps:
        if graph.nodes[v].kind == OP:
            for j, cost in zip(x[v], graph.nodes[v].costs):
                backward[j] += mult[v] * backward_time(cost, ctx) * SCALE
    sync.add_overlap_row(dict(backward))
    overlap.add_rows(x)
    overlap.add_memory(memory_row, minimize_memory)
    add_recompute_peak(model, graph, reps, x, mult, memory_row, minimize_memory)
    add_backward_peak(model, graph, folding, ctx, x, memory_row, minimize_memory)
    memory_row = _memory_use(model, graph, x, memory_row, memory_limit, minimize_memory, shares)
    return Built(graph, folding, memory_limit, minimize_memory, shares, model, x, memory_row,
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
    model, x, memory_row = built.model, built.x, built.memory_row
    start = time.perf_counter()
    result = _run(built, time_limit_s, None if cutoff_s is None else cutoff_s * SCALE, enough_bytes, relaxed, fixed)
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


def _narrowed(graph: PlanGraph, folding: Folding, choice: dict[str, int]) -> PlanGraph:
    """``graph`` with each node's chosen strategy only (``choice``: by representative): its model prices
    that choice as the whole model does, every term a function of the chosen strategies alone."""
    nodes = {}
    for name, node in graph.nodes.items():
        s = choice[folding.representative[name]]
        nodes[name] = replace(node, strategies=[node.strategies[s]], costs=[node.costs[s]],
                              comm_times=node.comm_times[s:s + 1], recompute_memory=node.recompute_memory[s:s + 1])
    return replace(graph, nodes=nodes)


def _run(built: Built, time_limit_s: float, cutoff: float | None, enough_bytes: float | None, relaxed: bool,
         fixed: dict[str, int] | None) -> Result:
    """HiGHS on ``built``'s model as ``solve`` asks: the given choice fixed, the LP relaxation, led by the LP,
    or plain. The LP leads a solve that must find a plan (``run_from_lp``), and on a large model, or one
    whose LP bound was solved, it fixes the columns a cutoff solve's plans cannot use (``run_under``: a
    memory search's, seeking only plans faster than one in hand); not the leanest plan's solve."""
    model, x = built.model, built.x
    if fixed is not None:
        return run(model, time_limit_s, zero=[j for v, js in x.items() for s, j in enumerate(js) if s != fixed[v]])
    if relaxed:
        result = built.relaxation or run(model, time_limit_s, cutoff, relaxed=True)
        if result.status == "optimal":
            built.relaxation = result
        if cutoff is not None and result.values is not None and result.objective > cutoff:
            return replace(result, values=None, status="over_cutoff")
        return replace(result, status="relaxed") if result.status == "optimal" else result  # else no bound
    led = len(model.cost) >= LP_LED_FROM_COLUMNS or built.relaxation is not None  # (an LP bound's, kept)
    if led and cutoff is None and not built.minimize_memory:
        return run_from_lp(model, x, time_limit_s, built.relaxation)
    if built.minimize_memory and enough_bytes is not None:  # only whether some plan needs no more
        return run(model, time_limit_s, enough_bytes * (1.0 + ENOUGH_SLACK), target=enough_bytes)
    if led and cutoff is not None:
        return run_under(model, time_limit_s, cutoff, built.relaxation)
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
        model.knapsack = len(model.rows)
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


