"""The pipeline-depth level of the search: ``Pipeline(from_axis=...)`` leaves the number of pp ranks to
the planner, taken out of the mesh's first axis (``{"dp": 128, "tp": 8}`` becomes
``{"pp": k, "dp": 128 / k, "tp": 8}``).

Every divisor k of that axis's size is planned, as Alpa's inter-op pass plans submesh shapes: k = 1 is
the step without a pipeline (its memory search may run micro-batches, ZeRO, checkpointing, offload);
each k >= 2 is the pipeline search (``search.pipeline``) on the carved mesh. The fastest plan that fits
the memory limit wins, ties to the shallower depth, so every rank and run choose alike; the plan's notes
say what each depth gave or why it gave nothing.

The search runs in two rounds. First every depth is planned without the memory limit (the step's free
solve; each pipeline depth's stage plans at the counts its search picks): cheap, and in practice no plan
under the limit is faster. Then each depth is planned under the limit, bounded by the best plan found so
far: first the depths with a plan that fits already (nothing more to solve), then the other pipeline depths
together, a micro-batch count at a time, the count whose pipelines are fastest without the limit first, of
any depth (so the best plan any depth has found bounds the counts every other has left), then the
unpipelined step where its free plan does not fit: that plan holds every parameter's state on each rank, so
the memory it must save costs it more than a pipeline, whose ranks hold a stage's share, and planned last it
is bounded by their best. The order decides only how soon a depth is bounded: the plan is the fastest
that fits whichever comes first (of equally fast plans, which one can differ). A depth none of whose
pipelines fits solves its other counts' free stage plans as it starts, where the best plan that fits by
that time bounds them (``search.pipeline``). A pipeline depth whose plans without the limit are no
faster than the bound is not planned again, the stage plans' memory searches seek only what can beat it,
and the unpipelined step's memory search (where memory binds, most of the ILPs) stops at the scenarios
whose bounds cannot. With memory to spare the first round's plans fit and the second only prices them.
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
from autopar.search.memory import TIE, Bound, Pruned, free_plan
from autopar.search.pipeline import (Limited, Unlimited, end_limited, limited_pipeline, start_limited,
                                     unlimited_pipelines)
from autopar.search.planned import PlannedStep
from autopar.search.problem import Place, Problems
from autopar.units import fmt_bytes, fmt_time


def search_depths(problems: Problems, spec: Pipeline, mesh: Mesh, limit: float, cutoff_s: float = math.inf
                  ) -> PlannedStep | Pruned:
    """The fastest plan over the pipeline depths ``spec`` leaves open (module docstring), seeking only plans
    faster than ``cutoff_s`` (the caller's: another mesh layout's)."""
    began = time.perf_counter()
    found: dict[int, PlannedStep] = {}
    skipped: dict[int, str] = {}
    depths = spec.depths(mesh.axes)
    units = len(block_units(problems.at(Place(mesh=mesh)).graph)[0])  # what a pipeline can be cut into
    if units == 0:  # nothing repeats: no stage cut to search, the unpipelined plan as it is
        problems.account.record("depth", "pp>1", "pruned", None, "the model has no repeated blocks")
        return _unpipelined(problems, mesh, limit, depths, cutoff_s)
    free: dict[int, Unlimited | None] = {1: None}  # depth -> its pipelines without the limit (1: none)
    seconds, fits = free_plan(problems, Place(mesh=mesh), limit)
    order = {1: (not fits, not fits, seconds)}  # (no fit, the unpipelined step and no fit, seconds): see above
    if math.isinf(seconds):  # no plan even without the limit: the step itself is refused, its error said first
        at = _unpipelined(problems, mesh, limit, depths, cutoff_s)
        if isinstance(at, Pruned) and not isinstance(at.error, MemoryLimitError):
            return at
        _record(problems, 1, at, found, skipped)
        del free[1]
    fitting = seconds if fits else math.inf
    for depth, at in _unlimited(problems, spec, mesh, limit, units, skipped, min(fitting, cutoff_s)).items():
        if isinstance(at, Pruned):
            _record(problems, depth, at, found, skipped)
        else:
            free[depth], order[depth] = at, (at.none_fit, False, at.fastest_s)
    ordered = sorted(free, key=lambda k: (*order[k], k))  # the likeliest plans first: they bound the rest
    turns = {k: at for k in ordered if (at := free[k]) is not None and at.none_fit}
    for depth in ordered:
        if depth in turns:
            if depth == next(iter(turns)):
                _in_turns(problems, turns, depths, found, skipped, cutoff_s)
            continue
        unlimited = free[depth]
        cutoff = _cutoff(found, math.inf, cutoff_s)
        if unlimited is None:
            at = _unpipelined(problems, mesh, limit, depths, cutoff)
            if isinstance(at, Pruned) and not isinstance(at.error, MemoryLimitError):
                return at  # the step itself is refused: no depth plans it
        else:
            with problems.account.inside(_where(depth, depths)):
                at = limited_pipeline(problems, unlimited, cutoff)
        _record(problems, depth, at, found, skipped)
    if not found:
        faster = f" and predicts less than {fmt_time(cutoff_s)}" if math.isfinite(cutoff_s) else ""
        why = (f"no pipeline depth on {spec.from_axis}={mesh.axes[spec.from_axis]} gives a plan that fits{faster}: "
               f"{'; '.join(f'pp={k}: {skipped[k]}' for k in sorted(skipped)[:4])}")
        return Pruned(why, MemoryLimitError(why))
    depth = min(sorted(found), key=lambda k: found[k].plan.predicted.step_time_s)  # the shallowest of equals
    problems.account.record("depth", f"pp={depth}", "chosen", found[depth].plan.predicted.step_time_s)
    return _annotated(depth, found, skipped, time.perf_counter() - began)


def _unlimited(problems: Problems, spec: Pipeline, mesh: Mesh, limit: float, units: int, skipped: dict[int, str],
               fitting_s: float) -> dict[int, Unlimited | Pruned]:
    """Each pipeline depth's pipelines planned without the memory limit (the search's first round); a depth
    with more pp ranks than the model has units is not planned (``skipped`` says so). ``fitting_s``: the
    fastest plan that fits found so far (or the caller's cutoff); each depth seeks only pipelines faster, and
    bounds the next (a deeper depth loses ties, so an equal pipeline is not sought)."""
    depths, out = spec.depths(mesh.axes), {}
    for depth in depths[1:]:
        if depth > units:  # no stage would be left without a unit
            skipped[depth] = (f"more pp ranks than the {units} units a pipeline cuts this model into (the head, "
                              "the repeated blocks, the tail)")
            problems.account.record("depth", f"pp={depth}", "pruned", None, skipped[depth])
            continue
        with problems.account.inside(_where(depth, depths)):
            out[depth] = unlimited_pipelines(problems, *_at_depth(spec, mesh, depth), limit, fitting_s * (1 + 2 * TIE))
        if isinstance(out[depth], Unlimited):
            fitting_s = min(fitting_s, out[depth].fitting_s)
    return out


def _where(depth: int, depths: list[int]) -> str:
    return f"pp={depth} (depth {depths.index(depth) + 1} of {len(depths)})"


def _cutoff(found: dict[int, PlannedStep], fitting_s: float, cutoff_s: float) -> float:
    """What a depth's plans must beat: the best plan found (``found``'s, or ``fitting_s``), and the caller's
    ``cutoff_s``; an equal plan is still planned, so that the shallower depth wins ties."""
    fastest = min((s.plan.predicted.step_time_s for s in found.values()), default=fitting_s)
    return min(min(fastest, fitting_s) * (1 + 2 * TIE), cutoff_s)


def _in_turns(problems: Problems, turns: dict[int, Unlimited], depths: list[int], found: dict[int, PlannedStep],
              skipped: dict[int, str], cutoff_s: float) -> None:
    """The pipeline depths none of whose pipelines fits without the limit, planned under it together: of
    every depth's micro-batch counts left, the one whose free pipelines are fastest is planned next (a depth
    not started counts as its fastest free pipeline; ties to the depths' order), so that the best plan any
    depth has found bounds the counts every other has left (depth after depth, a depth's counts would be
    bounded only by the depths before it)."""
    started: dict[int, Limited] = {}
    waiting = list(turns)
    while waiting:
        depth = min(waiting, key=lambda k: (started[k].next_s if k in started else turns[k].fastest_s,
                                            waiting.index(k)))
        cutoff = _cutoff(found, min((s.fitting_s for s in started.values()), default=math.inf), cutoff_s)
        with problems.account.inside(_where(depth, depths)):
            at = started.get(depth) or start_limited(problems, turns[depth], cutoff)
            if isinstance(at, Pruned):
                _record(problems, depth, at, found, skipped)
                waiting.remove(depth)
                continue
            started[depth] = at
            if not at.done:
                at.step(cutoff)
        if at.done:
            waiting.remove(depth)
    for depth, at in started.items():
        with problems.account.inside(_where(depth, depths)):
            _record(problems, depth, end_limited(problems, at), found, skipped)


def _unpipelined(problems: Problems, mesh: Mesh, limit: float, depths: list[int], cutoff_s: float
                 ) -> PlannedStep | Pruned:
    """The step without a pipeline, its memory search seeking only plans faster than ``cutoff_s``."""
    with problems.account.inside(_where(1, depths)):
        return plan_on(problems, Place(mesh=mesh), limit, Bound(cutoff_s=cutoff_s))


def _record(problems: Problems, depth: int, at: PlannedStep | Pruned, found: dict[int, PlannedStep],
            skipped: dict[int, str]) -> None:
    if isinstance(at, PlannedStep):
        found[depth] = at
        problems.account.record("depth", f"pp={depth}", "planned", at.plan.predicted.step_time_s,
                                f"{at.plan.predicted.peak_memory_bytes / 2**30:,.2f} GiB")
    else:
        skipped[depth] = at.reason
        problems.account.record("depth", f"pp={depth}", "pruned", None, at.reason)


def _at_depth(spec: Pipeline, mesh: Mesh, depth: int) -> tuple[Pipeline, Mesh]:
    """The pipeline of ``depth`` pp ranks and its mesh, carved out of ``mesh``'s first axis."""
    return replace(spec, from_axis=None), Mesh(spec.carved(mesh.axes, depth), mesh.hardware, mesh.devices_per_node)


def _annotated(depth: int, found: dict[int, PlannedStep], skipped: dict[int, str], seconds: float) -> PlannedStep:
    """The chosen step, its plan saying what each depth gave."""
    plan = found[depth].plan
    each = "; ".join(f"pp={k} {fmt_time(found[k].plan.predicted.step_time_s)} "
                     f"({fmt_bytes(found[k].plan.predicted.peak_memory_bytes)})" for k in sorted(found))
    note = (f"pipeline depth search: {len(found) + len(skipped)} depths tried, chosen "
            f"{'no pipeline' if depth == 1 else f'pp={depth}'}; {each}"
            + "".join(f"; pp={k}: {skipped[k][:300]}" for k in sorted(skipped)[:3]))
    timings = {**plan.timings, "pipeline depth search": seconds}
    return replace(found[depth], plan=replace(plan, notes=[*plan.notes, note], timings=timings))
