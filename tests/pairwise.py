"""Small placement-shaped MIPs: nodes choosing one of 6 strategies, edges priced through transport columns
as the placement ILP builds them, and optionally a memory row (for ``solver.warm_start`` and
``solver.branching``)."""

from __future__ import annotations

import random

from autopar.solver.milp import INF, RESHARDS, Model


def pairwise(seed: int, nodes: int, edges: list[tuple[int, int]], knapsack: bool
             ) -> tuple[Model, dict[str, list[int]]]:
    """Nodes choosing one of 6 strategies (2 placement groups per edge end) and edges priced by the
    pair of groups their ends choose, through transport columns as the placement ILP builds them; with
    ``knapsack``, one row bounds a random weight of the strategies chosen (the memory row, ``Model.knapsack``)."""
    rng = random.Random(seed)
    model = Model()
    x: dict[str, list[int]] = {}
    for v in range(nodes):
        x[f"n{v}"] = [model.var(rng.uniform(0, 10), integer=True, term=RESHARDS) for _ in range(6)]
        model.rows.append(({j: 1.0 for j in x[f"n{v}"]}, 1.0, 1.0))
    for u, v in edges:
        groups_u = [[0, 1, 2], [3, 4, 5]] if rng.random() < 0.5 else [[0, 2, 4], [1, 3, 5]]
        groups_v = [[0, 2, 4], [1, 3, 5]] if rng.random() < 0.5 else [[0, 1, 2], [3, 4, 5]]
        e = [[model.var(rng.uniform(0, 20), integer=False, term=RESHARDS, implied_integer=True) for _ in range(2)]
             for _ in range(2)]
        for a, group in enumerate(groups_u):
            model.rows.append(({**{e[a][b]: 1.0 for b in range(2)}, **{x[f"n{u}"][s]: -1.0 for s in group}}, 0.0, 0.0))
        for b, group in enumerate(groups_v):
            model.rows.append(({**{e[a][b]: 1.0 for a in range(2)}, **{x[f"n{v}"][s]: -1.0 for s in group}}, 0.0, 0.0))
    if knapsack:
        weights = {j: rng.uniform(1, 5) for cols in x.values() for j in cols}
        cheapest = sum(min(weights[j] for j in cols) for cols in x.values())
        model.knapsack = len(model.rows)
        model.rows.append((weights, -INF, cheapest * 1.3))
    return model, x


def cycle(n: int) -> list[tuple[int, int]]:
    """A ring of n nodes with chords: cycles leave the pairwise LP fractional."""
    return [(v, (v + 1) % n) for v in range(n)] + [(v, (v + 3) % n) for v in range(0, n, 2)]
