"""A step between capture and plan: ``PreparedStep`` (everything the ILP needs, under one
memory scenario) and ``finish_step`` (a solution made into a ``Plan``). ``autopar.api``
prepares steps, ``autopar.search`` solves them."""

from __future__ import annotations

import contextlib
import math
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from autopar.capture import CapturedGraph, TensorMeta, reuse_captures
from autopar.capture.symbolic import SymbolicRefused
from autopar.cost.model import CostContext
from autopar.errors import InputError
from autopar.mesh import Mesh
from autopar.rules.strategy import Strategy, placement_str
from autopar.memory.scenarios import Scenario, candidates
from autopar.problem.folding import Folding, split_folding
from autopar.problem.graph import priced_parameter
from autopar.solver.ilp import Solution
from autopar.memory.options import MemoryOptions, MemoryPlan
from autopar.problem.block_paths import repeated_blocks
from autopar.problem.nodes import PARAM, PlanGraph
from autopar.pipeline.spec import Pipeline
from autopar.result.notes import context_notes, expert_notes, unsplit_batch_notes
from autopar.result.plan import Plan, bucket_buffer_bytes, build_plan
from autopar.memory.recompute import checkpointed
from autopar.memory.regather import regathering
from autopar.result.table import solver_note
from autopar.pipeline.stage_memory import MemoryShares
from autopar.pipeline.stages import plan_stages
from autopar.problem.zigzag import zigzag_axes


@contextlib.contextmanager
def _stage(name: str, timings: dict[str, float], progress: bool) -> Iterator[None]:
    start = time.perf_counter()
    if progress:
        from rich.console import Console

        with Console(stderr=True).status(f"autopar: {name}..."):
            yield
    else:
        yield
    timings[name] = time.perf_counter() - start


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic collector off while the ILPs are built: they allocate millions of
    small acyclic objects (freed by reference counting), and the full collections those
    trigger walked the whole captured graph each time (HF Llama-3-8B on 64 devices: 0.6 of
    the 1.2 s of building its ILP)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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


@dataclass
class PreparedStep:
    """Everything before the ILP: the captured step, its strategies (pins applied) and the
    folding of repeated blocks. Every rank of ``compile`` builds one; one rank solves it."""

    captured: CapturedGraph
    graph: PlanGraph
    folding: Folding
    ctx: CostContext
    memory_limit: float
    """Bytes per device the plan must fit in."""
    memory_limit_origin: str
    """Where the limit comes from, for a memory-limit error ("" when the user gave it)."""
    timings: dict[str, float]
    pinned: dict[str, str]
    solver_time_limit_s: float = 120.0
    """Seconds HiGHS may search; a plan found by then is returned and says it is not proven optimal."""
    memory_options: MemoryOptions = MemoryOptions()
    """What the user pinned about memory (ZeRO stages, checkpointing, offload, micro-batches)."""
    memory_notes: list[str] = field(default_factory=list)
    scenario: Scenario = Scenario()
    """The memory scenario ``graph`` and ``ctx`` are priced under."""
    base_graph: PlanGraph | None = None
    """The graph as captured at this micro-batch size, before a scenario re-priced it."""
    batch: int | None = None
    batch_ways: int = 1
    """How many ways ``data_axes`` split the batch: a micro-batch must split as many ways."""
    """The step's whole batch (the leading dim of the first example input)."""
    recapture: Callable[[int], PreparedStep] | None = None
    """Prepares the step again at another micro-batch count."""
    variants: dict[int, PreparedStep] = field(default_factory=dict)
    """Preparations by micro-batch count, shared by every scenario of one step."""
    memory_shares: MemoryShares | None = None
    """For one stage mesh of a pipeline: the busiest pp rank's share of the memory row (None: all of it)."""
    cutoff_s: float = math.inf
    """No plan this slow is wanted (a pipeline search's bound, ``pipeline_search._under_limit``): the
    memory search solves only for faster plans, and raises ``MemoryLimitError`` when it finds none."""
    try_first: Scenario | None = None
    """A scenario (its micro-batch count aside) the memory search solves first: another micro-batch count's
    choice, a likely good incumbent whose time cuts off the other scenarios' solves sooner."""
    zigzag: PreparedStep | None = None
    """The same step with zig-zag shards on the context axes that may cut the sequence so
    (``problem.zigzag``); ``solve_step`` solves both and keeps the faster. None: no such axis."""

    def scenarios(self) -> list[Scenario]:
        """The scenarios ``solve_step`` searches, today's default first."""
        graph = self.base_graph or self.graph
        blocks = len(repeated_blocks([graph.nodes[n].module for n in graph.order]))
        mesh = self.ctx.mesh
        axes = tuple(n for n, size in zip(mesh.names, mesh.shape) if size > 1)
        batch = self.batch
        return [s for s in candidates(self.memory_options, batch, blocks, self.ctx.train, axes)
                if batch is None or s.micro_batches == 1 or (batch // s.micro_batches) % self.batch_ways == 0]

    def under(self, scenario: Scenario) -> PreparedStep:
        """This step priced under ``scenario`` (captured again if its micro-batch count differs)."""
        m = scenario.micro_batches
        if m not in self.variants:
            assert self.recapture is not None
            self.variants[m] = self.recapture(m)
            self.variants[m].variants = self.variants
        base = self.variants[m]
        graph = base.base_graph or base.graph
        blocks = repeated_blocks([graph.nodes[n].module for n in graph.order])
        ctx = replace(base.ctx, offload=scenario.offload, offload_pinned=scenario.offload_pinned,
                      zero1_pinned=scenario.zero1_pinned,
                      zero1=tuple(base.ctx.mesh.names.index(a) for a in scenario.zero1))
        # parameters priced again, with twins keeping their state on the host or sharded (``state_twins``)
        if scenario.offload or scenario.zero1:
            graph = replace(graph, nodes={n: priced_parameter(node, ctx) if node.kind == PARAM else node
                                          for n, node in graph.nodes.items()})
        checkpointing = blocks if scenario.checkpoint_blocks is None else blocks[:scenario.checkpoint_blocks]
        graph = checkpointed(graph, scenario.checkpoint, checkpointing if scenario.checkpoint != "none" else [], ctx)
        if scenario.regather:
            graph = regathering(graph, None if scenario.regather_blocks is None else blocks[:scenario.regather_blocks])
        partly = any(k is not None and k < len(blocks) for k in (scenario.checkpoint_blocks, scenario.regather_blocks))
        folding = split_folding(base.folding, graph) if partly else base.folding
        return replace(base, graph=graph, ctx=ctx, scenario=scenario, folding=folding)


def _memory_plan(prepared: PreparedStep) -> MemoryPlan:
    """The memory decisions of the scenario the plan was solved under (``build_plan`` adds
    which parameters are gathered again)."""
    scenario, graph = prepared.scenario, prepared.graph
    blocks = sorted({n.block for n in graph.nodes.values() if n.block is not None},
                    key=[graph.nodes[n].block for n in graph.order].index)
    return MemoryPlan(micro_batches=prepared.ctx.micro_batches, checkpoint=scenario.checkpoint if blocks else "none",
                      checkpoint_blocks=blocks, zero=dict(prepared.memory_options.zero or {}))


def finish_step(prepared: PreparedStep, solution: Solution) -> PlannedStep:
    """The plan a solution gives (deterministic: every rank builds the same one from it)."""
    if solution.zigzag:
        assert prepared.zigzag is not None, "a zig-zag solution of a step prepared without that layout"
        prepared = prepared.zigzag
    if solution.scenario is not None and solution.scenario != prepared.scenario:
        prepared = prepared.under(solution.scenario)
    graph, folding = prepared.graph, prepared.folding
    chosen = {n: graph.nodes[n].strategies[solution.choice[folding.representative[n]]] for n in graph.order}
    captured = prepared.captured
    notes = unsplit_batch_notes(graph, chosen, prepared.ctx.mesh, dict(zip(captured.user_inputs,
                                                                           captured.signature.labels)))
    notes += context_notes(graph, chosen, prepared.ctx.mesh) + expert_notes(graph, chosen, prepared.ctx.mesh)
    result = build_plan(graph, folding, solution, prepared.ctx, prepared.timings, prepared.pinned,
                        memory_limit=prepared.memory_limit, notes=notes + prepared.memory_notes + solution.notes,
                        memory=_memory_plan(prepared))
    if solution.status not in ("optimal", "repriced"):  # repriced: no solve, nothing to warn of
        warnings.warn(f"autopar: {solver_note(result.solver)}", stacklevel=4)  # the caller of plan()
    return PlannedStep(result, prepared.captured, graph, chosen, prepared.ctx, prepared.scenario)


class NotOffered(Exception):
    """A stage plan's strategy is not among a node's strategies at another micro-batch size (a split
    that no longer divides it): that size must be solved for."""


def repriced(prepared: PreparedStep, step: PlannedStep) -> PlannedStep:
    """``step``'s strategies priced on ``prepared`` (the same step at another micro-batch size, under
    ``step``'s memory scenario), solving nothing: the pipeline search prices each micro-batch count
    so (``pipeline_search``). Nodes are matched by their place in graph order (``_same_nodes``). Raises
    ``NotOffered`` where a node cannot keep its strategy, ``SymbolicRefused`` where the graphs differ."""
    if step.ctx.mesh != prepared.ctx.mesh:  # solved on the zig-zag layout
        if prepared.zigzag is None or prepared.zigzag.ctx.mesh != step.ctx.mesh:
            raise NotOffered("the stage plan's context layout is not prepared at this size")
        prepared = prepared.zigzag
    if step.scenario is not None and replace(step.scenario, micro_batches=prepared.scenario.micro_batches) \
            != prepared.scenario:
        prepared = prepared.under(replace(step.scenario, micro_batches=prepared.scenario.micro_batches))
    graph, folding = prepared.graph, prepared.folding
    same = _same_nodes(graph, step.graph)
    choice: dict[str, int] = {}
    for name in graph.order:
        rep = folding.representative[name]
        if rep in choice:
            continue
        mine = step.chosen[same[rep]]
        try:
            choice[rep] = graph.nodes[rep].strategies.index(mine)
        except ValueError:
            raise NotOffered(f"{same[rep]} ({graph.nodes[rep].op}) has no strategy "
                             f"{placement_str(mine.outputs[0])} <- {' '.join(map(placement_str, mine.inputs))} at "
                             f"this size") from None
    solution = Solution(choice=choice, objective_s=math.nan, memory_bytes=math.nan, num_variables=0,
                        num_constraints=0, build_seconds=0.0, solve_seconds=0.0, status="repriced",
                        scenario=prepared.scenario)
    return finish_step(prepared, solution)


def _same_nodes(graph: PlanGraph, planned: PlanGraph) -> dict[str, str]:
    """Each node of ``graph`` -> the node of ``planned`` at its place in graph order, checked to be the same op
    with outputs of the same ranks and dtypes: a symbolic capture holds the concrete one's ops in its order, but
    export may name them apart (a symbolic size's own arithmetic, ``operator.mul`` of the batch, takes a name
    that later nodes then shift past). ``SymbolicRefused`` where the graphs differ."""
    if len(graph.order) != len(planned.order):
        raise SymbolicRefused(f"the symbolic capture's graph has {len(graph.order)} nodes, the stage plan's "
                              f"{len(planned.order)}")
    out = {}
    for mine, theirs in zip(graph.order, planned.order):
        a, b = graph.nodes[mine], planned.nodes[theirs]
        if (a.kind, a.op, _ranks(a.outputs)) != (b.kind, b.op, _ranks(b.outputs)):
            raise SymbolicRefused(f"the symbolic capture's graph differs from the stage plan's at {mine} ({a.op}) / "
                                  f"{theirs} ({b.op})")
        out[mine] = theirs
    return out


def _ranks(outputs: tuple[TensorMeta | None, ...]) -> tuple[tuple[int, object] | None, ...]:
    return tuple(None if o is None else (o.ndim, o.dtype) for o in outputs)


def with_pipeline(step: PlannedStep, pipeline: Pipeline, mesh: Mesh, beat_s: float = math.inf) -> PlannedStep:
    """``step`` (planned on ``pipeline``'s stage mesh for one micro-batch) cut into the
    pipeline's stages, its predicted step time the pipelined one (``pipeline.stages``) and its
    peak memory the busiest pp rank's under the schedule (``pipeline.stage_memory``). Raises
    ``pipeline.stages.Outrun`` when no such step can take ``beat_s`` seconds or less."""
    plan = step.plan
    update_s = {n.name: n.update_s for n in plan.nodes}
    # The stage plan's activations include its gradient-bucket buffers, held for a micro-batched
    # step (``bucket_buffer_bytes``); the pipelined runtime keeps none (``runtime.pipeline``'s
    # ``reduce_buckets`` flattens one bucket at a time after the drain), and as the whole model's
    # they would land on every rank (the 175B GPT on pp=16: 87 GB of 93).
    activation_bytes = plan.predicted.activation_memory_bytes - bucket_buffer_bytes(plan.grad_buckets, step.ctx)
    pipelined, step_time = plan_stages(step.graph, step.chosen, step.ctx, pipeline, mesh, plan.nodes,
                                       plan.collectives, update_s, plan.predicted.step_time_s, activation_bytes,
                                       beat_s)
    peak_rank = max(range(pipelined.size), key=lambda r: pipelined.rank_memory_bytes[r])
    state = sum(s.state_bytes for s in pipelined.stages if s.rank == peak_rank)
    peak = pipelined.rank_memory_bytes[peak_rank]
    notes = [*plan.notes, f"pipeline: {pipelined.estimate}"]
    predicted = replace(plan.predicted, step_time_s=step_time, peak_memory_bytes=peak, parameter_memory_bytes=state,
                        activation_memory_bytes=peak - state,
                        memory_parts={"model state (its stages)": state, "activations in flight": peak - state})
    return replace(step, plan=replace(plan, pipeline=pipelined, notes=notes, predicted=predicted))


def prepare_layouts(prepare: Callable[[tuple[str, ...]], PreparedStep], context_axes: tuple[str, ...],
                    layout: str | None, zero: dict[str, int]) -> PreparedStep:
    """The step prepared by ``prepare(zigzag axes)`` with contiguous context axes and, where
    some may cut the sequence zig-zag (``problem.zigzag``), with them so as its ``zigzag``
    (``solve_step`` keeps the faster). ``layout`` pins one: "contiguous", or "zigzag" (refused
    with the reason where no context axis may be)."""
    if layout not in (None, "contiguous", "zigzag"):
        raise InputError(f"context_layout is 'contiguous', 'zigzag' or None (the faster), got {layout!r}")
    with reuse_captures():  # both layouts plan one captured step
        contiguous = prepare(())
        axes, why = zigzag_axes(contiguous.captured, contiguous.ctx.mesh, context_axes, zero)
        if layout == "zigzag" and not axes:
            raise InputError(f"context_layout='zigzag': {why}")
        if layout == "contiguous" or not axes:
            return contiguous
        zigzag = prepare(axes)
    if layout == "zigzag":
        return zigzag
    contiguous.zigzag = zigzag
    return contiguous
