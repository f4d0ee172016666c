"""The planner: one search, written as a loop nest read top to bottom.

``plan(step, config, mesh)`` checks the config against the mesh (``config.check``), then:

    for each layout of a mesh whose axes are left open (search.layout: dp, dp x tp within a node)
    for each pipeline depth (search.depth: Pipeline(from_axis=...) takes 1, 2, 4, ... pp ranks
                             out of the mesh's first axis; 1 is no pipeline; all planned without
                             the memory limit, then under it, likeliest first)
      for each schedule x stages per rank x micro-batch count (search.pipeline), the stage plan
        cut into stages (pipeline.stages) and priced by playing the schedule out
        for each context layout (search.context: contiguous, zig-zag)
          for each memory scenario, least lower bound first (search.memory: micro-batches,
                                    checkpointing, re-gathering, offload, ZeRO-1; search.bounds)
            the placement ILP (search.ilp -> solver.ilp)

Each level takes the problems (``search.problem.Problems``: the step prepared once per place, priced
once per scenario) and a bound from the level above, and returns its best plan or ``Pruned`` with the
reason and the error its user would get; nothing is raised to steer the search. A level a config pins
(a pipeline without ``from_axis``, no pipeline at all) is not searched; by default the depth is searched out
of the mesh's first axis (``config.settled``). ``api.plan`` and ``api.compile`` (rank 0) plan through here.
"""

from __future__ import annotations

import math
from dataclasses import replace

from autopar.capture import reuse_captures
from autopar.config import PlanConfig, check, settled
from autopar.mesh import Mesh
from autopar.errors import InputError
from autopar.pipeline.spec import Pipeline
from autopar.problem.micro_losses import split_refusal
from autopar.search.context import plan_on
from autopar.search.depth import search_depths
from autopar.search.layout import search_layouts
from autopar.search.memory import Bound, Pruned
from autopar.search.pipeline import search_pipeline
from autopar.search.planned import PlannedStep, paused_gc
from autopar.search.problem import Place, Problems, Step, captured_at


def plan(step: Step, config: PlanConfig, mesh: Mesh, *, progress: bool = False) -> PlannedStep:
    """The fastest plan of ``step`` on ``mesh`` that ``config`` allows and the memory limit fits, with the
    captured graph and chosen strategies it was built from. Raises the user's error (``InputError`` and
    its kinds) when there is none."""
    check(config, mesh)
    config, whole = whole_batch(step, config, isinstance(config.pipeline, Pipeline))
    config, unpipelined = settled(config, mesh)
    with paused_gc():  # until the problems are freed: resumed before, the collector walks them all at once
        return search(Problems(step, config, progress, unpipelined=whole or unpipelined), mesh)


def whole_batch(step: Step, config: PlanConfig, pipeline_pinned: bool) -> tuple[PlanConfig, str]:
    """``config`` for a training step whose loss no micro-batches split exactly (``split_refusal``: an MoE's
    LM loss plus its load-balancing loss, say): one micro-batch, no pipeline, and why; a pin of either
    (``pipeline_pinned``: the user's pipeline, not the default search's) is refused. Otherwise ``config`` as
    it is, and ""."""
    why = split_refusal(captured_at(step, config, 1, False).gm) if config.train else ""
    if not why:
        return config, ""
    if pipeline_pinned or (config.memory.micro_batches or 1) > 1:
        pinned = f"pipeline={config.pipeline}" if pipeline_pinned else f"micro_batches={config.memory.micro_batches}"
        raise InputError(f"{pinned}: {why}; return that loss alone (combine the others outside the step) to "
                         "pipeline it or split its batch")
    return replace(config, pipeline=None, memory=replace(config.memory, micro_batches=1)), why


def search(problems: Problems, mesh: Mesh) -> PlannedStep:
    """``plan``'s search over ``problems`` (a config already checked against ``mesh``): its places prepared on
    the step's symbolic capture where it stands in for the concrete ones (``Problems.stand_in``), the plan
    found then moved onto its concrete capture; searched again on concrete captures where it cannot be."""
    config = problems.config
    try:
        with reuse_captures(), paused_gc():  # every place captures the one step: the shapes alone differ
            limit = config.memory.limit(mesh)
            problems.stand_in = True
            found = _searched(problems, mesh, limit)
            problems.stand_in = False
            concrete = found if isinstance(found, Pruned) else on_concrete_capture(problems, found, limit)
            if concrete is None:
                problems.account.record("search", "stand-in capture", "searched again", None,
                                        "the symbolic capture's graph is not the concrete one's at the plan's size")
                concrete = _searched(problems, mesh, limit)
    finally:
        problems.stand_in = False
        problems.account.close()
    if isinstance(concrete, Pruned):
        raise concrete.error
    return replace(concrete, plan=replace(concrete.plan, account=list(problems.account.rows)))


def _searched(problems: Problems, mesh: Mesh, limit: float) -> PlannedStep | Pruned:
    config = problems.config
    return search_layouts(problems, _search, mesh, limit) if mesh.open else \
        _search(problems, config.pipeline, mesh, limit, math.inf)


def on_concrete_capture(problems: Problems, step: PlannedStep, memory_limit: float) -> PlannedStep | None:
    """``step`` on the concrete capture of its micro-batch size (itself if it is on one already): the same
    plan, now of a graph that runs. None where that capture's graph, priced under the step's scenario, is
    not the symbolic one's node for node."""
    if step.captured.batch_symbol is None:
        return step
    assert step.scenario is not None and step.plan.source is not None and not problems.stand_in
    place = Place(mesh=step.ctx.mesh, micro_batches=step.ctx.micro_batches,
                  pipeline_ranks=step.plan.source.pipeline_ranks)
    graph = problems.under(place, step.scenario, memory_limit).graph
    if graph.order != step.graph.order or any(graph.nodes[n] != step.graph.nodes[n] for n in graph.order):
        return None
    return replace(step, captured=problems.at(place).captured, graph=graph)


def _search(problems: Problems, pipeline: Pipeline | bool | None, mesh: Mesh, limit: float, cutoff_s: float
            ) -> PlannedStep | Pruned:
    """The outermost level below the mesh's layout the config leaves open, seeking only plans faster than
    ``cutoff_s`` (another layout's)."""
    if not isinstance(pipeline, Pipeline):  # settled: None (True is settled per layout, before this)
        return plan_on(problems, Place(mesh=mesh), limit, Bound(cutoff_s=cutoff_s))
    if pipeline.from_axis is not None:
        return search_depths(problems, pipeline, mesh, limit, cutoff_s)
    return search_pipeline(problems, pipeline, mesh, limit, cutoff_s)
