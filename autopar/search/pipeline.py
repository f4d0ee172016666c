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
Those counts are solved in the second half (``limited_pipeline``), once the caller's best plan that fits
is known: a count whose stage plan's LP relaxation cannot beat it is not solved.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from autopar.errors import InputError, MemoryLimitError
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.search.memory import Pruned
from autopar.search.pipeline_limited import Counts, no_fit
from autopar.search.planned import PlannedStep
from autopar.search.problem import Problems
from autopar.search.stage_plans import PipelineSearch, Priced, StageMesh, label
from autopar.units import fmt_time as fmt_s


@dataclass(frozen=True)
class Unlimited:
    """A pipeline search's first half: its pipelines planned without the memory limit (every count's, when
    none fits), before any is planned under it (``limited_pipeline``)."""

    search: PipelineSearch
    free: dict[int, list[Priced]]
    how: str
    seconds: float
    """How long this half took (the plan's "pipeline search" timing adds the second's)."""
    none_fit: bool
    """No pipeline of the counts first solved fits the limit: every count's free plan is solved, then stage
    plans under the limit (``limited_pipeline``)."""

    @property
    def fastest_s(self) -> float:
        """The fastest pipeline without the limit: what the depth search orders depths by."""
        return min((f.step_time_s for plans in self.free.values() for f in plans), default=math.inf)

    @property
    def fitting_s(self) -> float:
        """The fastest of these pipelines that fits the limit: a plan the depth search has already."""
        return min((f.step_time_s for plans in self.free.values() for f in plans if f.peak_bytes <= self.search.limit),
                   default=math.inf)


def search_pipeline(problems: Problems, spec: Pipeline, mesh: Mesh, limit: float, cutoff_s: float = math.inf
                    ) -> PlannedStep | Pruned:
    """The fastest pipeline ``spec`` allows on ``mesh`` that fits ``limit`` (module docstring). ``cutoff_s``:
    the caller's best plan; pipelines are planned under the limit only where they may beat it."""
    unlimited = unlimited_pipelines(problems, spec, mesh, limit)
    return unlimited if isinstance(unlimited, Pruned) else limited_pipeline(problems, unlimited, cutoff_s)


def unlimited_pipelines(problems: Problems, spec: Pipeline, mesh: Mesh, limit: float, cutoff_s: float = math.inf
                        ) -> Unlimited | Pruned:
    """The pipelines ``spec`` allows on ``mesh`` planned without the memory limit: the stage plan solved at
    the counts ``PipelineSearch.free_plans`` chooses (where none of those fits ``limit``, the other counts
    are solved by ``limited_pipeline``). ``cutoff_s``: a plan that fits found elsewhere; no pipeline as slow
    is sought, and where every one is bounded or outrun so, none is found."""
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
    search = PipelineSearch(stage, choices, limit, cutoff_s)
    free, how = search.free_plans()
    if not any(free.values()) and (search.bounded or search.race.outrun):  # each slower than the cutoff
        return _outpaced(search, cutoff_s)
    none_fit = not any(f.peak_bytes <= limit for plans in free.values() for f in plans) and math.isfinite(limit)
    return Unlimited(search, {m: free[m] for m in search.counts if m in free}, how, time.perf_counter() - began,
                     none_fit)


def _every_count(unlimited: Unlimited, cutoff_s: float) -> Unlimited:
    """``unlimited`` with every micro-batch count's free stage plan solved (each bounds its count's plans
    under the limit), but for counts whose pipelines cannot beat ``cutoff_s``, the caller's best plan that
    fits: those are bounded out or not played out (``PipelineSearch.free_plan``), as no plan under the limit
    of theirs is faster either."""
    search, free = unlimited.search, dict(unlimited.free)
    search.race.best_s = min(search.race.best_s, cutoff_s)
    for m in search.counts:
        if m not in free:
            free[m] = search.solved(m)
    how = "every micro-batch count solved (no pipeline fits without the limit)" if unlimited.how else ""
    return replace(unlimited, free={m: free[m] for m in search.counts}, how=how)


def _outpaced(search: PipelineSearch, cutoff_s: float) -> Pruned:
    """A depth none of whose pipelines was priced: each was slower than ``cutoff_s``, a plan that fits found
    elsewhere (not played out, or its count's stage plan bounded out). Its free plans bound its plans under the
    limit, so none of those is sought either."""
    why = (f"no pipeline of it predicts less than {fmt_s(cutoff_s)}, the best plan found elsewhere "
           f"({len(search.bounded)} micro-batch counts bounded by their stage plans' LP relaxations, "
           f"{search.race.outrun} pipelines not played out)")
    return Pruned(why, MemoryLimitError(why), bounded=True)


@dataclass
class Limited:
    """A pipeline search's second half under way: its pipelines priced so far and the counts left to plan under
    the limit (``Counts``; none where a free pipeline fits)."""

    unlimited: Unlimited
    priced: list[Priced]
    counts: Counts | None
    seconds: float
    """Both halves' seconds so far."""

    @property
    def done(self) -> bool:
        return self.counts is None or self.counts.done

    @property
    def next_s(self) -> float:
        """The fastest free pipeline of the count ``step`` plans next (``Counts.next_s``)."""
        return math.inf if self.counts is None else self.counts.next_s

    @property
    def fitting_s(self) -> float:
        """The fastest pipeline that fits priced so far."""
        if self.counts is not None:  # it holds the free pipelines that fit too
            return self.counts.fitting_s
        return min((f.step_time_s for f in self.priced if f.peak_bytes <= self.unlimited.search.limit),
                   default=math.inf)

    def step(self, cutoff_s: float = math.inf) -> None:
        """Plan the next count under the limit (``Counts.step``), seeking only plans faster than ``cutoff_s``."""
        began = time.perf_counter()
        assert self.counts is not None
        self.counts.step(cutoff_s)
        self.seconds += time.perf_counter() - began


def limited_pipeline(problems: Problems, unlimited: Unlimited, cutoff_s: float = math.inf) -> PlannedStep | Pruned:
    """The fastest pipeline that fits the limit, from ``unlimited``'s plans and, where none of those fits,
    stage plans solved under the limit (``search.pipeline_limited``); none is sought where the plans without
    the limit are no faster than ``cutoff_s`` (the depth search has a plan as fast already)."""
    started = start_limited(problems, unlimited, cutoff_s)
    if isinstance(started, Pruned):
        return started
    while not started.done:
        started.step(cutoff_s)
    return end_limited(problems, started)


def start_limited(problems: Problems, unlimited: Unlimited, cutoff_s: float = math.inf) -> Limited | Pruned:
    """``limited_pipeline`` up to its counts planned under the limit (``Limited.step`` plans them): where no
    pipeline fits without the limit, every count's free stage plan solved; pruned where those cannot beat
    ``cutoff_s``."""
    began = time.perf_counter()
    if unlimited.none_fit:
        unlimited = _every_count(unlimited, cutoff_s)
    search, free = unlimited.search, unlimited.free
    priced = [f for plans in free.values() for f in plans]
    if not priced and (search.bounded or search.race.outrun):  # each slower than the cutoff
        return _outpaced(search, cutoff_s)
    counts = None
    if unlimited.none_fit:
        fastest = unlimited.fastest_s
        if priced and fastest >= cutoff_s:
            why = (f"its pipelines planned without the memory limit do not fit and are no faster ({fmt_s(fastest)}) "
                   f"than the best plan found ({fmt_s(cutoff_s)}): not planned under the limit")
            return Pruned(why, MemoryLimitError(why))
        counts = Counts(search, free)
    return Limited(unlimited, priced, counts, unlimited.seconds + time.perf_counter() - began)


def end_limited(problems: Problems, started: Limited) -> PlannedStep | Pruned:
    """The fastest pipeline that fits of those ``started`` priced, once its counts are planned."""
    search, how = started.unlimited.search, started.unlimited.how
    priced = [*started.priced, *(started.counts.out if started.counts else ())]
    fitting = [f for f in priced if f.peak_bytes <= search.limit]
    if not fitting:
        error = no_fit(priced, search.refused, search.unfit, search.limit, search.stage.spec)
        return Pruned(str(error), error)
    best = min(fitting, key=lambda f: f.step_time_s)  # min keeps the first of equals
    problems.account.record("pipeline", label(best.choice), "chosen", best.step_time_s, how)
    return _annotated(best, fitting, len(priced), search, started.seconds, how)


def _annotated(best: Priced, fitting: list[Priced], priced: int, search: PipelineSearch, seconds: float, how: str
               ) -> PlannedStep:
    """The chosen step, its plan saying what was searched and the runners-up."""
    plan, race = best.step.plan, search.race
    others = sorted((f for f in fitting if f is not best), key=lambda f: f.step_time_s)[:3]
    runners = "; ".join(f"{label(f.choice)} {fmt_s(f.step_time_s)}" for f in others)
    outrun = (f", {race.outrun} more not played out (their busiest rank's own work was slower than a pipeline "
              "that fits)") if race.outrun else ""
    if search.bounded:
        outrun += (f", m={', '.join(map(str, search.bounded))} bounded out (no stage plan of theirs is fast enough: "
                   "an LP relaxation's bound)")
    note = (f"pipeline search: {priced} pipelines priced (schedules x stages per rank x micro-batches){outrun}, "
            f"{len(fitting)} fit; chosen {label(best.choice)} {fmt_s(best.step_time_s)}"
            + (f"; next: {runners}" if runners else "") + (f"; {how}" if how else ""))
    notes = [*plan.notes, note] if priced + race.outrun > 1 or how or search.bounded else plan.notes  # pinned: nothing searched
    plan = replace(plan, notes=notes, memory_limit_bytes=race.limit,
                   timings={**plan.timings, "pipeline search": seconds})
    return replace(best.step, plan=plan)

