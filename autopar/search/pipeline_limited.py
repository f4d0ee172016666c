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


def limited(search: PipelineSearch, free: dict[int, list[Priced]], cutoff_s: float = math.inf) -> list[Priced]:
    """Pipelines of stage plans solved under the limit: micro-batch counts whose free pipelines were
    fastest first, until the next count's free pipelines are not ``WORTH_A_SEARCH`` faster than the best
    that fits, free or solved under the limit (a plan under the limit is priced no faster than its free one
    in practice). Stopping at the first count that fits would miss a finer count that needs no
    checkpointing. ``cutoff_s``: the caller's best plan so far (a shallower depth's): a count whose free
    pipelines are no faster is not planned under the limit, and it bounds each stage plan as the race's
    best does."""
    def fastest(m: int) -> float:
        return min((f.step_time_s for f in free[m]), default=math.inf)
    out: list[Priced] = []
    limit, race = search.limit, search.race
    fitting = [f for m in free for f in free[m] if f.peak_bytes <= limit]  # free pipelines that fit already
    for m in sorted(free, key=fastest):  # sorted is stable: ties keep the choices' order
        fits = fitting + [f for f in out if f.peak_bytes <= limit]
        if fastest(m) >= min((1 - WORTH_A_SEARCH) * min((f.step_time_s for f in fits), default=math.inf), cutoff_s):
            break  # this count, and every later one, cannot beat a pipeline that fits by enough
        best = min(fits, key=lambda f: f.step_time_s, default=None)  # min keeps the first of equals
        step = _under_limit(search.stage, m, limit, search.unfit, search.stage.ranks * min(race.best_s, cutoff_s),
                            None if best is None else best.step.scenario)
        if step is not None:
            out += search.price(step, search.by_count[m])
    return out


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
