"""Stage plans of a pipeline: the step planned on the stage mesh for one micro-batch (``StageMesh``),
cut and priced as a pinned pipeline (``Priced``), and the race that leaves out pipelines that cannot win."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.search.context import search_context
from autopar.search.memory import TIE, Bound, Pruned
from autopar.pipeline.stages import Uncut
from autopar.search.planned import PlannedStep, StepPipelines, Unpriced, finish, repriced_solution
from autopar.search.problem import Place, Problems


@dataclass(frozen=True, kw_only=True)
class Priced:
    """One pinned pipeline, cut and priced on a stage plan."""

    choice: Pipeline
    step: PlannedStep

    @property
    def step_time_s(self) -> float:
        return self.step.plan.predicted.step_time_s

    @property
    def peak_bytes(self) -> float:
        return self.step.plan.predicted.peak_memory_bytes


@dataclass(kw_only=True)
class Race:
    """The fastest fitting pipeline's seconds so far: a pipeline whose busiest rank's own work is slower
    cannot win, and is not played out. Strictly slower only, so ties still go to the first priced."""

    limit: float
    best_s: float = math.inf
    outrun: int = 0

    def saw(self, priced: Priced) -> None:
        if priced.peak_bytes <= self.limit:
            self.best_s = min(self.best_s, priced.step_time_s)


@dataclass
class StageMesh:
    """Planning a pipeline's stage mesh: the step for one micro-batch of m, on the mesh without the
    pipeline axis, its memory row the busiest pp rank's share; and pricing a plan at other counts."""

    problems: Problems
    spec: Pipeline
    mesh: Mesh
    """The whole mesh, the pipeline axis included."""

    @property
    def ranks(self) -> int:
        return self.mesh.axes[self.spec.axis]

    def place(self, m: int, symbolic: bool = False) -> Place:
        return Place(mesh=self.spec.stage_mesh(self.mesh), micro_batches=m, pipeline_ranks=self.ranks,
                     symbolic=symbolic)

    def plan(self, m: int, limit: float, bound: Bound = Bound()) -> PlannedStep | Pruned:
        """The stage plan of m micro-batches, the fastest within ``limit`` (``search.context``)."""
        within = "" if math.isinf(limit) else " within the limit"
        with self.problems.account.inside(f"stage plan of m={m}{within}"):
            found = search_context(self.problems, self.place(m), limit, bound)
        return found if isinstance(found, Pruned) else finish(found.problem, found.solution)

    def reprice(self, step: PlannedStep, m: int, limit: float, beat_s: float = math.inf
                ) -> PlannedStep | Unpriced | float:
        """``step``'s strategies priced for micro-batches of batch / m rows, on the symbolic capture; or why not;
        or, where no pipeline of that plan can take ``beat_s`` or less, its step's seconds alone (not made a
        plan): a pipeline's busiest rank works at least the average of its p ranks' work, whose sum is the
        stage plan's step (``pipeline.stages.work_floor_s``), so each of its pipelines would be outrun."""
        place = replace(self.place(m, symbolic=True), mesh=step.ctx.mesh)  # the layout the plan was solved on
        refused = self.problems.refused_symbolic(place)
        if refused:
            return Unpriced(refused, whole=True)
        assert step.scenario is not None
        problem = self.problems.under(place, replace(step.scenario, micro_batches=m), limit)
        solution = repriced_solution(problem, step)
        if isinstance(solution, Unpriced):
            return solution
        seconds = sum(solution.terms.values())  # the plan's predicted step (``result.build``)
        return seconds if seconds > beat_s * self.ranks * (1 + 2 * TIE) else finish(problem, solution)


def label(choice: Pipeline) -> str:
    return f"{choice.schedule} x{choice.virtual_stages} m={choice.micro_batches}"


class PipelineSearch:
    """One pipeline search's state: the choices by count, the race, what was refused or did not fit."""

    def __init__(self, stage: StageMesh, choices: list[Pipeline], limit: float, cutoff_s: float = math.inf) -> None:
        """``cutoff_s``: the seconds of a plan that fits found elsewhere (another depth's): no pipeline as slow
        is played out or has its stage plan solved."""
        self.stage, self.choices, self.limit = stage, choices, limit
        self.counts = list(dict.fromkeys(c.micro_batches for c in choices))
        self.by_count = {m: [c for c in choices if c.micro_batches == m] for m in self.counts}
        self.race = Race(limit=limit, best_s=cutoff_s)
        self.refused: list[str] = []
        self.unfit: list[str] = []  # why a micro-batch count planned under the limit gave no pipeline
        self.bounded: list[int] = []
        """Counts whose stage plan was not solved: no pipeline of theirs can beat the race's best."""
        self.known: dict[int, float] = {}
        """Count -> the step of a stage plan priced there (a guess's): its free optimum is no slower."""

    def price(self, step: PlannedStep, choices: list[Pipeline], race: Race | None = None,
              refused: list[str] | None = None) -> list[Priced]:
        """Each choice cut and priced on ``step``, but for those the race rules out; one the model cannot
        be cut for is noted in ``refused``."""
        counted = race is None  # the search's own pricing (not a guess that picks a count to solve)
        race = self.race if race is None else race
        refused = self.refused if refused is None else refused
        account = self.stage.problems.account
        out, pipelines = [], StepPipelines(step, self.stage.mesh)
        for choice in choices:
            staged = pipelines.cut(choice, race.best_s)
            if isinstance(staged, Uncut):
                if staged.outrun:
                    race.outrun += 1
                else:
                    refused.append(f"{label(choice)}: {staged.reason}")
                if counted:
                    account.record("pipeline", label(choice), "not played out" if staged.outrun else "refused",
                                   None, staged.reason)
                continue
            out.append(Priced(choice=choice, step=staged))
            race.saw(out[-1])
            if counted:
                fits = out[-1].peak_bytes <= self.limit
                account.record("pipeline", label(choice), "priced" if fits else "does not fit", out[-1].step_time_s,
                               f"busiest rank {out[-1].peak_bytes / 2**30:,.2f} GiB")
        return out

    def solved(self, m: int) -> list[Priced]:
        """The pipelines of m micro-batches on the stage plan solved without the memory limit (none where
        that plan is bounded out: ``free_plan``)."""
        step = self.free_plan(m)
        return [] if step is None else self.price(step, self.by_count[m])

    def free_plan(self, m: int) -> PlannedStep | None:
        """The stage plan of m micro-batches solved without the memory limit; None where no pipeline of it
        can beat the race's best, so it is not solved: a pipeline's busiest rank works at least the average
        of its p ranks' work, whose sum is the stage plan's step (``pipeline.stages.work_floor_s``), so a
        stage plan bounded at p x that best (its LP relaxation: ``search.memory``) gives none faster. Nor is
        it solved where a count k dividing m was bounded out so (the best only falls): cutting each of k's
        micro-batches into m / k equal ones makes no plan faster (each op's FLOPs add up to the same, its
        bytes read, fixed costs, reshards and unhidden gradient sync do not shrink; every split of the
        smaller rows divides the larger), so m's free optimum is no less than k's."""
        beat = self.race.best_s * self.stage.ranks * (1 + 2 * TIE)  # a strictly slower pipeline only
        if self.known.get(m, math.inf) < beat:  # a plan under it is known: no bound can rule the count out
            beat = math.inf
        coarser = next((k for k in self.bounded if k < m and m % k == 0), None) if math.isfinite(beat) else None
        if coarser is not None:
            return self._bounded_out(m, f"no faster than m={coarser}, bounded out already (each of its micro-batches "
                                        f"splits one of m={coarser}'s)")
        step = self.stage.plan(m, math.inf, Bound(cutoff_s=beat))
        if isinstance(step, Pruned) and step.bounded:
            return self._bounded_out(m, step.reason)
        if isinstance(step, Pruned):
            raise step.error
        return step

    def _bounded_out(self, m: int, why: str) -> None:
        self.bounded.append(m)
        self.stage.problems.account.record("pipeline", f"m={m}", "bounded out", None, why)

    def free_plans(self) -> tuple[dict[int, list[Priced]], str]:
        """Pipelines of stage plans solved without the memory limit, by count, and how they were found:
        the ILP solved at the first count, every other count priced with that plan's strategies
        (``guesses``), and solved again at the count whose priced pipeline was fastest (fitting the limit
        first) and at each count the first plan cannot be priced at."""
        counts = self.counts
        if len(counts) == 1:
            return {counts[0]: self.solved(counts[0])}, ""
        first = self.free_plan(counts[0])
        if first is None:  # nothing to guess from: each count bounded or solved on its own
            return {counts[0]: [], **{m: self.solved(m) for m in counts[1:]}}, \
                "each micro-batch count bounded or solved on its own (the first's stage plan bounded out)"
        free = {counts[0]: self.price(first, self.by_count[counts[0]])}
        guesses, unpriced, why = self.guesses(first)
        fits = [g for g in guesses if g.peak_bytes <= self.limit] or guesses
        target = min(fits, key=lambda g: g.step_time_s).choice.micro_batches if fits else counts[0]
        for m in dict.fromkeys([target, *unpriced]):
            if m not in free:
                free[m] = self.solved(m)
        if why:
            return free, f"every micro-batch count solved (no symbolic capture: {why})"
        return free, _how_priced(counts, target, unpriced)

    def guesses(self, first: PlannedStep) -> tuple[list[Priced], dict[int, str], str]:
        """``first``'s pipelines at its count and, repriced, at every other count; the counts it could not
        be priced at, and why; and why none could, where the step cannot be priced symbolic. They race
        among themselves: they choose a count to solve, not the plan."""
        own = Race(limit=self.limit)
        out = self.price(first, self.by_count[self.counts[0]], own, [])
        unpriced: dict[int, str] = {}
        for m in self.counts[1:]:
            step = self.stage.reprice(first, m, self.limit, own.best_s)
            if isinstance(step, Unpriced):
                if step.whole:  # no symbolic capture of this step prices it at all
                    return out, dict.fromkeys(self.counts[1:], ""), step.reason
                unpriced[m] = step.reason
                continue
            if isinstance(step, float):  # each of its pipelines slower than a guess that fits: none is the target
                self.known[m] = step
                continue
            self.known[m] = step.plan.predicted.step_time_s
            out += self.price(step, self.by_count[m], own, [])
        return out, unpriced, ""


def _how_priced(counts: list[int], target: int, unpriced: dict[int, str]) -> str:
    others = [m for m in counts[1:] if m not in unpriced]
    solved = f"the ILP solved at m={counts[0]}" + (f" and m={target} (its priced pipeline fastest)"
                                                   if target != counts[0] else "")
    apart = (f", m={', '.join(map(str, unpriced))} (the strategies do not all apply there: "
             f"{next(iter(unpriced.values()))})" if unpriced else "")
    if not others:
        return f"every micro-batch count solved (the m={counts[0]} stage plan priced at none{apart})"
    return (f"m={', '.join(map(str, others))} priced with the m={counts[0]} stage plan's strategies on one "
            f"capture with a symbolic micro-batch; {solved}{apart}")
