"""The placement ILP's edges: each edge between two nodes tied to its ends' strategy columns and priced
by its reshard (``cost.model.edge_cost`` through ``EdgePrices``), folded into one end's columns where the
other has a single placement, else through transport columns e[a, b] (producer placement group a, consumer
group b) tied to the x's by their marginals; a reshard that several edges share paid once
(``solver.sharing``). ``solver.ilp`` builds the rest of the model."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from autopar.cost.collectives import grad_placement_at_consumer
from autopar.cost.model import CostContext, EdgeCost
from autopar.problem.folding import Folding
from autopar.problem.graph import edge_flags
from autopar.problem.nodes import PlanGraph
from autopar.rules.strategy import Strategy
from autopar.solver.edge_prices import EdgePrices
from autopar.solver.grad_terms import GradSyncTerms
from autopar.solver.group_terms import GroupTerms
from autopar.solver.milp import INF, MEMORY, RESHARDS, SCALE, Model
from autopar.solver.overlap import OverlapTerms
from autopar.solver.sharing import EdgeKey, sharing_classes


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



def link_edges(model: Model, graph: PlanGraph, folding: Folding, ctx: CostContext, x: dict[str, list[int]],
                prices: EdgePrices, memory_row: dict[int, float], minimize_memory: bool,
                rows: tuple[GradSyncTerms, OverlapTerms, GroupTerms]) -> None:
    """Every edge's ends tied and priced (``_priced``, ``_link``); a reshard that several edges share
    (``sharing_classes``) paid once per tensor (``_add_shared``). The edges between the same parts of
    split classes (``Folding.tied``: their strategy columns are one) share one set of pair columns, each
    edge priced on them: in any plan their pairs are the same, and a split stack's model stays the size
    of a whole one's."""
    classes = graph.edges.kept("sharing classes", folding, lambda: sharing_classes(graph, folding))
    solo: dict[EdgeKey, int] = defaultdict(int)
    for keys, count in classes.items():
        if len(keys) == 1:
            solo[keys[0]] += count
    shared_keys = {k for keys in classes if len(keys) > 1 for k in keys}
    head = folding.tied
    alike: dict[tuple, list[_Edge]] = defaultdict(list)  # edges whose pairs are one: same columns, same way linked
    for edge in graph.edges.kept("edges", folding, lambda: aggregate_edges(graph, folding)):
        key = (edge.producer, edge.out_index, edge.consumer, edge.arg)
        alike[(head.get(edge.producer, edge.producer), edge.out_index, head.get(edge.consumer, edge.consumer),
               edge.arg, key in shared_keys, graph.sends_gradient(edge.producer, edge.consumer))].append(edge)
    links: dict[EdgeKey, _Link] = {}
    for (*_, transport, _grad), edges in alike.items():
        members = [_priced(model, graph, ctx, edge, prices, memory_row, minimize_memory, rows,
                           count=solo.get((edge.producer, edge.out_index, edge.consumer, edge.arg), 0))
                   for edge in edges]
        links.update(_link(model, ctx, members, x, transport, memory_row))
    for keys, count in classes.items():
        if len(keys) > 1:
            _add_shared(model, [links[k] for k in keys], count, memory_row, MEMORY if minimize_memory else RESHARDS)


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


@dataclass
class _Member:
    """One edge priced: its ends' strategies by the placement they produce and take, its prices per pair,
    and ``add(j, a, b)`` pricing variable j as running producer group a into consumer group b."""

    edge: _Edge
    groups_p: dict[object, list[int]]
    groups_c: dict[object, list[int]]
    unit_cost: list[list[float]]
    unit_mem: list[list[float]]
    add: Callable[[int, int, int], None]
    cost: list[list[float]]
    """cost[a][b]: what ``add`` prices a pair's column at (``count`` tensors; reshard time or held bytes)."""
    mem: list[list[float]]
    """mem[a][b]: what ``add`` puts in the memory row for a pair's column."""
    term: str
    """The objective term ``add`` prices under (reshards, or memory when minimizing it)."""
    hooked: bool
    """Whether ``add`` tells terms beyond the edge (gradient syncs, windows, grouped calls) of each pair."""
    close: Callable[[], None]
    """Adds the rows its pairs' gradient syncs and grouped calls need, once every pair is priced."""
    as_produced: bool
    follower: bool
    grad: bool


def _priced(model: Model, graph: PlanGraph, ctx: CostContext, edge: _Edge, prices: EdgePrices,
            memory_row: dict[int, float], minimize_memory: bool, rows: tuple[GradSyncTerms, OverlapTerms, GroupTerms],
            *, count: int) -> _Member:
    """The edge priced: its objective is reshard time (or, when minimizing memory, the memory it keeps: a
    parameter gathered in forward stays gathered until backward), ``count`` times for tensors that reshard
    for this edge alone. ``rows``: the terms priced beyond the edge (gradient syncs, overlap windows, grouped
    collectives' calls)."""
    sync, overlap, groups = rows
    prod, cons = graph.nodes[edge.producer], graph.nodes[edge.consumer]
    grad = graph.sends_gradient(edge.producer, edge.consumer)
    groups_p = graph.edges.kept(("produced", edge.out_index), prod.strategies,
                                lambda: _grouped(prod.strategies, lambda strat: strat.outputs[edge.out_index]))
    def taken(strat: Strategy) -> tuple[object, tuple[bool, ...]]:
        return strat.inputs[edge.arg], tuple(strat.is_active(i) for i in range(ctx.mesh.ndim))
    groups_c = graph.edges.kept(("taken", edge.arg, ctx.mesh.ndim), cons.strategies,
                                lambda: _grouped(cons.strategies, taken))
    keys_p, keys_c = list(groups_p), list(groups_c)
    meta = prod.outputs[edge.out_index]
    assert meta is not None
    flags = edge_flags(graph, edge.producer, edge.consumer, edge.arg)
    ids = prices.ids(meta, flags, keys_p, keys_c)
    consumers = [cons.strategies[groups_c[b][0]] for b in keys_c]
    unit_mem = prices.held(ids, meta, flags, keys_p, keys_c)
    unit_cost = unit_mem if minimize_memory else prices.scaled(
        prices.times(ids, meta, flags, keys_p, keys_c, consumers), SCALE)
    mem, cost = prices.scaled(unit_mem, count), prices.scaled(unit_cost, count)

    syncing = sync.edge(edge.producer, groups_p, keys_c, grad)
    def price(a: int, b: int) -> EdgeCost:
        return prices.cost(ids, a, b, meta, flags, keys_p[a], keys_c[b][0], consumers[b])
    window = overlap.edge((edge.producer, edge.out_index, edge.consumer, edge.arg), count, price)
    unwaited = sync.unwaited(edge.producer, count, price) if grad else None
    grouping = groups.edge(edge.producer, edge.consumer, price)

    hooks = [hook for hook in (syncing.note if syncing.dims else None, window, unwaited,
                               None if grouping is None else grouping.note) if hook is not None]
    term = MEMORY if minimize_memory else RESHARDS
    add = _adder(model, cost, mem, memory_row, term, hooks)

    def close() -> None:
        syncing.close()
        if grouping is not None:
            grouping.close()
    return _Member(edge, groups_p, groups_c, unit_cost, unit_mem, add, cost, mem, term, bool(hooks), close,
                   edge.arg in cons.as_produced, cons.follower, grad)


def _grouped(strategies: list[Strategy], key: Callable[[Strategy], object]) -> dict[object, list[int]]:
    """A node's strategies by what an edge end reads of them (the placement produced, or taken and the
    split per mesh dim), in order; kept for every build whose node holds the same list (``EdgeMemo``), so
    never changed."""
    groups: dict[object, list[int]] = {}
    for s, strat in enumerate(strategies):
        groups.setdefault(key(strat), []).append(s)
    return groups


def _adder(model: Model, cost: list[list[float]], mem: list[list[float]], memory_row: dict[int, float], term: str,
           hooks: list[Callable[[int, int, int], None]]) -> Callable[[int, int, int], None]:
    """``add(j, a, b)``: column j priced as running producer group a into consumer group b, its
    reshard's cost and held bytes, then told to the ``hooks`` (the terms beyond the edge) in order."""
    add_cost = model.add_cost

    def add(j: int, a: int, b: int) -> None:
        add_cost(j, cost[a][b], term)
        held = mem[a][b]
        if held:
            memory_row[j] = memory_row.get(j, 0.0) + held
        for hook in hooks:
            hook(j, a, b)
    return add


def _link(model: Model, ctx: CostContext, members: list[_Member], x: dict[str, list[int]], transport: bool,
          memory_row: dict[int, float]) -> dict[EdgeKey, _Link]:
    """Link the ends of ``members`` (edges between the same columns, linked alike) once, each pricing the
    variables; with ``transport`` they get explicit pair variables, returned by edge for pricing reshards
    shared with other edges."""
    first = members[0]
    assert all((list(m.groups_p), list(m.groups_c), m.as_produced, m.follower) ==
               (list(first.groups_p), list(first.groups_c), first.as_produced, first.follower) for m in members), \
        "edges between the same columns linked two ways"
    edge, groups_p, groups_c, grad = first.edge, first.groups_p, first.groups_c, first.grad

    def every(j: int, a: int, b: int) -> None:
        """Variable j is 1 exactly when these edges run producer group a into consumer group b."""
        for member in members:
            member.add(j, a, b)
    add = first.add if len(members) == 1 else every
    fresh = None if any(m.hooked for m in members) else partial(_price_fresh, model, members, memory_row)
    e = _transport(model, edge, x, groups_p, groups_c, add, fresh) if transport else None
    if first.as_produced:  # written in place (or a view written through): never resharded
        _add_as_produced_edge(model, edge, x, groups_p, groups_c, add, e)
    elif not transport:
        _link_ends(model, edge, x, groups_p, groups_c, add, first.follower, fresh)
    for member in members:
        member.close()
    if e is None:
        return {}
    train = ctx.train and grad
    target = [(placement, tuple(grad_placement_at_consumer(r, act) for r, act in zip(placement, active))
               if train else None) for placement, active in groups_c]
    return {(m.edge.producer, m.edge.out_index, m.edge.consumer, m.edge.arg): _Link(e, target, m.unit_cost, m.unit_mem)
            for m in members}


def _price_fresh(model: Model, members: list[_Member], memory_row: dict[int, float], first: int) -> None:
    """Columns ``first`` on, one per pair (a, b) in order, priced as every member's ``add`` prices them pair
    by pair (sums in the members' order, the memory row's entries added in the columns' order), where no
    member tells terms beyond the edge: a transport edge's hundreds of pairs priced in one go."""
    costs = [[c for row in m.cost for c in row] for m in members]
    mems = [[b for row in m.mem for b in row] for m in members]
    total, terms, term = model.cost, model.terms, members[0].term
    for j, priced in enumerate(zip(*costs), start=first):
        amount = priced[0]
        for more in priced[1:]:
            amount += more
        total[j] += amount  # a fresh column's 0.0
        terms[j] = {term: amount}
    for j, held in enumerate(zip(*mems), start=first):
        if any(held):
            kept = 0.0
            for b in held:
                if b:
                    kept += b
            memory_row[j] = kept


def _one_decision(edge: _Edge, x: dict[str, list[int]]) -> bool:
    """Whether one choice of strategy decides both ends: an edge into its own node, or between parts of one
    split class, which share their columns (``ilp._strategy_columns``)."""
    return x[edge.producer] is x[edge.consumer]


def _link_ends(model: Model, edge: _Edge, x: dict[str, list[int]], groups_p: dict, groups_c: dict,
               add: Callable[[int, int, int], None], follower: bool, fresh: Callable[[int], None] | None) -> None:
    """Tie an edge's ends with as few variables as its shape allows."""
    keys_p, keys_c = list(groups_p), list(groups_c)
    inputs_taken = {placement for placement, _ in keys_c}
    if (follower and not _one_decision(edge, x) and len(keys_p) > 1 and len(keys_c) > 1
            and all(a in inputs_taken for a in keys_p)):  # every producer choice stays usable
        _add_follower_edge(model, edge, x, groups_p, groups_c, add)
        return None
    if _one_decision(edge, x):
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
    _transport(model, edge, x, groups_p, groups_c, add, fresh)


def _transport(model: Model, edge: _Edge, x: dict[str, list[int]], groups_p: dict, groups_c: dict,
               add: Callable[[int, int, int], None], fresh: Callable[[int], None] | None) -> list[list[int]]:
    """Pair variables e[a][b] whose marginals are the two ends' choices, each priced by ``add``, or all at
    once by ``fresh`` (``_price_fresh``) where the edges have one."""
    keys_p, keys_c = list(groups_p), list(groups_c)
    # 0 or 1 at integral x: each end's marginals are then one group's indicator
    first = model.columns(len(keys_p) * len(keys_c), implied_integer=True)
    e = [list(range(first + a * len(keys_c), first + (a + 1) * len(keys_c))) for a in range(len(keys_p))]
    if fresh is not None:
        fresh(first)
    else:
        for a, row in enumerate(e):
            for b, j in enumerate(row):
                add(j, a, b)
    for a, ka in enumerate(keys_p):
        row = {e[a][b]: 1.0 for b in range(len(keys_c))}
        row.update({x[edge.producer][s]: -1.0 for s in groups_p[ka]})
        model.rows.append((row, 0.0, 0.0))
    for b, kb in enumerate(keys_c):
        row = {e[a][b]: 1.0 for a in range(len(keys_p))}
        row.update({x[edge.consumer][s]: -1.0 for s in groups_c[kb]})
        model.rows.append((row, 0.0, 0.0))
    return e


def _add_shared(model: Model, links: list[_Link], count: int, memory_row: dict[int, float],
                term: str) -> None:
    """y[a, t] >= every sibling edge's e[a][b] asking for t: each reshard paid once per tensor.
    The shared copy is held until backward if any of its consumers saves it, so y carries the
    largest of the siblings' prices (they differ only in what each consumer keeps or replays)."""
    ids: dict[tuple, int] = {}  # targets as ints: hashing placements per (a, b) pair was the cost here
    targets = [[ids.setdefault(t, len(ids)) for t in link.target] for link in links]
    cost: dict[int, dict[int, float]] = defaultdict(dict)  # producer group a -> target -> the largest price
    mem: dict[int, dict[int, float]] = defaultdict(dict)
    for link, target in zip(links, targets):
        for a, (cost_row, mem_row) in enumerate(zip(link.cost, link.mem)):
            mine_mem = dict(zip(target, mem_row))  # per link, the last group asking for a target counts
            most_cost, most_mem = cost[a], mem[a]
            for t, c in dict(zip(target, cost_row)).items():
                most_cost[t] = max(most_cost.get(t, 0.0), c)
                most_mem[t] = max(most_mem.get(t, 0.0), mine_mem[t])
    y: dict[int, dict[int, int]] = defaultdict(dict)  # producer group a -> target -> its column
    rows = model.rows
    for link, target in zip(links, targets):
        for a, row in enumerate(link.e):
            mine, most_cost, most_mem = y[a], cost[a], mem[a]
            for t in target:  # y columns made in the order the pairs first ask for them
                if t not in mine:
                    j = mine[t] = model.var(most_cost[t] * count, integer=False, term=term)
                    if most_mem[t]:
                        memory_row[j] = memory_row.get(j, 0.0) + most_mem[t] * count
            rows.extend([({mine[t]: 1.0, e_ab: -1.0}, 0.0, INF) for e_ab, t in zip(row, target)])


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
        e = model.var(0.0, integer=False, implied_integer=True)  # the sum of consumer columns below
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
                          add: Callable[[int, int, int], None], e: list[list[int]] | None) -> None:
    """The consumer takes the input exactly as produced: only equal placements are linked
    (with transport variables ``e`` already made for a shared reshard, the others are fixed to 0)."""
    keys_p, keys_c = list(groups_p), list(groups_c)
    if e is not None:
        for a, ka in enumerate(keys_p):
            for b, (placement, _active) in enumerate(keys_c):
                if ka != placement:
                    model.rows.append(({e[a][b]: 1.0}, 0.0, 0.0))
        return
    if _one_decision(edge, x):  # rule out the strategies that differ
        for s in range(len(x[edge.consumer])):
            a = next(i for i, k in enumerate(keys_p) if s in groups_p[k])
            b = next(i for i, k in enumerate(keys_c) if s in groups_c[k])
            if keys_p[a] != keys_c[b][0]:
                model.rows.append(({x[edge.consumer][s]: 1.0}, 0.0, 0.0))
            else:
                add(x[edge.consumer][s], a, b)
        return
    _add_follower_edge(model, edge, x, groups_p, groups_c, add)
