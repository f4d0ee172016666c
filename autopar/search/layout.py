"""The mesh-layout level of the search: a mesh of N devices whose axes are left open (``Mesh(devices=N)``)
is laid out by the planner, as Alpa's inter-op pass chooses submesh shapes.

Every layout the cost model ranks is planned: one "dp" axis of all devices, and "dp" x "tp" with the inner
"tp" axis inside a node, one for each divisor of the node's devices that divides N (8 devices to a node:
tp = 2, 4, 8; a "tp" of all N devices is the one axis again, what each axis does being the ILP's). The ILP decides what each axis carries (batch, weights, sequence); on each layout the
pipeline depth is searched out of "dp" as by default (``search.depth``), so pp, dp and tp all come out of
the N devices. The fastest plan that fits the memory limit wins, ties to the layout listed first (fewer
tp ranks), so every rank and run choose alike; the plan's notes say what each layout gave or why it gave
nothing. Each layout is planned bounded by the fastest plan of those before it: where memory binds, the
memory searches below stop at what cannot beat it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from autopar.config import settled
from autopar.errors import MemoryLimitError
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.search.memory import TIE, Pruned
from autopar.search.planned import PlannedStep
from autopar.search.problem import Problems
from autopar.units import fmt_bytes, fmt_time

Route = Callable[[Problems, Pipeline | None, Mesh, float, float], PlannedStep | Pruned]
"""How the planner plans a laid-out mesh (``planner``'s levels below this one), seeking only plans faster
than its last argument (seconds)."""


def layouts(mesh: Mesh) -> list[Mesh]:
    """The layouts of an open mesh's devices the search plans, in the order it plans them."""
    n, node = mesh.size, mesh.devices_per_node
    inner = [t for t in range(2, math.gcd(n, node) + 1) if math.gcd(n, node) % t == 0 and t < n]
    return [mesh.laid_out({"dp": n}), *(mesh.laid_out({"dp": n // t, "tp": t}) for t in inner)]


def search_layouts(problems: Problems, route: Route, mesh: Mesh, limit: float) -> PlannedStep | Pruned:
    """The fastest plan over ``mesh``'s layouts (module docstring); ``route`` plans one layout."""
    began = time.perf_counter()
    found: list[tuple[Mesh, PlannedStep]] = []
    skipped: list[str] = []
    every = layouts(mesh)
    for index, layout in enumerate(every):
        config, unpipelined = settled(problems.config, layout)
        if unpipelined:
            problems.account.record("depth", f"{layout.describe()}: pipelines", "not searched", None, unpipelined)
        with problems.account.inside(f"{layout.describe()} (layout {index + 1} of {len(every)})"):
            fastest = min((s.plan.predicted.step_time_s for _, s in found), default=math.inf)
            # an equal plan still planned: the layout listed first wins the tie
            at = route(problems, config.pipeline, layout, limit, fastest * (1 + 2 * TIE))
        if isinstance(at, PlannedStep):
            found.append((layout, at))
            problems.account.record("layout", layout.describe(), "planned", at.plan.predicted.step_time_s,
                                    fmt_bytes(at.plan.predicted.peak_memory_bytes))
        elif not isinstance(at.error, MemoryLimitError) and not found and index == 0:
            return at  # the step itself is refused (on one axis of every device): no layout would plan it
        else:
            skipped.append(f"{layout.describe()}: {at.reason}")
            problems.account.record("layout", layout.describe(), "pruned", None, at.reason)
    if not found:
        why = f"no layout of {mesh.size} devices gives a plan that fits: {'; '.join(skipped[:4])}"
        return Pruned(why, MemoryLimitError(why))
    layout, best = min(found, key=lambda f: f[1].plan.predicted.step_time_s)  # min keeps the first of equals
    problems.account.record("layout", layout.describe(), "chosen", best.plan.predicted.step_time_s)
    each = "; ".join(f"{m.describe()} {fmt_time(s.plan.predicted.step_time_s)} "
                     f"({fmt_bytes(s.plan.predicted.peak_memory_bytes)})" for m, s in found)
    note = (f"mesh layout search: {len(every)} layouts of {mesh.size} devices tried, chosen {layout.describe()}; "
            f"{each}" + "".join(f"; {why[:300]}" for why in skipped[:3]))
    plan = best.plan
    timings = {**plan.timings, "mesh layout search": time.perf_counter() - began}
    return replace(best, plan=replace(plan, notes=[*plan.notes, note], timings=timings))
