"""The backward working set in the ILP: one variable b >= every distinct op's transient row
(``memory.backward``: its backward's gradients and temporaries, less the parameter gradients not
yet made when it runs), held once in the memory row, as the recompute peak is (``recompute_rows``)."""

from __future__ import annotations

from autopar.cost.model import CostContext
from autopar.memory.backward import transient_rows
from autopar.problem.folding import Folding
from autopar.problem.nodes import PlanGraph
from autopar.solver.milp import INF, MEMORY, Model

BACKWARD_UNIT = 2.0**20
"""Bytes per unit of the variable and its rows: MiB, as the memory row's (raw bytes beside 0/1
columns upset HiGHS's presolve, ``recompute_rows.RECOMPUTE_UNIT``)."""


def add_backward_peak(model: Model, graph: PlanGraph, folding: Folding, ctx: CostContext,
                      x: dict[str, list[int]], memory_row: dict[int, float], minimize_memory: bool) -> None:
    """b >= each row of ``transient_rows`` at the chosen strategies, b >= 0; the memory row holds b
    once (backward runs one op at a time). The plan's peak reads the same rows (``backward_peak``)."""
    rows = transient_rows(graph, folding, ctx)
    if not rows:
        return
    b = model.var(BACKWARD_UNIT if minimize_memory else 0.0, integer=False, upper=INF, term=MEMORY)
    for row in rows:
        coefficients = {b: 1.0}
        for j, held in zip(x[row.node], row.held):
            coefficients[j] = coefficients.get(j, 0.0) - held / BACKWARD_UNIT
        for param, grads in row.absent.items():
            for j, grad in zip(x[param], grads):
                coefficients[j] = coefficients.get(j, 0.0) + grad / BACKWARD_UNIT
        model.rows.append(({j: c for j, c in coefficients.items() if c}, 0.0, INF))
    memory_row[b] = BACKWARD_UNIT
