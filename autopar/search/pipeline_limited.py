"""Pipelines under the memory limit, when no stage plan solved without it gives one that fits: stage
plans solved again under the limit, on the busiest pp rank's share of the memory row
(``pipeline.stage_memory.MemoryShares``), so that the memory search picks ZeRO-2/3 and checkpointing for
what a stage holds rather than for the whole model; and the error when nothing fits."""

from __future__ import annotations

import math

from autopar.errors import InputError, MemoryLimitError
from autopar.memory.scenarios import Scenario
from autopar.pipeline.spec import Pipeline
from autopar.search.memory import Bound, Pruned
from autopar.search.planned import PlannedStep
from autopar.search.stage_plans import PipelineSearch, Priced, StageMesh, label
from autopar.units import fmt_bytes

WORTH_A_SEARCH = 0.05
"""Another micro-batch count is planned under the limit only while its free pipelines are at least this
much faster than the best pipeline that fits: each such plan is a memory search of many ILPs."""


class Counts:
    """A pipeline search's micro-batch counts planned under the limit one at a time (``step``), counts whose
    free pipelines were fastest first, until the next count's free pipelines are not ``WORTH_A_SEARCH``
    faster than the best that fits, free or solved under the limit (a plan under the limit is priced no
    faster than its free one in practice). Stopping at the first count that fits would miss a finer count
    that needs no checkpointing. One count at a time, so that the depth search can take turns between
    depths (``search.depth``): each count is then bounded by the best plan any depth has found."""

    def __init__(self, search: PipelineSearch, free: dict[int, list[Priced]]) -> None:
        self.search, self.free = search, free
        self.waiting = sorted(free, key=self.fastest)  # sorted is stable: ties keep the choices' order
        self.out: list[Priced] = []
        self.fitting = [f for m in free for f in free[m] if f.peak_bytes <= search.limit]  # free, fitting already

    @property
    def done(self) -> bool:
        return not self.waiting

    def fastest(self, m: int) -> float:
        return min((f.step_time_s for f in self.free[m]), default=math.inf)

    @property
    def next_s(self) -> float:
        """The fastest free pipeline of the count ``step`` plans next."""
        return self.fastest(self.waiting[0]) if self.waiting else math.inf

    @property
    def fitting_s(self) -> float:
        """The fastest pipeline of these counts that fits so far."""
        return min((f.step_time_s for f in self.fitting), default=math.inf)

    def step(self, cutoff_s: float = math.inf) -> None:
        """The next count planned under the limit, where its free pipelines may still beat both the best that
        fits here by ``WORTH_A_SEARCH`` and ``cutoff_s`` (the caller's best plan so far: it bounds each stage
        plan as the race's best does); otherwise no count is planned any more (``done``)."""
        m = self.waiting.pop(0)
        if self.fastest(m) >= min((1 - WORTH_A_SEARCH) * self.fitting_s, cutoff_s):
            self.waiting.clear()  # this count, and every later one, cannot beat a pipeline that fits by enough
            return
        best = min(self.fitting, key=lambda f: f.step_time_s, default=None)  # min keeps the first of equals
        search = self.search
        step = _under_limit(search.stage, m, search.limit, search.unfit,
                            search.stage.ranks * min(search.race.best_s, cutoff_s),
                            None if best is None else best.step.scenario)
        if step is not None:
            priced = search.price(step, search.by_count[m])
            self.out += priced
            self.fitting += [f for f in priced if f.peak_bytes <= search.limit]


def _under_limit(stage: StageMesh, m: int, limit: float, unfit: list[str], cutoff_s: float,
                 hint: Scenario | None) -> PlannedStep | None:
    """The stage plan of m micro-batches solved under ``limit``; None, saying why in ``unfit``, when there is
    none. Only a stage plan predicting less than ``cutoff_s`` (p x the fastest pipeline that fits) is sought:
    a pipeline's busiest rank works at least the average of its p ranks' work, whose sum is the stage
    plan's step (``pipeline.stages.work_floor_s``), so a slower stage plan gives no faster pipeline.
    ``hint``: the memory scenario of that fastest pipeline, solved first."""
    step = stage.plan(m, limit, Bound(cutoff_s=cutoff_s, hint=hint))
    if isinstance(step, Pruned):
        if not isinstance(step.error, MemoryLimitError):
            raise step.error
        unfit.append(f"m={m}, the stage mesh's plan under the limit (the busiest rank's share): {step.reason}")
        return None
    return step


def no_fit(priced: list[Priced], refused: list[str], unfit: list[str], limit: float, spec: Pipeline) -> Exception:
    """The error when no pipeline fits: the leanest priced and its parts, or why none can be cut."""
    if not priced:
        return InputError(f"no pipeline of {spec} can be cut for this model: {'; '.join(refused[:3])}")
    least = min(priced, key=lambda f: f.peak_bytes)
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in least.step.plan.predicted.memory_parts.items())
    why = "".join(f"; {u}" for u in unfit[:2])  # the leanest priced is then a plan made without the limit
    return MemoryLimitError(f"no pipeline fits {fmt_bytes(limit)} per device: the leanest of {len(priced)} priced, "
                            f"{label(least.choice)}, needs {fmt_bytes(least.peak_bytes)} on its busiest rank "
                            f"({parts}){why}")
