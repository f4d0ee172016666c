"""The pipeline-depth level of the search: ``Pipeline(from_axis=...)`` leaves the number of pp ranks to
the planner, taken out of the mesh's first axis (``{"dp": 128, "tp": 8}`` becomes
``{"pp": k, "dp": 128 / k, "tp": 8}``).

Every divisor k of that axis's size is planned, as Alpa's inter-op pass plans submesh shapes: k = 1 is
the step without a pipeline (its memory search may run micro-batches, ZeRO, checkpointing, offload);
each k >= 2 is the pipeline search (``search.pipeline``) on the carved mesh. The fastest plan that fits
the memory limit wins, ties to the shallower pipeline, so every rank and run choose alike; the plan's
notes say what each depth gave or why it gave nothing. Depths go shallow to deep, the unpipelined step
first; a depth whose pipelines planned without the limit neither fit nor beat the best plan found is
not planned again under the limit.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from autopar.errors import MemoryLimitError
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.pipeline.stages import block_units
from autopar.search.context import plan_on
from autopar.search.memory import Pruned
from autopar.search.pipeline import search_pipeline
from autopar.search.planned import PlannedStep
from autopar.search.problem import Place, Problems
from autopar.units import fmt_bytes, fmt_time


def search_depths(problems: Problems, spec: Pipeline, mesh: Mesh, limit: float) -> PlannedStep | Pruned:
    """The fastest plan over the pipeline depths ``spec`` leaves open (module docstring)."""
    began = time.perf_counter()
    found: list[tuple[int, PlannedStep]] = []
    skipped: list[str] = []
    units: int | None = None  # what a pipeline can be cut into, once some depth has planned the step
    depths = spec.depths(mesh.axes)
    for depth in depths:
        fastest = min((s.plan.predicted.step_time_s for _, s in found), default=math.inf)
        if found and units is None:
            units = len(block_units(found[0][1].graph)[0])
            if units == 0:  # nothing repeats: no stage cut to search, the unpipelined plan as it is
                problems.account.record("depth", "pp>1", "pruned", None, "the model has no repeated blocks")
                return found[0][1]
        if units is not None and depth > units:  # not planned: no stage would be left without a unit
            skipped.append(f"pp={depth}: more pp ranks than the {units} units a pipeline cuts this model into "
                           "(the head, the repeated blocks, the tail)")
            problems.account.record("depth", f"pp={depth}", "pruned", None, skipped[-1].split(": ", 1)[1])
            continue
        carved, pipeline = _at_depth(spec, mesh, depth)
        with problems.account.inside(f"pp={depth} (depth {depths.index(depth) + 1} of {len(depths)})"):
            at = plan_on(problems, Place(mesh=carved), limit) if pipeline is None else \
                search_pipeline(problems, pipeline, carved, limit, cutoff_s=fastest)
        if isinstance(at, PlannedStep):
            found.append((depth, at))
            problems.account.record("depth", f"pp={depth}", "planned", at.plan.predicted.step_time_s,
                                    f"{at.plan.predicted.peak_memory_bytes / 2**30:,.2f} GiB")
        elif depth == 1 and not isinstance(at.error, MemoryLimitError):
            return at  # the step itself is refused: no depth would plan it
        else:
            skipped.append(f"pp={depth}: {at.reason}")
            problems.account.record("depth", f"pp={depth}", "pruned", None, at.reason)
    if not found:
        why = (f"no pipeline depth on {spec.from_axis}={mesh.axes[spec.from_axis]} gives a plan that fits: "
               f"{'; '.join(skipped[:4])}")
        return Pruned(why, MemoryLimitError(why))
    depth, best = min(found, key=lambda f: f[1].plan.predicted.step_time_s)  # min keeps the shallowest of equals
    problems.account.record("depth", f"pp={depth}", "chosen", best.plan.predicted.step_time_s)
    return _annotated(depth, best, found, skipped, time.perf_counter() - began)


def _at_depth(spec: Pipeline, mesh: Mesh, depth: int) -> tuple[Mesh, Pipeline | None]:
    """The mesh and pipeline of ``depth`` pp ranks (depth 1: the mesh as given, no pipeline)."""
    if depth == 1:
        return mesh, None
    carved = Mesh(spec.carved(mesh.axes, depth), mesh.hardware, mesh.devices_per_node)
    return carved, replace(spec, from_axis=None)


def _annotated(depth: int, best: PlannedStep, found: list[tuple[int, PlannedStep]], skipped: list[str],
               seconds: float) -> PlannedStep:
    """The chosen step, its plan saying what each depth gave."""
    plan = best.plan
    each = "; ".join(f"pp={k} {fmt_time(s.plan.predicted.step_time_s)} "
                     f"({fmt_bytes(s.plan.predicted.peak_memory_bytes)})" for k, s in found)
    note = (f"pipeline depth search: {len(found) + len(skipped)} depths tried, chosen "
            f"{'no pipeline' if depth == 1 else f'pp={depth}'}; {each}"
            + "".join(f"; {why[:300]}" for why in skipped[:3]))
    timings = {**plan.timings, "pipeline depth search": seconds}
    return replace(best, plan=replace(plan, notes=[*plan.notes, note], timings=timings))

