"""The pipeline level of the search: the schedule, stages per rank and micro-batch count a ``Pipeline``
leaves open, and the cuts always (the inter-op search).

The intra-op ILP of one micro-batch is solved on the stage mesh at the first micro-batch count; its
stage plan is then priced at every other count without solving again, on one capture of the step whose
micro-batch size is a symbol in every shape (``capture.symbolic``; ``search.planned.repriced``). The ILP
is solved again only at the count whose priced pipeline was fastest (the ILP may pick other splits at
that size) and at counts where some strategy of the first plan does not apply; a step export cannot keep
symbolic has every count solved, as the plan's note says. Every schedule and stages-per-rank choice at
each solved count is cut (``pipeline.stages``: a linear-partition DP over the units) and priced by the
functions a pinned pipeline is priced by. The fastest pipeline whose busiest rank fits the memory limit
wins; ties go to the first priced, so every rank and run choose alike. A choice whose busiest rank's own
work is already slower than a pipeline that fits is not played out (``Uncut(outrun=True)``).

Only when no pipeline planned without the limit fits is every count's free ILP solved (each bounds its
count's plans under the limit) and stage plans solved again under the limit (``search.pipeline_limited``).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

from autopar.errors import InputError, MemoryLimitError
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.search.memory import Pruned
from autopar.search.pipeline_limited import limited, no_fit
from autopar.search.planned import PlannedStep
from autopar.search.problem import Problems
from autopar.search.stage_plans import PipelineSearch, Priced, Race, StageMesh, label
from autopar.units import fmt_time as fmt_s


def search_pipeline(problems: Problems, spec: Pipeline, mesh: Mesh, limit: float, cutoff_s: float = math.inf
                    ) -> PlannedStep | Pruned:
    """The fastest pipeline ``spec`` allows on ``mesh`` that fits ``limit`` (module docstring). ``cutoff_s``:
    when nothing planned without the limit fits and nothing so planned is faster than this, it is not
    planned under the limit (the depth search has a faster plan already)."""
    began = time.perf_counter()
    stage = StageMesh(problems, spec, mesh)
    batch, ways = problems.step.batch, math.prod(mesh.axes.get(a, 1) for a in problems.config.axes.data)
    finest = next(iter(spec.stage_mesh(mesh).axes.values()))  # rows of the finest count: the data axis's, first
    if spec.micro_batches is None and batch is None:
        why = ("the planner chooses a pipeline's micro-batches among divisors of the batch, but the step's inputs "
               "have no batch dim it can read: pin Pipeline(micro_batches=...)")
        return Pruned(why, InputError(why))
    choices = spec.choices(stage.ranks, batch, blocks=math.inf, batch_ways=ways, finest_ways=finest)  # type: ignore
    if not choices:
        split = f", each split {ways} ways on the data axes" if ways > 1 else ""
        why = (f"no pipeline of {spec} runs on {spec.axis}={stage.ranks} with a batch of {batch}: torch's schedules "
               f"need micro_batches >= {stage.ranks} stages, dividing the batch{split}")
        return Pruned(why, InputError(why))
    search = PipelineSearch(stage, choices, limit)
    free, how = search.free_plans()
    priced = [f for m in search.counts if m in free for f in free[m]]
    if not any(f.peak_bytes <= limit for f in priced) and math.isfinite(limit):
        for m in search.counts:  # every count's free pipelines bound its plans under the limit
            if m not in free:
                free[m] = search.solved(m)
        priced = [f for m in search.counts for f in free[m]]
        how = "every micro-batch count solved (no pipeline fits without the limit)" if how else ""
        fastest = min((f.step_time_s for f in priced), default=math.inf)
        if priced and fastest >= cutoff_s:
            why = (f"its pipelines planned without the memory limit do not fit and are no faster ({fmt_s(fastest)}) "
                   f"than the best plan found ({fmt_s(cutoff_s)}): not planned under the limit")
            return Pruned(why, MemoryLimitError(why))
        priced += limited(search, free)
    fitting = [f for f in priced if f.peak_bytes <= limit]
    if not fitting:
        error = no_fit(priced, search.refused, search.unfit, limit, spec)
        return Pruned(str(error), error)
    best = min(fitting, key=lambda f: f.step_time_s)  # min keeps the first of equals
    problems.account.record("pipeline", label(best.choice), "chosen", best.step_time_s, how)
    return _annotated(best, fitting, len(priced), search.race, time.perf_counter() - began, how)


def _annotated(best: Priced, fitting: list[Priced], priced: int, race: Race, seconds: float, how: str
               ) -> PlannedStep:
    """The chosen step, its plan saying what was searched and the runners-up."""
    plan = best.step.plan
    others = sorted((f for f in fitting if f is not best), key=lambda f: f.step_time_s)[:3]
    runners = "; ".join(f"{label(f.choice)} {fmt_s(f.step_time_s)}" for f in others)
    outrun = (f", {race.outrun} more not played out (their busiest rank's own work was slower than a pipeline "
              "that fits)") if race.outrun else ""
    note = (f"pipeline search: {priced} pipelines priced (schedules x stages per rank x micro-batches){outrun}, "
            f"{len(fitting)} fit; chosen {label(best.choice)} {fmt_s(best.step_time_s)}"
            + (f"; next: {runners}" if runners else "") + (f"; {how}" if how else ""))
    notes = [*plan.notes, note] if priced + race.outrun > 1 or how else plan.notes  # pinned: nothing searched
    plan = replace(plan, notes=notes, memory_limit_bytes=race.limit,
                   timings={**plan.timings, "pipeline search": seconds})
    return replace(best.step, plan=plan)

