"""A finished plan made again for its step without searching (``Plan.source``): the step prepared where the
plan's ILP was solved, priced under its memory scenario, each node given its chosen strategy, cut into the
plan's pipeline stages. ``compile`` builds every rank's step so from rank 0's plan, and from a saved one."""

from __future__ import annotations

import math
from dataclasses import replace

from autopar.errors import InputError
from autopar.mesh import Mesh
from autopar.pipeline.spec import STAGE_AXIS, Pipeline
from autopar.pipeline.stages import Uncut
from autopar.result.plan import Plan
from autopar.result.record import PlanSource
from autopar.search.planned import PlannedStep, finish, with_pipeline
from autopar.search.problem import Place, Problem, Problems
from autopar.solver.ilp import Solution


def replay(problems: Problems, mesh: Mesh, plan: Plan) -> PlannedStep:
    """``plan`` made again for the problems' step on ``mesh`` (the mesh it runs on, its pipeline axis
    included), under their config's pins; refused, saying what differs, when it was made for another step,
    mesh or options. The plan returned is ``plan`` itself, its notes and solver figures as it was found."""
    source = _source(plan)
    pipeline = pinned_pipeline(plan)
    expected = run_axes(plan)
    if dict(mesh.axes) != expected:
        raise InputError(f"the plan was made for a mesh {expected}; this mesh is {dict(mesh.axes)}")
    stage_mesh = pipeline.stage_mesh(mesh) if pipeline is not None else mesh
    place = Place(mesh=stage_mesh.with_zigzag(tuple(source.zigzag)), micro_batches=source.micro_batches,
                  pipeline_ranks=source.pipeline_ranks)
    problem = problems.under(place, source.scenario, problems.config.memory.limit(mesh))
    solution = Solution(choice=_checked_choice(problem, source), objective_s=math.nan, memory_bytes=math.nan,
                        num_variables=0, num_constraints=0, build_seconds=0.0, solve_seconds=0.0, status="repriced",
                        scenario=problem.scenario,
                        terms=dict(plan.predicted.terms))  # priced once, by the solve the plan came from
    made = finish(problem, solution)
    if pipeline is not None:
        staged = with_pipeline(made, pipeline, mesh)
        if isinstance(staged, Uncut):
            raise InputError(f"the plan's pipeline does not cut this step: {staged.reason}")
        made = staged
    _check_same(made.plan, plan)
    if plan.pipeline is not None and made.plan.pipeline is not None:  # which stage runs each node: from the graph
        plan = replace(plan, pipeline=replace(plan.pipeline, stage_of=made.plan.pipeline.stage_of))
    return replace(made, plan=plan)


def run_axes(plan: Plan) -> dict[str, int]:
    """The axes of the whole mesh ``plan`` runs on: its own, with a pipeline's axis before its stage mesh's."""
    pipe = plan.pipeline
    if pipe is None:
        return dict(plan.mesh["axes"])
    rest = {} if list(pipe.stage_mesh) == [STAGE_AXIS] else dict(pipe.stage_mesh)
    return {pipe.axis: pipe.size, **rest}


def pinned_pipeline(plan: Plan) -> Pipeline | None:
    """The plan's pipeline with every choice made, its cuts included (None: no pipeline)."""
    pipe = plan.pipeline
    if pipe is None:
        return None
    return Pipeline(axis=pipe.axis, schedule=pipe.schedule, micro_batches=pipe.micro_batches,
                    virtual_stages=pipe.virtual_stages, stage_blocks=tuple(tuple(s.blocks) for s in pipe.stages))


def _source(plan: Plan) -> PlanSource:
    if plan.source is None:
        raise InputError("the plan does not say where it was solved (Plan.source): it was not made by autopar.plan "
                         "or autopar.compile; plan it again")
    return plan.source


def _checked_choice(problem: Problem, source: PlanSource) -> dict[str, int]:
    """The plan's choice, checked against the nodes and strategies of ``problem``."""
    reps = [n for n in problem.graph.order if problem.folding.representative[n] == n]
    missing = [n for n in reps if n not in source.choice]
    stray = [n for n in source.choice if n not in problem.graph.nodes]
    if missing or stray:
        raise InputError(f"the plan was made for another step: its nodes differ from this step's (this step has "
                         f"{', '.join(missing[:3]) or 'no other'}; the plan has {', '.join(stray[:3]) or 'no other'})")
    for name in reps:
        count = len(problem.graph.nodes[name].strategies)
        if not 0 <= source.choice[name] < count:
            raise InputError(f"the plan was made for another step or other options: node {name} has {count} "
                             f"strategies here, the plan chose number {source.choice[name]}")
    return {n: source.choice[n] for n in reps}


def _check_same(made: Plan, plan: Plan) -> None:
    """Refuse a plan that does not come out the same for this step: name what differs."""
    if made.plan_hash() == plan.plan_hash():
        return
    if made.mesh != plan.mesh:
        raise InputError(f"the plan was made for the mesh {plan.mesh}; here it is {made.mesh}")
    if len(made.nodes) != len(plan.nodes):
        raise InputError(f"the plan was made for another step: it places {len(plan.nodes)} nodes, this step has "
                         f"{len(made.nodes)}")
    for mine, theirs in zip(made.nodes, plan.nodes):
        if (mine.name, mine.op, mine.shapes, mine.outputs, mine.inputs) != \
                (theirs.name, theirs.op, theirs.shapes, theirs.outputs, theirs.inputs):
            raise InputError(f"the plan was made for another step or other options: node {theirs.name} "
                             f"({theirs.op}, shapes {theirs.shapes}, {theirs.inputs} -> {theirs.outputs}) is here "
                             f"{mine.name} ({mine.op}, shapes {mine.shapes}, {mine.inputs} -> {mine.outputs})")
    raise InputError(f"the plan was made for other options: its memory plan is {plan.memory.describe()}, here "
                     f"{made.memory.describe()}" + (f"; its pipeline {plan.pipeline.describe()}" if plan.pipeline else ""))

