"""A solution made into a plan (``finish``), a plan's strategies priced on another capture of its step
(``repriced``), and a stage mesh's plan cut into pipelines (``StepPipelines``)."""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

from autopar.capture import CapturedGraph, TensorMeta
from autopar.cost.model import CostContext
from autopar.memory.options import MemoryPlan
from autopar.memory.scenarios import Scenario
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.pipeline.pricing import StagePricing
from autopar.pipeline.stages import Uncut
from autopar.problem.nodes import PlanGraph
from autopar.result.notes import context_notes, expert_notes, unsplit_batch_notes
from autopar.result.plan import Plan
from autopar.result.record import PlanSource
from autopar.result.build import bucket_buffer_bytes, build_plan
from autopar.result.table import solver_note
from autopar.rules.strategy import Strategy, placement_str
from autopar.search import ilp
from autopar.search.problem import Problem
from autopar.solver.ilp import NoPlan, Solution


@dataclass
class PlannedStep:
    """A plan with what produced it: the captured graph and the chosen strategy per node."""

    plan: Plan
    captured: CapturedGraph
    graph: PlanGraph
    chosen: dict[str, Strategy]
    ctx: CostContext
    scenario: Scenario | None = None
    """The memory scenario the plan was solved under (a pipeline search tries it first at other micro-batch counts)."""
    solution: Solution | None = None
    """The solution the plan was built from (its choice per representative node)."""


@dataclass(frozen=True)
class Unpriced:
    """Why a plan's strategies could not be priced on another capture of its step: a split that no longer
    divides at its size, or (``whole``) graphs that differ, so that no other size can be priced either."""

    reason: str
    whole: bool = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic collector off while the ILPs are built: they allocate millions of small acyclic
    objects (freed by reference counting), and the full collections those trigger walk the whole
    captured graph each time. Resumed, it walks every object allocated meanwhile that is still alive, so
    ``planner.plan`` holds it off until the search's problems (acyclic, freed by reference counting) are
    gone."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _memory_plan(problem: Problem) -> MemoryPlan:
    """The memory decisions of the scenario the plan was solved under (``build_plan`` adds
    which parameters are gathered again)."""
    scenario, graph = problem.scenario, problem.graph
    blocks = sorted({n.block for n in graph.nodes.values() if n.block is not None},
                    key=[graph.nodes[n].block for n in graph.order].index)
    return MemoryPlan(micro_batches=problem.ctx.micro_batches, checkpoint=scenario.checkpoint if blocks else "none",
                      checkpoint_blocks=blocks, zero=dict(problem.memory_options.zero or {}))


def finish(problem: Problem, solution: Solution) -> PlannedStep:
    """The plan ``solution`` gives on ``problem`` (priced under the solution's scenario; deterministic:
    every rank builds the same one from it)."""
    assert solution.scenario is None or solution.scenario == problem.scenario, "finish on the solution's scenario"
    graph, folding = problem.graph, problem.folding
    chosen = {n: graph.nodes[n].strategies[solution.choice[folding.representative[n]]] for n in graph.order}
    captured = problem.captured
    notes = unsplit_batch_notes(graph, chosen, problem.ctx.mesh, dict(zip(captured.user_inputs,
                                                                          captured.signature.labels)))
    notes += context_notes(graph, chosen, problem.ctx.mesh) + expert_notes(graph, chosen, problem.ctx.mesh)
    result = build_plan(graph, folding, solution, problem.ctx, problem.timings, problem.pinned,
                        memory_limit=problem.memory_limit, notes=notes + problem.memory_notes + solution.notes,
                        memory=_memory_plan(problem), prices=problem.edge_prices())
    result.source = _source(problem, solution)
    if solution.status not in ("optimal", "repriced"):  # repriced: no solve, nothing to warn of
        warnings.warn(f"autopar: {solver_note(result.solver)}", stacklevel=5)  # the caller of plan()
    return PlannedStep(result, problem.captured, graph, chosen, problem.ctx, problem.scenario, solution)


def _source(problem: Problem, solution: Solution) -> PlanSource:
    mesh = problem.ctx.mesh
    return PlanSource(mesh=dict(mesh.axes), zigzag=sorted(mesh.zigzag), micro_batches=problem.ctx.micro_batches,
                      pipeline_ranks=None if problem.place is None else problem.place.pipeline_ranks,
                      scenario=problem.scenario, choice=dict(solution.choice))


def repriced(problem: Problem, step: PlannedStep) -> PlannedStep | Unpriced:
    """``step``'s strategies priced on ``problem`` (the same step at another micro-batch size, priced under
    ``step``'s memory scenario), solving nothing: the pipeline search prices each micro-batch count so.
    Nodes are matched by their place in graph order (``matched``); ``Unpriced`` says why they cannot be."""
    solution = repriced_solution(problem, step)
    return solution if isinstance(solution, Unpriced) else finish(problem, solution)


def repriced_solution(problem: Problem, step: PlannedStep) -> Solution | Unpriced:
    """``repriced``'s solution, before it is made a plan (``finish``): its objective is the plan's step."""
    graph, folding = problem.graph, problem.folding
    same = matched(graph, step.graph)
    if isinstance(same, str):
        return Unpriced(same, whole=True)
    choice: dict[str, int] = {}
    for name in graph.order:
        rep = folding.representative[name]
        if rep in choice:
            continue
        mine = step.chosen[same[rep]]
        if mine not in graph.nodes[rep].strategies:
            return Unpriced(f"{same[rep]} ({graph.nodes[rep].op}) has no strategy {placement_str(mine.outputs[0])} "
                            f"<- {' '.join(map(placement_str, mine.inputs))} at this size")
        choice[rep] = graph.nodes[rep].strategies.index(mine)
    solution = ilp.solve(problem, None, fixed=choice)  # the choice priced by the ILP's own terms, nothing searched
    if isinstance(solution, NoPlan):
        return Unpriced(f"the stage plan's choice has no plan at this size: {solution.message}")
    return solution


def matched(graph: PlanGraph, planned: PlanGraph) -> dict[str, str] | str:
    """Each node of ``graph`` -> the node of ``planned`` at its place in graph order, checked to be the
    same op with outputs of the same ranks and dtypes: a symbolic capture holds the concrete one's ops
    in its order, but export may name them apart (a symbolic size's own arithmetic takes a name that
    later nodes then shift past). A string says where the graphs differ."""
    if len(graph.order) != len(planned.order):
        return f"the symbolic capture's graph has {len(graph.order)} nodes, the stage plan's {len(planned.order)}"
    out = {}
    for mine, theirs in zip(graph.order, planned.order):
        a, b = graph.nodes[mine], planned.nodes[theirs]
        if (a.kind, a.op, _ranks(a.outputs)) != (b.kind, b.op, _ranks(b.outputs)):
            return (f"the symbolic capture's graph differs from the stage plan's at {mine} ({a.op}) / "
                    f"{theirs} ({b.op})")
        out[mine] = theirs
    return out


def _ranks(outputs: tuple[TensorMeta | None, ...]) -> tuple[tuple[int, object] | None, ...]:
    return tuple(None if o is None else (o.ndim, o.dtype) for o in outputs)


SPLIT_REGATHER = ("its schedule runs each backward as input then weight gradients, and an op of both runs twice, "
                  "reading the parameters it saved in each: ZeRO-3's gathers in backward would run twice as often "
                  "as planned, so a plan that gathers parameters again (ZeRO-3) pipelines with another schedule; "
                  "ZeRO-2 (zero={axis: 2}) runs with this one")
"""Why a zero-bubble schedule is not cut for a step that gathers parameters again in backward."""


def schedule_refusal(pipeline: Pipeline, memory: MemoryPlan) -> str:
    """Why ``pipeline``'s schedule does not run a step of ``memory``'s choices ("" when it does)."""
    return SPLIT_REGATHER if pipeline.splits_backward and memory.regather else ""


class StepPipelines:
    """A stage mesh's plan (``step``, planned for one micro-batch) cut into pipelines on ``mesh`` (the whole
    mesh, the pipeline axis included): what the cuts share priced once (``pipeline.pricing``)."""

    def __init__(self, step: PlannedStep, mesh: Mesh) -> None:
        plan = step.plan
        # The stage plan's activations include its gradient-bucket buffers, held for a micro-batched
        # step (``bucket_buffer_bytes``); the pipelined runtime keeps none (``runtime.pipeline``'s
        # ``reduce_buckets`` flattens one bucket at a time after the drain), and as the whole model's
        # they would land on every rank.
        activation_bytes = plan.predicted.activation_memory_bytes - bucket_buffer_bytes(plan.grad_buckets, step.ctx)
        self.step = step
        self.pricing = StagePricing(step.graph, step.chosen, step.ctx, mesh, plan.nodes, plan.collectives,
                                    {n.name: n.update_s for n in plan.nodes}, plan.predicted.step_time_s,
                                    activation_bytes)

    def cut(self, pipeline: Pipeline, beat_s: float = math.inf) -> PlannedStep | Uncut:
        """The step cut into ``pipeline``'s stages, its predicted step time the pipelined one
        (``pipeline.stages``) and its peak memory the busiest pp rank's under the schedule
        (``pipeline.stage_memory``); ``Uncut`` when the model cannot be cut so, or when no such step can
        take ``beat_s`` seconds or less."""
        refused = schedule_refusal(pipeline, self.step.plan.memory)
        if refused:
            return Uncut(refused)
        staged = self.pricing.price(pipeline, beat_s)
        if isinstance(staged, Uncut):
            return staged
        pipelined, step_time = staged
        plan = replace(self.step.plan, collectives=self.pricing.collectives_of(pipeline))
        peak_rank = max(range(pipelined.size), key=lambda r: pipelined.rank_memory_bytes[r])
        state = sum(s.state_bytes for s in pipelined.stages if s.rank == peak_rank)
        peak = pipelined.rank_memory_bytes[peak_rank]
        notes = [*plan.notes, f"pipeline: {pipelined.estimate}"]
        predicted = replace(plan.predicted, step_time_s=step_time, peak_memory_bytes=peak,
                            parameter_memory_bytes=state, activation_memory_bytes=peak - state,
                            memory_parts={"model state (its stages)": state, "activations in flight": peak - state})
        return replace(self.step, plan=replace(plan, pipeline=pipelined, notes=notes, predicted=predicted))


def with_pipeline(step: PlannedStep, pipeline: Pipeline, mesh: Mesh, beat_s: float = math.inf) -> PlannedStep | Uncut:
    """``step`` cut into one pipeline (``StepPipelines.cut``)."""
    return StepPipelines(step, mesh).cut(pipeline, beat_s)
