"""Stage cuts of a pinned pipeline and what they are predicted to cost.

The layer stack is cut into p x v contiguous stages between units: the head (what runs
before the first block: embeddings), each repeated block (``memory.options.block_of``; code
between two blocks goes with the block before it), the tail (final norm, output head, loss).
The head and the tail are units of their own, so a large vocabulary's output head may take
a stage alone when the stages outnumber what the blocks balance (hand plans give the first
and last stages fewer layers for the same reason). The cuts minimize the slowest stage's
predicted forward + backward seconds of one micro-batch (a linear partition, solved exactly by a small dynamic
program; ties go to the earliest cuts, so every rank cuts alike). The intra-stage plan is
the one plan of the whole step on the stage sub-mesh; its nodes' seconds price the stages.

The pipelined step plays torch's schedule order out with those seconds and the transfers
across cuts between ranks (``pipeline.schedule_sim``; what crosses a cut, and what a later stage
computes again instead: ``pipeline.crossing``); after its last action each rank reduces
its gradient buckets, sums the gradients of weights tied across ranks with their other
copies' (``pipeline.tied``), takes the step's loss from the last stage's rank and updates its
parameters (``PipelinePlan.rank_ends``). The step ends with the latest rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from collections import Counter
from typing import NamedTuple

from autopar.cost.collectives import point_to_point_time
from autopar.cost.model import CostContext
from autopar.errors import InputError
from autopar.mesh import Mesh
from autopar.rules.strategy import Strategy, local_numel
from autopar.pipeline.crossing import constant_ops, crossing_bytes, recomputed_ops
from autopar.pipeline.cuts import balanced_cuts, pinned_cuts
from autopar.problem.block_paths import block_of
from autopar.problem.nodes import OP, PlanGraph
from autopar.pipeline.spec import Pipeline, pipeline_compute_s, simulate_pipeline
from autopar.pipeline.schedule_sim import Simulation
from autopar.pipeline.stage_memory import (buffer_stages, held_bytes, node_costs, rank_peaks, rank_working_sets,
                                           stage_bytes, whole_step_extra)
from autopar.pipeline.tied import TiedWeight, parameter_stages, shared_ends, tied_parameters, tied_seconds
from autopar.units import fmt_bytes

HEAD, TAIL = "(head)", "(tail)"
"""Names the stage listing gives the code before the first block and after the last."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage."""

    index: int
    """Position in the pipeline (0 first)."""
    rank: int
    """Coordinate on the pipeline axis of the ranks running it."""
    blocks: list[str]
    """Repeated blocks it runs, in order ('(head)'/'(tail)' with the first/last block)."""
    forward_s: float
    """Predicted seconds of its forward for one micro-batch (its waited collectives included, and the
    ops of constants alone of earlier stages it computes again: ``pipeline.crossing``)."""
    backward_s: float
    """Predicted seconds of its backward for one micro-batch."""
    parameter_bytes: float
    """Bytes of the weights it holds per device (its parameters' local shards)."""
    parameters: int
    """Number of parameter tensors it holds."""
    sends_bytes: float
    """Bytes per device of the activations it sends to the next stage per micro-batch (0 for the last):
    values computed by it or an earlier stage that a later stage reads, user inputs and values of
    constants alone aside (``pipeline.crossing``)."""
    send_s: float = 0.0
    """Predicted seconds of one such transfer, and of the gradients coming back (0: the next
    stage runs on the same rank, or there is none)."""
    state_bytes: float = 0.0
    """Bytes per device of its model state: parameters, gradients, optimizer state."""
    activation_bytes: float = 0.0
    """Bytes per device of the activations one micro-batch's forward saves for its backward."""
    buffer_bytes: float = 0.0
    """Bytes per device of the model buffers only it reads (a serving step's KV caches of its layers), held
    by its ranks the whole step (``stage_memory.buffer_stages``)."""


class RankEnd(NamedTuple):
    """How a pp rank's step ends, in seconds from its start."""

    drained_s: float
    """Its last pipeline action's end."""
    synced_s: float
    """Its gradient buckets' end."""
    tied_start_s: float
    """When its first tied weight's all-reduce starts, once every rank holding that weight is ready
    (``synced_s`` where it holds none)."""
    tied_end_s: float
    """When its last tied weight's all-reduce ends (``synced_s`` where it holds none)."""
    update_start_s: float
    """When it has the step's loss (broadcast from the last stage's rank after that rank's buckets
    and tied weights)."""
    end_s: float
    """Its optimizer step's end."""


@dataclass(kw_only=True)
class PipelinePlan:
    """The pipeline decision a plan carries: what the runtime executes."""

    axis: str
    """Mesh axis the stages are laid along."""
    size: int
    """Ranks along it."""
    schedule: str
    virtual_stages: int
    micro_batches: int
    stage_mesh: dict[str, int]
    """Each stage's sub-mesh (the mesh without the pipeline axis), which the placements refer to."""
    stages: list[StagePlan]
    bubble_fraction: float
    """Predicted share of the pipeline's compute span the busiest rank idles (``pipeline.spec``)."""
    bubble_s: float
    """The span, transfers aside, less the busiest rank's compute seconds."""
    p2p_s: float
    """Predicted seconds the point-to-point transfers add to the span (they delay their receivers)."""
    grad_sync_s: float
    """Predicted seconds of the slowest rank's gradient buckets after its pipeline has drained."""
    update_s: float
    """Predicted seconds of the slowest rank's optimizer step (its stages' parameters)."""
    stage_plan_step_time_s: float
    """The ILP's step time of the whole step on one sub-mesh without the pipeline (its objective)."""
    grad_sync_per_rank_s: list[float] = field(default_factory=list)
    """Each pp rank's gradient buckets' seconds."""
    update_per_rank_s: list[float] = field(default_factory=list)
    """Each pp rank's optimizer step's seconds."""
    rank_memory_bytes: list[float] = field(default_factory=list)
    """Predicted peak bytes per device of each pp rank under the schedule (``pipeline.stage_memory``)."""
    output_bytes: float = 0.0
    """Bytes per device of a forward-only step's outputs (a serving step's logits), broadcast from the
    last stage's ranks to the other pp ranks after the step, so that every rank returns them; 0 for
    a training step (its loss's broadcast, a few bytes, is not priced)."""
    output_s: float = 0.0
    """Predicted seconds of that broadcast: p - 1 point-to-point sends from the last stage's rank."""
    tied: list[TiedWeight] = field(default_factory=list)
    """Weights held by several pp ranks (read by stages on each), whose gradients a training step
    all-reduces between them after the buckets (``pipeline.tied``), in the order it runs them."""
    estimate: str = ("the pipelined step time is an estimate (torch's schedule order played out with each stage's "
                     "predicted seconds, backward halved into input and weight gradients where the schedule splits "
                     "them, transfers delaying only their receivers); the ILP placed each stage for one micro-batch "
                     "on the stage mesh")
    stage_of: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    """Captured op node -> stage (derived from ``stages``; what the split pass cuts by)."""

    def simulate(self, transfers: bool = True) -> Simulation:
        """The schedule played out with the stages' predicted seconds (``pipeline.schedule_sim``)."""
        return simulate_pipeline(self.schedule, self.size, self.virtual_stages, self.micro_batches,
                                 [(s.forward_s, s.backward_s) for s in self.stages],
                                 [s.send_s for s in self.stages] if transfers else ())

    def rank_ends(self, sim: Simulation) -> list[RankEnd]:
        """Each rank after its pipeline drains, as ``runtime.pipeline.PipelinedModule.step`` runs
        it: its gradient buckets, its tied weights' all-reduces (each once all its ranks are
        ready), then the loss broadcast from the last stage's rank (which sends it after its own
        buckets and tied weights), then its optimizer step. The step ends at the latest."""
        drained = [acts[-1][4] if acts else 0.0 for acts in sim.placed]
        synced = [d + g for d, g in zip(drained, self.grad_sync_per_rank_s)]
        tied = shared_ends(self.tied, synced)
        loss_at = tied[self.stages[-1].rank][1]
        return [RankEnd(d, s, a, b, max(b, loss_at), max(b, loss_at) + u)
                for d, s, (a, b), u in zip(drained, synced, tied, self.update_per_rank_s)]

    def step_transfers(self) -> Counter[tuple[str, int, int]]:
        """What a training step runs on the pipeline axis besides the schedule's sends, as
        ``runtime.tied`` logs it: ("all_reduce", stage, bytes) of each tied weight, once per
        stage holding it (each rank logs its own)."""
        return Counter(("all_reduce", s, w.bytes) for w in self.tied for s in w.stages)

    def forward_transfers(self) -> Counter[tuple[str, int, float]]:
        """What a forward-only step sends on the pipeline axis, as ``runtime.pipeline`` logs it:
        ("send", stage, bytes) per micro-batch across each cut between two ranks (the stage
        sending), and ("broadcast", last stage, bytes) of the step's outputs."""
        out: Counter[tuple[str, int, float]] = Counter()
        for stage, after in zip(self.stages, self.stages[1:]):
            if stage.rank != after.rank and stage.sends_bytes:
                out[("send", stage.index, stage.sends_bytes)] += self.micro_batches
        if self.output_bytes:
            out[("broadcast", self.stages[-1].index, self.output_bytes)] += 1
        return out

    def describe(self) -> str:
        cuts = " | ".join(f"{s.index}@{self.axis}{s.rank}: {_span(s.blocks)}" for s in self.stages)
        memory = ", ".join(fmt_bytes(b) for b in self.rank_memory_bytes)
        tied = "".join(f"; {w.parameter} tied on stages {' and '.join(map(str, w.stages))} (gradient all-reduced on "
                       f"{self.axis} ranks {', '.join(map(str, w.ranks))}, {fmt_bytes(w.bytes)})" for w in self.tied)
        return (f"{self.schedule}, {self.size} x {self.virtual_stages} stages, {self.micro_batches} micro-batches, "
                f"bubble {self.bubble_fraction:.1%}; {cuts}{tied}; peak memory per pp rank {memory}")


def _span(blocks: list[str]) -> str:
    inner = [b for b in blocks if b not in (HEAD, TAIL)]
    if not inner:  # a stage of the head or the tail alone
        return " + ".join(blocks)
    text = inner[0] if len(inner) == 1 else f"{inner[0]}..{inner[-1].rsplit('.', 1)[-1]}"
    return " + ".join(([HEAD] if HEAD in blocks else []) + [text] + ([TAIL] if TAIL in blocks else []))


def block_units(graph: PlanGraph) -> tuple[list[str], dict[str, int]]:
    """The units stages are cut into, in graph order, and each op node's unit index: the head
    (the ops before the first block: embeddings) when there are any, each repeated block (with
    the code after it, up to the next block), the tail (the ops after the last block: final
    norm, output head, loss) when there are any. Refuses blocks that do not run one after another."""
    ops = [name for name in graph.order if graph.nodes[name].kind == OP]
    owner = {name: block_of(graph.nodes[name].module) for name in ops}
    in_blocks = [i for i, name in enumerate(ops) if owner[name] is not None]
    if not in_blocks:
        return [], {}
    first, last = in_blocks[0], in_blocks[-1]
    head = [HEAD] if first > 0 else []
    blocks: list[str] = []
    unit: dict[str, int] = {}
    for i, name in enumerate(ops):
        block = owner[name]
        if block is not None and block not in blocks:
            blocks.append(block)
        elif block is not None and blocks[-1] != block:
            raise InputError(f"pipeline stages are cut between repeated blocks, but {name} (in {block}) runs after "
                             f"{blocks[-1]} started: the blocks do not run one after another")
        unit[name] = 0 if i < first else len(head) + len(blocks) - 1 if i <= last else len(head) + len(blocks)
    return head + blocks + ([TAIL] if last < len(ops) - 1 else []), unit


@dataclass(frozen=True)
class Uncut:
    """Why a step was not cut into a pipeline's stages and priced (what ``plan_stages`` returns
    instead): the model has too few units for its stages, or (``outrun``) its busiest rank's own work
    (``work_floor_s``) already takes longer than the seconds it had to beat, so it is not played out."""

    reason: str
    outrun: bool = False


def plan_stages(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, pipeline: Pipeline, mesh: Mesh,
                nodes: list, collectives: list, update_s: dict[str, float], stage_plan_step_s: float,
                activation_bytes: float, beat_s: float = math.inf) -> tuple[PipelinePlan, float] | Uncut:
    """Cut the step into ``pipeline``'s stages and price the pipelined step. ``mesh``: the
    whole mesh (pipeline axis included); ``nodes``/``collectives``: the sub-mesh plan's
    ``NodePlacement``s and ``PlannedCollective``s; ``update_s``: parameter -> optimizer seconds;
    ``activation_bytes``: the sub-mesh plan's predicted activation memory of one micro-batch.
    ``Uncut`` where the model has too few units for the stages, or rather than play the schedule out
    when its work floor is over ``beat_s`` (a search's best pipeline so far: building torch's order of
    a long schedule takes up to a second, most of a large model's pipeline pricing)."""
    p = mesh.axes[pipeline.axis]
    count = pipeline.stages(p)
    blocks, unit = block_units(graph)
    repeated = [b for b in blocks if b not in (HEAD, TAIL)]
    if not repeated or len(blocks) < count:
        return Uncut(f"pipeline {pipeline.schedule} on {pipeline.axis}={p} with {pipeline.virtual_stages} "
                     f"stages per rank needs {count} stages of at least one unit each (the head, a repeated "
                     f"block, the tail); the model has {len(blocks)} "
                     f"({', '.join(blocks) or 'no indexed block container'})")
    seconds = {n.name: (n.forward_s, n.backward_s) for n in nodes}
    weights = [0.0] * len(blocks)
    for name, u in unit.items():
        weights[u] += sum(seconds[name])
    starts = pinned_cuts(pipeline.stage_blocks, blocks, count) if pipeline.stage_blocks is not None \
        else balanced_cuts(weights, count)
    stage_of_unit = [max(k for k, s in enumerate(starts) if s <= u) for u in range(len(blocks))]
    stage_of = {name: stage_of_unit[u] for name, u in unit.items()}
    priced = _priced(graph, chosen, ctx, pipeline, mesh, stage_of, blocks, stage_of_unit, seconds, collectives,
                     update_s, stage_plan_step_s, beat_s)
    if isinstance(priced, Uncut):
        return priced
    pipelined, total = priced
    return _with_memory(pipelined, graph, chosen, ctx, activation_bytes), total


def _with_memory(pipelined: PipelinePlan, graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext,
                 activation_bytes: float) -> PipelinePlan:
    """The stages' state and activation bytes, and each pp rank's peak under the schedule."""
    costs = node_costs(graph, chosen)
    count = len(pipelined.stages)
    rank_of = [s.rank for s in pipelined.stages]
    params = parameter_stages(graph, pipelined.stage_of, rank_of)
    state, act = stage_bytes(graph, costs, pipelined.stage_of, params, count)
    buffers = buffer_stages(graph, pipelined.stage_of)
    own = held_bytes(costs, buffers, count)
    working, whole = rank_working_sets(graph, chosen, ctx, pipelined.stage_of, rank_of)
    peaks = rank_peaks(pipelined.schedule, pipelined.size, pipelined.virtual_stages, pipelined.micro_batches,
                       rank_of, [s + b for s, b in zip(state, own)], act,  # a stage's own buffers: the whole step
                       whole_step_extra(graph, costs, activation_bytes - whole, buffers), working)
    stages = [replace(s, state_bytes=state[s.index], activation_bytes=act[s.index], buffer_bytes=own[s.index])
              for s in pipelined.stages]
    return replace(pipelined, stages=stages, rank_memory_bytes=peaks)


def _priced(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, pipeline: Pipeline, mesh: Mesh,
            stage_of: dict[str, int], blocks: list[str], stage_of_unit: list[int],
            seconds: dict[str, tuple[float, float]], collectives: list, update_s: dict[str, float],
            stage_plan_step_s: float, beat_s: float) -> tuple[PipelinePlan, float] | Uncut:
    p = mesh.axes[pipeline.axis]
    count = pipeline.stages(p)
    rank_of = [pipeline.stage_rank(s, p) for s in range(count)]
    constants = constant_ops(graph, chosen, ctx)
    times = _stage_seconds(graph, constants, stage_of, seconds, collectives, count)
    params = parameter_stages(graph, stage_of, rank_of)
    sends = crossing_bytes(graph, chosen, ctx, stage_of, count, constants)
    send_s = _send_seconds(pipeline, mesh, sends, rank_of)
    sync = _sync_seconds(collectives, graph, params, rank_of, p)
    update = [sum(update_s.get(n, 0.0) for n, held in params.items() for s in held if rank_of[s] == r)
              for r in range(p)]
    tied = tied_parameters(graph, chosen, ctx, params, rank_of, mesh.names.index(pipeline.axis), mesh) \
        if ctx.train else []
    floor = work_floor_s(pipeline.micro_batches, [(f, b) for f, b in times], rank_of,
                         [s + t for s, t in zip(sync, tied_seconds(tied, p))], update)
    if floor > beat_s:
        return Uncut(f"its busiest rank's own work, {floor:.6g} s, is over {beat_s:.6g} s", outrun=True)
    stages = []
    for s in range(count):
        mine = [n for n, held in params.items() if s in held]
        names = [b for b, u in zip(blocks, stage_of_unit) if u == s]
        stages.append(StagePlan(index=s, rank=rank_of[s], blocks=names, forward_s=times[s][0], backward_s=times[s][1],
                                parameter_bytes=sum(_local_bytes(graph, chosen, ctx, n) for n in mine),
                                parameters=len(mine), sends_bytes=sends[s] if s < count - 1 else 0.0,
                                send_s=send_s[s]))
    compute, bubble = pipeline_compute_s(pipeline, p, [(f, b) for f, b in times], rank_of)
    plan = PipelinePlan(axis=pipeline.axis, size=p, schedule=pipeline.schedule,
                        virtual_stages=pipeline.virtual_stages, micro_batches=pipeline.micro_batches,
                        stage_mesh=dict(ctx.mesh.axes), stages=stages,
                        bubble_fraction=bubble / compute if compute else 0.0, bubble_s=bubble, p2p_s=0.0,
                        grad_sync_s=max(sync), update_s=max(update), stage_plan_step_time_s=stage_plan_step_s,
                        grad_sync_per_rank_s=sync, update_per_rank_s=update, stage_of=stage_of, tied=tied)
    if not ctx.train:
        plan.output_bytes = _output_bytes(graph, chosen, ctx)
        plan.output_s = (p - 1) * point_to_point_time(plan.output_bytes, mesh.names.index(pipeline.axis), mesh)
    timed = plan.simulate()
    plan.p2p_s = timed.span_s - compute
    return plan, max(end.end_s for end in plan.rank_ends(timed)) + plan.output_s


def _stage_seconds(graph: PlanGraph, constants: frozenset[str], stage_of: dict[str, int],
                   seconds: dict[str, tuple[float, float]], collectives: list, count: int) -> list[list[float]]:
    """Each stage's [forward, backward] seconds of one micro-batch: its ops', their collectives', and
    the forward of the ``constants`` of earlier stages it computes again rather than receives
    (``pipeline.crossing``)."""
    times = [[0.0, 0.0] for _ in range(count)]
    for name, s in stage_of.items():
        times[s][0] += seconds[name][0]
        times[s][1] += seconds[name][1]
    for c in collectives:  # the stages' own collectives, once per micro-batch
        if c.consumer and c.phase in ("forward", "recompute", "backward"):
            s = stage_of.get(c.consumer, count - 1)  # the loss's replication ('output'): the last stage
            times[s][0 if c.phase == "forward" else 1] += c.time_s if c.waited_s is None else c.waited_s
    for s, again in enumerate(recomputed_ops(graph, constants, stage_of, count)):
        times[s][0] += sum(seconds[name][0] for name in again)
    return times


def _output_bytes(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext) -> float:
    """Bytes per device of a forward-only step's outputs, each output tensor once, as placed."""
    total = 0.0
    for name in dict.fromkeys(graph.output_names):
        meta = graph.nodes[name].outputs[0] if name in graph.nodes else None
        if meta is not None and name in chosen:
            total += ctx.precision.tensor_bytes(meta, local_numel(meta, chosen[name].outputs[0], ctx.mesh.shape))
    return total


def work_floor_s(micro_batches: int, stage_s: list[tuple[float, float]], rank_of: list[int], sync_s: list[float],
                 update_s: list[float]) -> float:
    """Seconds no pipelined step of these stages beats: a rank runs its actions one after another
    (every micro-batch's forward and backward of each of its stages), then its gradient buckets
    and tied weights' all-reduces (``sync_s``) and its optimizer step (``PipelinePlan.rank_ends``),
    so the step lasts at least the longest such sum, whatever the bubble, transfers and waits add."""
    work = [0.0] * len(sync_s)
    for (f, b), r in zip(stage_s, rank_of):
        work[r] += micro_batches * (f + b)
    return max(w + g + u for w, g, u in zip(work, sync_s, update_s))


def _local_bytes(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, name: str) -> float:
    meta = graph.nodes[name].outputs[0]
    assert meta is not None
    return float(local_numel(meta, chosen[name].outputs[0], ctx.mesh.shape) * ctx.precision.weight_bytes_per_param)


def _send_seconds(pipeline: Pipeline, mesh: Mesh, sends: list[float], rank_of: list[int]) -> list[float]:
    """Per cut (after stage s), seconds of one transfer across it on the pipeline axis (0 when
    both stages run on one rank: torch hands the values over in memory)."""
    dim = mesh.names.index(pipeline.axis)
    out = [0.0] * len(sends)
    for cut, nbytes in enumerate(sends[:-1]):
        if rank_of[cut] != rank_of[cut + 1] and nbytes:
            out[cut] = point_to_point_time(nbytes, dim, mesh)
    return out


def _sync_seconds(collectives: list, graph: PlanGraph, params: dict[str, tuple[int, ...]], rank_of: list[int],
                  p: int) -> list[float]:
    """Each rank's gradient buckets, each bucket's time shared out by its parameters held on
    the rank (a rank reduces only its stages' gradients), waited for in full."""
    per_rank = [0.0] * p
    for c in collectives:
        if c.consumer:
            continue
        names = c.tensor.split(",")
        for name in names:
            for s in params.get(name, ()):
                per_rank[rank_of[s]] += c.time_s / len(names)
    return per_rank
