"""Choosing a pipeline: the schedule, stages per rank and micro-batch count a ``Pipeline``
leaves open, the cuts always (the inter-op search).

The intra-op ILP of one micro-batch is solved on the stage mesh at the first micro-batch count;
its stage plan is then priced at every other count without solving again, on one capture of the
step whose micro-batch size is a sympy symbol in every shape (``capture.symbolic``; ``step.repriced``
maps the plan's strategies onto that graph at the count's size, so the same cost functions price
each node's compute, collectives and memory there). The ILP is solved again only at the count whose
priced pipeline was fastest (the strategies the ILP picks may change with the size: Megatron-LM's
micro-batch size 1 favours other splits than 8) and at counts where some strategy of the first plan
does not apply (a split that no longer divides); a step export cannot keep symbolic (a guard on the
batch size, data-dependent sizes, higher-order subgraphs) has every count solved, as the plan's note
says. Every schedule and stages-per-rank choice at each solved m is then
cut (``pipeline.stages``: an exact linear-partition DP over the repeated blocks, the head and
tail joining the first and last stage) and priced by the same functions a pinned pipeline
is: the schedule's step with its bubble (``pipeline.spec``), point-to-point transfers,
gradient sync and optimizer step, and each pp rank's peak memory walked through torch's
order of actions (``pipeline.stage_memory``). The fastest pipeline whose busiest rank fits the
memory limit wins; ties go to the first priced (micro-batch counts in the order
``Pipeline.choices`` first names them, each count's choices in that order, those planned
again under the limit after), so every rank and run choose alike. A choice whose busiest
rank's own work (``pipeline.stages.work_floor_s``) is already slower than a pipeline that fits
is not played out: it cannot win (80 layers on 1024 devices: 12 of 23 left out).

The ILP is solved without a memory limit first. Only when none of those pipelines fits is every
count's free ILP solved (each bounds its count's plans under the limit), and stage plans solved again
under the limit (the m whose free pipelines were fastest
first, the next while its free pipelines beat the best that fits: ``_limited``), on the
busiest rank's share of its memory row (``MemoryShares``: 1F1B's first rank), so that its
memory search picks ZeRO-2/3 and activation checkpointing for what a stage holds rather than
for the whole model; ZeRO-1 and offload are never chosen (the pipelined runtime runs neither yet).
Once a pipeline fits, the next count's memory search seeks only stage plans faster than p x its
time (no slower stage plan gives a faster pipeline: ``_under_limit``) and solves the memory
scenario of the fastest fitting pipeline first (with the memory search's LP bounds, Llama-3-70B
on 512 H100s, pp=8, planned in 169 s where it took 305 s, the same plan).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from autopar.capture.symbolic import SymbolicRefused
from autopar.errors import InputError
from autopar.mesh import Mesh
from autopar.memory.scenarios import Scenario
from autopar.errors import MemoryLimitError
from autopar.pipeline.spec import Pipeline
from autopar.pipeline.stages import Outrun
from autopar.step import NotOffered, PlannedStep, with_pipeline
from autopar.units import fmt_bytes, fmt_time as fmt_s

Reprice = Callable[[PlannedStep, int], PlannedStep]
"""(a stage plan, micro-batch count m) -> its strategies priced for batch / m rows (``step.repriced``)."""


class StagePlanner(Protocol):
    """(micro-batch count, memory limit) -> the step planned on the stage mesh for one micro-batch;
    ``cutoff_s``, ``try_first``: as ``PreparedStep.cutoff_s`` and ``try_first``."""

    def __call__(self, m: int, memory_limit: float, cutoff_s: float = math.inf, try_first: Scenario | None = None
                 ) -> PlannedStep: ...


@dataclass(frozen=True, kw_only=True)
class _Priced:
    choice: Pipeline
    step: PlannedStep

    @property
    def step_time_s(self) -> float:
        return self.step.plan.predicted.step_time_s

    @property
    def peak_bytes(self) -> float:
        return self.step.plan.predicted.peak_memory_bytes


@dataclass(kw_only=True)
class _Race:
    """The fastest fitting pipeline's seconds so far: a pipeline whose busiest rank's own work
    is slower cannot win, and is not played out (``pipeline.stages.Outrun``). Strictly slower
    only, so ties still go to the first priced."""

    limit: float
    best_s: float = math.inf
    outrun: int = 0

    def saw(self, priced: _Priced) -> None:
        if priced.peak_bytes <= self.limit:
            self.best_s = min(self.best_s, priced.step_time_s)


WORTH_A_SEARCH = 0.05
"""Another micro-batch count is planned under the limit only while its free pipelines are at
least this much faster than the best pipeline that fits: each such plan is a memory search of
many ILPs (seconds on a 4-layer example, minutes at 70B scale), worth it for a clear gain only."""


class Outpaced(MemoryLimitError):
    """No pipeline planned without the memory limit fits, and none is faster than ``cutoff_s``:
    the stage plans are not solved again under the limit (``pipeline_depth``: another depth's
    plan is already faster)."""


def plan_pipelined(plan_stage: StagePlanner, spec: Pipeline, mesh: Mesh, batch: int | None,
                   memory_limit: float, batch_ways: int = 1, cutoff_s: float = math.inf,
                   reprice: Reprice | None = None) -> PlannedStep:
    """The fastest pipeline ``spec`` allows that fits ``memory_limit`` (module docstring);
    ``batch_ways``: how many ways the data axes split each micro-batch. ``cutoff_s``: when
    nothing planned without the limit fits and nothing so planned is faster than this, raise
    ``Outpaced`` rather than plan under the limit (a plan made under the limit has an ILP
    objective no lower than without it, so in practice it is priced no faster; the cuts may
    balance differently, so this is a bound in practice, not a proof)."""
    began = time.perf_counter()
    p = mesh.axes[spec.axis]
    finest = next(iter(spec.stage_mesh(mesh).axes.values()))  # rows of the finest count: the data axis's, first
    choices = spec.choices(p, batch, blocks=math.inf, batch_ways=batch_ways,  # type: ignore[arg-type]
                           finest_ways=finest)
    if not choices:
        split = f", each split {batch_ways} ways on the data axes" if batch_ways > 1 else ""
        raise InputError(f"no pipeline of {spec} runs on {spec.axis}={p} with a batch of {batch}: torch's schedules "
                         f"need micro_batches >= {p} stages, dividing the batch{split}")
    refused: list[str] = []
    unfit: list[str] = []  # why a micro-batch count planned under the limit gave no pipeline
    counts = list(dict.fromkeys(c.micro_batches for c in choices))
    by_count = {m: [c for c in choices if c.micro_batches == m] for m in counts}
    race = _Race(limit=memory_limit)

    def price(step: PlannedStep, m: int) -> list[_Priced]:
        return _price(step, by_count[m], mesh, spec.pinned, refused, race)
    free, how = _free_plans(plan_stage, price, reprice, by_count, mesh, memory_limit)
    priced = [f for m in counts if m in free for f in free[m]]
    if not any(f.peak_bytes <= memory_limit for f in priced) and math.isfinite(memory_limit):
        # every count's free pipelines bound its plans under the limit (``_limited``): each is solved
        free.update({m: price(plan_stage(m, math.inf), m) for m in counts if m not in free})
        priced = [f for m in counts for f in free[m]]
        how = "every micro-batch count solved (no pipeline fits without the limit)" if how else ""
        bound = min((f.step_time_s for f in priced), default=math.inf)
        if priced and bound >= cutoff_s:
            raise Outpaced(f"its pipelines planned without the memory limit do not fit and are no faster "
                           f"({fmt_s(bound)}) than the best plan found ({fmt_s(cutoff_s)}): "
                           "not planned under the limit")
        priced += _limited(plan_stage, free, choices, mesh, spec.pinned, race, refused, unfit)
    fitting = [f for f in priced if f.peak_bytes <= memory_limit]
    if not fitting:
        raise _no_fit(priced, refused, unfit, memory_limit, spec)
    best = min(fitting, key=lambda f: f.step_time_s)  # min keeps the first of equals
    return _annotated(best, fitting, len(priced), race, time.perf_counter() - began, how)


def _free_plans(plan_stage: StagePlanner, price: Callable[[PlannedStep, int], list[_Priced]],
                reprice: Reprice | None, by_count: dict[int, list[Pipeline]], mesh: Mesh, limit: float
                ) -> tuple[dict[int, list[_Priced]], str]:
    """Pipelines of stage plans solved without the memory limit, by micro-batch count, and how they were
    found. With ``reprice``, the ILP is solved at the first count; every other count's pipelines are
    priced with that stage plan's strategies at its micro-batch size (``_guesses``: no ILP), and the ILP
    solved again at the count whose priced pipeline was fastest (fitting ``limit`` first), since the ILP
    may pick other strategies at that size, and at each count the first plan cannot be priced at. Without
    ``reprice`` every count is solved, each its own ILP."""
    counts = list(by_count)
    if reprice is None or len(counts) == 1:
        return {m: price(plan_stage(m, math.inf), m) for m in counts}, ""
    first = plan_stage(counts[0], math.inf)
    free = {counts[0]: price(first, counts[0])}
    guesses, unpriced, why = _guesses(reprice, first, by_count, mesh, limit)
    fits = [g for g in guesses if g.peak_bytes <= limit] or guesses
    target = min(fits, key=lambda g: g.step_time_s).choice.micro_batches if fits else counts[0]
    for m in dict.fromkeys([target, *unpriced]):
        if m not in free:
            free[m] = price(plan_stage(m, math.inf), m)
    if why:
        return free, f"every micro-batch count solved (no symbolic capture: {why})"
    others = [m for m in counts[1:] if m not in unpriced]
    solved = f"the ILP solved at m={counts[0]}" + (f" and m={target} (its priced pipeline fastest)"
                                                   if target != counts[0] else "")
    apart = (f", m={', '.join(map(str, unpriced))} (the strategies do not all apply there: "
             f"{next(iter(unpriced.values()))})" if unpriced else "")
    if not others:
        return free, f"every micro-batch count solved (the m={counts[0]} stage plan priced at none{apart})"
    return free, (f"m={', '.join(map(str, others))} priced with the m={counts[0]} stage plan's strategies on one "
                  f"capture with a symbolic micro-batch; {solved}{apart}")


def _guesses(reprice: Reprice, first: PlannedStep, by_count: dict[int, list[Pipeline]], mesh: Mesh, limit: float
             ) -> tuple[list[_Priced], dict[int, str], str]:
    """``first``'s pipelines at its count and, repriced, at every other count; the counts it could not be
    priced at, and why; and why none could, where the step cannot be priced symbolic. They race among
    themselves (they choose a count to solve, not the plan). The symbolic capture is made at the second
    count, the largest micro-batch after the first's (export specializes a size of 1, and a capture of two
    rows or more prices one row as a capture there would: tests/test_symbolic_capture.py)."""
    counts = list(by_count)
    own = _Race(limit=limit)
    out = _price(first, by_count[counts[0]], mesh, False, [], own)
    unpriced: dict[int, str] = {}
    for m in counts[1:]:
        try:
            out += _price(reprice(first, m), by_count[m], mesh, False, [], own)
        except NotOffered as exc:
            unpriced[m] = str(exc)
        except (SymbolicRefused, InputError) as exc:  # InputError: the symbolic graph failed where the plan did not
            return out, dict.fromkeys(counts[1:], ""), str(exc)
    return out, unpriced, ""


def _limited(plan_stage: StagePlanner, free: dict[int, list[_Priced]], choices: list[Pipeline], mesh: Mesh,
             pinned: bool, race: _Race, refused: list[str], unfit: list[str]) -> list[_Priced]:
    """Pipelines of stage plans solved under ``limit``, when no free one fits: micro-batch counts
    whose free pipelines were fastest first, until the next count's free pipelines are not
    ``WORTH_A_SEARCH`` faster than the best that fits (a plan under the limit is priced no faster
    than its free one in practice: ``plan_pipelined``'s cutoff). Each such solve is a memory search of many ILPs (on
    the example Llama's 4 layers, 20 s); stopping at the first count that fits missed the
    finest count on Llama-3-70B/512 H100s (m=16 with full checkpointing, 11.2 s, where m=128
    needs none: 9.9 s; ``benchmarks/hand_plan_grid.py``)."""
    def fastest(m: int) -> float:
        return min((f.step_time_s for f in free[m]), default=math.inf)
    out: list[_Priced] = []
    limit = race.limit
    for m in sorted(free, key=fastest):  # sorted is stable: ties keep the choices' order
        fits = [f for f in out if f.peak_bytes <= limit]
        if fastest(m) >= (1 - WORTH_A_SEARCH) * min((f.step_time_s for f in fits), default=math.inf):
            break  # this count, and every later one, cannot beat a pipeline that fits by enough
        best = min(fits, key=lambda f: f.step_time_s, default=None)  # min keeps the first of equals
        limited = _under_limit(plan_stage, m, limit, unfit, mesh.axes[choices[0].axis] * race.best_s,
                               None if best is None else best.step.scenario)
        if limited is not None:
            out += _price(limited, [c for c in choices if c.micro_batches == m], mesh, pinned, refused, race)
    return out


def _under_limit(plan_stage: StagePlanner, m: int, limit: float, unfit: list[str], cutoff_s: float,
                 try_first: Scenario | None) -> PlannedStep | None:
    """The stage plan of m micro-batches solved under ``limit`` (on the busiest rank's share of
    its memory row, never offloading or sharding optimizer state alone: ``prepare_step``'s
    ``_pipeline_ranks``); None, saying why in ``unfit``, when there is none. Only a stage plan
    predicting less than ``cutoff_s`` (p x the fastest pipeline that fits) is sought: a pipeline's
    busiest rank works at least the average of its p ranks' work, whose sum is the stage plan's
    step (every micro-batch's forward and backward of every stage, every gradient bucket and
    update: ``pipeline.stages.work_floor_s``), so a slower stage plan gives no faster pipeline.
    ``try_first``: the memory scenario of that fastest pipeline, solved first."""
    try:
        return plan_stage(m, limit, cutoff_s=cutoff_s, try_first=try_first)
    except MemoryLimitError as exc:
        unfit.append(f"m={m}, the stage mesh's plan under the limit (the busiest rank's share): {exc}")
        return None


def _price(step: PlannedStep, choices: list[Pipeline], mesh: Mesh, pinned: bool, refused: list[str], race: _Race
           ) -> list[_Priced]:
    """Each choice cut and priced on ``step``, but for those ``race`` rules out; one the model
    cannot be cut for is noted (raised when pinned)."""
    out = []
    for choice in choices:
        try:
            out.append(_Priced(choice=choice, step=with_pipeline(step, choice, mesh, race.best_s)))
            race.saw(out[-1])
        except Outrun:
            race.outrun += 1
        except InputError as exc:
            if pinned:
                raise
            refused.append(f"{_label(choice)}: {exc}")
    return out


def _label(choice: Pipeline) -> str:
    return f"{choice.schedule} x{choice.virtual_stages} m={choice.micro_batches}"


def _no_fit(priced: list[_Priced], refused: list[str], unfit: list[str], limit: float, spec: Pipeline
            ) -> InputError:
    if not priced:
        return InputError(f"no pipeline of {spec} can be cut for this model: {'; '.join(refused[:3])}")
    least = min(priced, key=lambda f: f.peak_bytes)
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in least.step.plan.predicted.memory_parts.items())
    why = "".join(f"; {u}" for u in unfit[:2])  # the leanest priced is then a plan made without the limit
    return MemoryLimitError(f"no pipeline fits {fmt_bytes(limit)} per device: the leanest of {len(priced)} priced, "
                            f"{_label(least.choice)}, needs {fmt_bytes(least.peak_bytes)} on its busiest rank "
                            f"({parts}){why}")


def _annotated(best: _Priced, fitting: list[_Priced], priced: int, race: _Race, seconds: float, how: str
               ) -> PlannedStep:
    """The chosen step, its plan saying what was searched and the runners-up."""
    plan = best.step.plan
    others = sorted((f for f in fitting if f is not best), key=lambda f: f.step_time_s)[:3]
    runners = "; ".join(f"{_label(f.choice)} {fmt_s(f.step_time_s)}" for f in others)
    outrun = (f", {race.outrun} more not played out (their busiest rank's own work was slower than a pipeline "
              "that fits)") if race.outrun else ""
    note = (f"pipeline search: {priced} pipelines priced (schedules x stages per rank x micro-batches){outrun}, "
            f"{len(fitting)} fit; chosen {_label(best.choice)} {fmt_s(best.step_time_s)}"
            + (f"; next: {runners}" if runners else "") + (f"; {how}" if how else ""))
    notes = [*plan.notes, note] if priced + race.outrun > 1 or how else plan.notes  # pinned: nothing searched
    plan = replace(plan, notes=notes, memory_limit_bytes=race.limit,
                   timings={**plan.timings, "pipeline search": seconds})
    return replace(best.step, plan=plan)
