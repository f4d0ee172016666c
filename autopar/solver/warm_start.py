"""Which strategies each node most likely takes, for a plan HiGHS starts from.

HiGHS proves a plan optimal quickly once it holds a good one (reduced-cost fixing after the
root LP drops most strategy columns), but its own heuristics find one late, near the end of the
solve. ``run_started`` solves the MIP narrowed to each node's likeliest strategies first (a small
one) and starts the whole one from that plan (``benchmarks/solve_time.py`` measures both). The likeliest strategies come from the ILP's own prices, as pairs:

* each strategy column's price (its node's cost and every edge folded into it) plus, for
  each edge with transport columns, the price of the placement pair its two ends choose:
  the transport column, a shared reshard's column (counted on each edge that asks for it,
  an over-estimate) and the gradient syncs the pair starts (at full price, hidden or not).
  Overlap windows, bucket calls and the memory row are left to HiGHS;
* min-sum message passing over those pairs (exact on a tree; a block's graph has few
  cycles: residual adds) gives each node's belief per strategy; single-node moves from
  the least beliefs settle on one plan, and each node keeps it and its next likeliest.

The plan returned is still HiGHS's proven optimum of the whole MIP: this changes speed only.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from autopar.solver.milp import Model, Result, run


@dataclass
class Pair:
    """An edge with transport columns: the price of each placement pair its ends choose."""

    producer: str
    consumer: str
    group_p: dict[int, int]
    """Producer strategy -> its placement group at this edge."""
    group_c: dict[int, int]
    """Consumer strategy -> its group."""
    columns: dict[tuple[int, int], list[int]]
    """(producer group, consumer group) -> the columns its price is read from (a transport
    column, the gradient syncs it starts); a pair without an entry is ruled out."""


@dataclass
class PairTerms:
    """What the local search prices: filled while the ILP is built (``edge_links._add_edge``)."""

    strategy_columns: int
    """Columns below this are strategy choices (made first); the others are transport or auxiliary."""
    pairs: list[Pair] = field(default_factory=list)
    extra: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    """Transport column -> shared-reshard columns it forces to 1 (``edge_links._add_shared``)."""

    def add_edge(self, producer: str, consumer: str, groups_p: dict[object, list[int]],
                 groups_c: dict[object, list[int]], columns: dict[tuple[int, int], int],
                 syncs: dict[tuple[int, int], list[int]]) -> None:
        """An edge whose pairs (group a, group b) were given ``columns`` (strategy columns
        among them are priced on their own) and start the gradient syncs ``syncs``."""
        if producer == consumer:
            return
        priced = {ab: ([j] if j >= self.strategy_columns else []) + syncs.get(ab, []) for ab, j in columns.items()}
        if any(priced.values()):
            self.pairs.append(Pair(producer, consumer, _group_of(groups_p), _group_of(groups_c), priced))


def _group_of(groups: dict[object, list[int]]) -> dict[int, int]:
    return {s: i for i, members in enumerate(groups.values()) for s in members}


NARROW_KEEP = 4
"""Strategies per node the first, narrowed solve keeps (``run_started``)."""
NARROW_FROM_COLUMNS = 10_000
"""Models with fewer columns are solved at once: HiGHS finds their optimum in a fraction of
a second, and a narrowed solve first only adds to it (a memory search's many small solves)."""


def run_started(model: Model, x: dict[str, list[int]], likely: dict[str, list[int]], time_limit_s: float,
                 cutoff: float | None) -> Result:
    """HiGHS on ``model``, started from the best plan among each node's likeliest strategies
    (``warm_start``): that narrowed MIP is small and solves in a fraction of the whole one,
    and started from its plan HiGHS fixes most strategy columns after the root LP. The
    result is the whole model's optimum either way; large models gain most, HF-sized ones about
    break even (``benchmarks/solve_time.py``)."""
    began = time.perf_counter()
    ruled_out = [j for v, cols in x.items() for s, j in enumerate(cols) if s not in likely[v]]
    narrow = run(model, time_limit_s, cutoff, zero=ruled_out, lean=True) if ruled_out else None
    start = None
    if narrow is not None and narrow.values is not None:
        start = {j: round(narrow.values[j]) for cols in x.values() for j in cols}
    left = max(time_limit_s - (time.perf_counter() - began), 0.01 * time_limit_s)  # the limit is for both runs
    result = run(model, left, cutoff, start=start, lean=start is not None)  # unstarted, its heuristics find a plan
    return replace(result, time_limit_s=time_limit_s)


RULED_OUT = 1e15
"""The price of a pair no plan may choose (finite, so that messages stay comparable)."""


def likely_strategies(x: dict[str, list[int]], cost: list[float], terms: PairTerms, keep: int,
                      rounds: int = 30, sweeps: int = 50) -> dict[str, list[int]]:
    """Node -> its ``keep`` likeliest strategy indices: the one single-node moves settle on
    after min-sum message passing first, then the others by least belief (module docstring)."""
    unary = {v: np.array([cost[j] for j in cols]) for v, cols in x.items()}
    factors = [_matrix(p, cost, terms, len(x[p.producer]), len(x[p.consumer])) for p in terms.pairs]
    belief = _message_passing(unary, factors, rounds)
    choice = _descend(unary, factors, {v: int(np.argmin(b)) for v, b in belief.items()}, sweeps)
    return {v: [choice[v], *[int(s) for s in np.argsort(b, kind="stable") if s != choice[v]][:keep - 1]]
            for v, b in belief.items()}


Factor = tuple[str, str, "np.ndarray"]


def _matrix(p: Pair, cost: list[float], terms: PairTerms, n_p: int, n_c: int) -> Factor:
    """The pair's price by (producer strategy, consumer strategy)."""
    by_group = np.full((max(p.group_p.values()) + 1, max(p.group_c.values()) + 1), RULED_OUT)
    for (a, b), cols in p.columns.items():
        by_group[a, b] = sum(cost[c] + sum(cost[y] for y in terms.extra.get(c, ())) for c in cols)
    rows = np.array([p.group_p[s] for s in range(n_p)])
    columns = np.array([p.group_c[s] for s in range(n_c)])
    return p.producer, p.consumer, by_group[np.ix_(rows, columns)]


def _message_passing(unary: dict[str, np.ndarray], factors: list[Factor], rounds: int) -> dict[str, np.ndarray]:
    """Each node's belief (the least price of a plan with it at each strategy) after
    ``rounds`` of min-sum messages, or fewer once no message changes (a fixed point: more
    rounds would give the same): exact on a tree; a block's graph has few cycles."""
    to_p = [np.zeros(len(unary[a])) for a, _, _ in factors]  # factor -> its producer end
    to_c = [np.zeros(len(unary[b])) for _, b, _ in factors]
    for _ in range(rounds):
        belief = {v: u.copy() for v, u in unary.items()}
        for (a, b, _), mp, mc in zip(factors, to_p, to_c):
            belief[a] += mp
            belief[b] += mc
        changed = False
        for i, (a, b, m) in enumerate(factors):
            into_c = np.min(m + (belief[a] - to_p[i])[:, None], axis=0)
            into_p = np.min(m + (belief[b] - to_c[i])[None, :], axis=1)
            into_c, into_p = into_c - into_c.min(), into_p - into_p.min()
            changed = changed or not (np.array_equal(into_c, to_c[i]) and np.array_equal(into_p, to_p[i]))
            to_c[i], to_p[i] = into_c, into_p
        if not changed:
            break
    belief = {v: u.copy() for v, u in unary.items()}
    for (a, b, _), mp, mc in zip(factors, to_p, to_c):
        belief[a] += mp
        belief[b] += mc
    return belief


def _descend(unary: dict[str, np.ndarray], factors: list[Factor], choice: dict[str, int],
             sweeps: int) -> dict[str, int]:
    """Move one node at a time to its best strategy given its neighbours, until none moves."""
    around: dict[str, list[tuple[str, np.ndarray]]] = defaultdict(list)
    for a, b, m in factors:
        around[a].append((b, m))  # the node's strategies along rows
        around[b].append((a, m.T))
    for _ in range(sweeps):
        moved = False
        for v, u in unary.items():
            local = u + sum((m[:, choice[o]] for o, m in around[v]), np.zeros(len(u)))
            best = int(np.argmin(local))
            if local[best] < local[choice[v]] - 1e-9 * max(1.0, abs(local[choice[v]])):
                choice[v] = best
                moved = True
        if not moved:
            break
    return choice


def merge_tied(likely: dict[str, list[int]], tied: dict[str, str]) -> None:
    """Tied parts keep the same strategies in a narrowed start: each part every strategy any
    part of its class keeps."""
    parts: dict[str, list[str]] = defaultdict(list)
    for v, w in tied.items():
        parts[w].append(v)
    for w, vs in parts.items():
        merged = list(dict.fromkeys(s for p in (w, *vs) for s in likely[p]))
        for p in (w, *vs):
            likely[p] = merged
