"""The recompute peak in the ILP: the bytes a checkpointed block brings back while it replays its forward
(``memory.recompute``), as rows and variables of the placement ILP."""

from __future__ import annotations

from collections import defaultdict

from autopar.memory.recompute import freed_before_recompute
from autopar.problem.nodes import PlanGraph
from autopar.solver.milp import INF, MEMORY, Model

RECOMPUTE_UNIT = 2.0**20
"""Bytes per unit of the recompute-peak variables and rows (MiB, as the memory limit's row)."""


def add_recompute_peak(model: Model, graph: PlanGraph, reps: list[str], x: dict[str, list[int]],
                       mult: dict[str, int], memory_row: dict[int, float], minimize_memory: bool) -> None:
    """t >= the bytes each checkpointed block brings back while it recomputes; the memory
    row holds t once (one block recomputes at a time). Folded blocks share their first
    instance's variables, so its row stands for all of them. With only the first blocks
    checkpointed, the row holds s >= t - (bytes of the ops backward freed before, all
    instances), s >= 0 instead (``recompute_peak``)."""
    per_block: dict[str, dict[int, float]] = defaultdict(dict)
    for v in reps:
        node = graph.nodes[v]
        if node.block is not None and any(node.recompute_memory):
            for j, dropped in zip(x[v], node.recompute_memory):
                per_block[node.block][j] = dropped
    if not per_block:
        return
    freed = freed_before_recompute(graph)
    # t and s count MiB, their rows' bytes likewise: rows of raw bytes (10^9-10^10 at 128k tokens) beside the
    # strategies' 0/1 columns made HiGHS's presolve call feasible scenarios infeasible
    t = model.var(RECOMPUTE_UNIT if minimize_memory and not freed else 0.0, integer=False, upper=INF, term=MEMORY)
    for row in per_block.values():
        model.rows.append(({t: 1.0, **{j: -b / RECOMPUTE_UNIT for j, b in row.items()}}, 0.0, INF))
    if not freed:
        memory_row[t] = RECOMPUTE_UNIT
        return
    s = model.var(RECOMPUTE_UNIT if minimize_memory else 0.0, integer=False, upper=INF, term=MEMORY)
    memory_row[s] = RECOMPUTE_UNIT
    row = {s: 1.0, t: -1.0}
    for v in reps:
        if v in freed:
            for j, cost in zip(x[v], graph.nodes[v].costs):
                row[j] = row.get(j, 0.0) + mult[v] * cost.memory / RECOMPUTE_UNIT
    model.rows.append((row, 0.0, INF))
