"""One stage plan cut into pinned pipelines and priced (``StagePricing``), as ``pipeline.stages``' module
docstring describes: the cuts balanced over the units, the schedule played out with the stages' seconds and
transfers, each pp rank's peak memory under it.

A pipeline search prices one stage plan under every schedule and stages-per-rank choice of its micro-batch
count. What those pipelines share is made once: each op's seconds, the units' weights, the ops of constants
alone and each op's backward working set once per stage plan; the cut once per count of stages
(``pipeline.cuts`` keeps it); the stages' seconds, parameters, transfers, gradient sync and memory once per
cut and placement of its stages on the pp ranks (the schedules of one stages-per-rank count and shape share
it). What differs by schedule (the order played out, the activations in flight) is priced per pipeline."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from autopar.cost.collectives import ALL_GATHER, point_to_point_time
from autopar.cost.model import CostContext, NodeCost
from autopar.cost.summed_loss import SUMMED_LOSS
from autopar.memory.backward import op_working_sets
from autopar.mesh import Mesh
from autopar.pipeline.crossing import constant_ops, crossing_bytes, recomputed_ops
from autopar.pipeline.cuts import balanced_cuts, pinned_cuts
from autopar.pipeline.schedule_sim import replays
from autopar.pipeline.spec import Pipeline
from autopar.pipeline.stage_memory import (buffer_stages, held_bytes, node_costs, rank_peaks, rank_working_sets,
                                           stage_bytes, whole_step_extra)
from autopar.pipeline.stages import HEAD, TAIL, PipelinePlan, StagePlan, Uncut, block_units, work_floor_s
from autopar.pipeline.tied import TiedWeight, parameter_stages, tied_parameters, tied_seconds
from autopar.problem.nodes import PARAM, PlanGraph
from autopar.problem.reshards import gathers_again, readers_by_reshard
from autopar.result.record import PlannedCollective
from autopar.rules.strategy import Strategy, local_numel


@dataclass(frozen=True)
class _Layout:
    """What every pipeline of one cut, its stages on the same pp ranks, shares."""

    stage_of: dict[str, int]
    rank_of: list[int]
    stages: list[StagePlan]
    """The stages, their memory aside."""
    times: list[list[float]]
    """Each stage's [forward, backward] seconds of one micro-batch (``_stage_seconds``)."""
    params: dict[str, tuple[int, ...]]
    sync: list[float]
    update: list[float]
    tied: list[TiedWeight]
    at: list[tuple[int, ...]]
    """Per collective of the stage plan, the stages running it (``_collective_stages``)."""


@dataclass(frozen=True)
class _Memory:
    """A layout's memory figures besides the schedule's activations in flight (``rank_peaks``' inputs)."""

    state: list[float]
    activations: list[float]
    buffers: list[float]
    working: list[float]
    extra: float


class StagePricing:
    """A stage plan (``nodes`` / ``collectives``: its ``NodePlacement``s and ``PlannedCollective``s) cut into
    pipelines on ``mesh`` (the whole mesh, the pipeline axis included) and priced; ``update_s``: parameter ->
    optimizer seconds; ``activation_bytes``: the stage plan's predicted activation memory of one micro-batch."""

    def __init__(self, graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, mesh: Mesh, nodes: list,
                 collectives: list, update_s: dict[str, float], stage_plan_step_s: float,
                 activation_bytes: float) -> None:
        self.graph, self.chosen, self.ctx, self.mesh = graph, chosen, ctx, mesh
        self.collectives, self.update_s = collectives, update_s
        self.stage_plan_step_s, self.activation_bytes = stage_plan_step_s, activation_bytes
        self.blocks, self.unit = block_units(graph)
        self.seconds = {n.name: (n.forward_s, n.backward_s) for n in nodes}
        self._layouts: dict[tuple, _Layout] = {}
        self._memory: dict[tuple, _Memory] = {}

    @functools.cached_property
    def weights(self) -> list[float]:
        """Each unit's forward + backward seconds of one micro-batch: what the cuts balance."""
        weights = [0.0] * len(self.blocks)
        for name, u in self.unit.items():
            weights[u] += sum(self.seconds[name])
        return weights

    @functools.cached_property
    def loss_s(self) -> float:
        """Seconds of the step's summed loss all-reduced once by the last stage's ranks (``cost.summed_loss``)."""
        return sum(c.time_s * c.count for c in self.collectives if c.consumer == SUMMED_LOSS)

    @functools.cached_property
    def constants(self) -> frozenset[str]:
        return constant_ops(self.graph, self.chosen, self.ctx)

    @functools.cached_property
    def costs(self) -> dict[str, NodeCost]:
        return node_costs(self.graph, self.chosen)

    @functools.cached_property
    def working_sets(self) -> dict[str, float]:
        return op_working_sets(self.graph, self.chosen, self.ctx)

    def price(self, pipeline: Pipeline, beat_s: float = math.inf) -> tuple[PipelinePlan, float] | Uncut:
        """The stage plan cut into ``pipeline``'s stages, and its pipelined step's seconds; ``Uncut`` where the
        model has too few units for the stages, or rather than play the schedule out when its work floor is
        over ``beat_s`` (a search's best pipeline so far: building torch's order of a long schedule takes up
        to a second, most of a large model's pipeline pricing)."""
        p = self.mesh.axes[pipeline.axis]
        count = pipeline.stages(p)
        repeated = [b for b in self.blocks if b not in (HEAD, TAIL)]
        if not repeated or len(self.blocks) < count:
            return Uncut(f"pipeline {pipeline.schedule} on {pipeline.axis}={p} with {pipeline.virtual_stages} "
                         f"stages per rank needs {count} stages of at least one unit each (the head, a repeated "
                         f"block, the tail); the model has {len(self.blocks)} "
                         f"({', '.join(self.blocks) or 'no indexed block container'})")
        key = _layout_key(pipeline, p)
        rank_of = list(key[2])
        if key not in self._layouts:
            self._layouts[key] = self._layout(pipeline, rank_of)
        layout = self._layouts[key]
        after = [s + t for s, t in zip(layout.sync, tied_seconds(layout.tied, p))]  # each rank's, once it drained
        after[rank_of[-1]] += self.loss_s
        floor = work_floor_s(pipeline.micro_batches, [(f, b) for f, b, _ in layout.times], rank_of, after,
                             layout.update, [s.send_s for s in layout.stages], _replayed_s(pipeline, p, layout.times))
        if floor > beat_s:
            return Uncut(f"its busiest rank's wait for the first micro-batch and own work, {floor:.6g} s, is over "
                         f"{beat_s:.6g} s", outrun=True)
        plan = self._plan(pipeline, layout)
        timed = plan.simulate()
        if key not in self._memory:
            self._memory[key] = self._memory_of(layout)
        return self._with_memory(plan, self._memory[key]), max(end.end_s for end in plan.rank_ends(timed)) \
            + plan.output_s

    def _layout(self, pipeline: Pipeline, rank_of: list[int]) -> _Layout:
        graph, chosen, ctx, mesh = self.graph, self.chosen, self.ctx, self.mesh
        count, p = len(rank_of), mesh.axes[pipeline.axis]
        starts = pinned_cuts(pipeline.stage_blocks, self.blocks, count) if pipeline.stage_blocks is not None \
            else balanced_cuts(self.weights, count)
        stage_of_unit = [max(k for k, s in enumerate(starts) if s <= u) for u in range(len(self.blocks))]
        stage_of = {name: stage_of_unit[u] for name, u in self.unit.items()}
        params = parameter_stages(graph, stage_of, rank_of)
        at = _collective_stages(graph, chosen, ctx, self.collectives, stage_of, count)
        times = _stage_seconds(graph, self.constants, stage_of, self.seconds, self.collectives, at, count)
        sends = crossing_bytes(graph, chosen, ctx, stage_of, count, self.constants)
        update = [0.0] * p  # each rank's parameters' optimizer seconds, in graph order
        for n, held in params.items():
            for s in held:
                update[rank_of[s]] += self.update_s.get(n, 0.0)
        tied = tied_parameters(graph, chosen, ctx, params, rank_of, mesh.names.index(pipeline.axis), mesh) \
            if ctx.train else []
        send_s = _send_seconds(pipeline, mesh, sends, rank_of)
        stages = []
        for s in range(count):
            mine = [n for n, held in params.items() if s in held]
            names = [b for b, u in zip(self.blocks, stage_of_unit) if u == s]
            stages.append(StagePlan(
                index=s, rank=rank_of[s], blocks=names, forward_s=times[s][0], backward_s=times[s][1],
                replay_s=times[s][2],
                parameter_bytes=sum(_local_bytes(graph, chosen, ctx, n) for n in mine), parameters=len(mine),
                sends_bytes=sends[s] if s < count - 1 else 0.0, send_s=send_s[s]))
        return _Layout(stage_of=stage_of, rank_of=rank_of, stages=stages, times=times, params=params,
                       sync=_sync_seconds(self.collectives, params, rank_of, p), update=update, tied=tied, at=at)

    def collectives_of(self, pipeline: Pipeline) -> list[PlannedCollective]:
        """The stage plan's collectives as ``pipeline`` runs them (one priced already): once per stage running
        each (``_collective_stages``), a replay's as often as its stage replays its blocks (``replays``)."""
        p = self.mesh.axes[pipeline.axis]
        layout = self._layouts[_layout_key(pipeline, p)]
        m = pipeline.micro_batches
        assert m is not None, "a priced pipeline has its micro-batch count"
        replayed = replays(pipeline.schedule, p, pipeline.virtual_stages or 1, m) \
            if any(c.phase == "recompute" for c in self.collectives) else ()
        out = []
        for c, stages in zip(self.collectives, layout.at):
            if c.phase == "recompute" and stages:
                # the stage plan counts a micro-batch's calls m times; a stage replays its blocks replayed[s] times
                count, left = divmod(c.count * sum(replayed[s] for s in stages), m)
                assert not left, f"collective {c.consumer} runs {c.count} times in {m} micro-batches"
            else:  # once per stage running it; once a step where none does (gradient buckets, the summed loss)
                count = c.count * max(len(stages), 1)
            out.append(replace(c, count=count) if count != c.count else c)
        return out

    def _plan(self, pipeline: Pipeline, layout: _Layout) -> PipelinePlan:
        """The pipeline's plan but its memory."""
        graph, chosen, ctx = self.graph, self.chosen, self.ctx
        p = self.mesh.axes[pipeline.axis]
        plan = PipelinePlan(axis=pipeline.axis, size=p, schedule=pipeline.schedule,
                            virtual_stages=pipeline.virtual_stages, micro_batches=pipeline.micro_batches,
                            stage_mesh=dict(ctx.mesh.axes), stages=layout.stages,
                            grad_sync_s=max(layout.sync), update_s=max(layout.update),
                            stage_plan_step_time_s=self.stage_plan_step_s, grad_sync_per_rank_s=list(layout.sync),
                            update_per_rank_s=list(layout.update), stage_of=dict(layout.stage_of),
                            tied=list(layout.tied), loss_s=self.loss_s)  # a plan's own, as the layout is shared
        if not ctx.train:
            plan.output_bytes = _output_bytes(graph, chosen, ctx)
            plan.output_s = (p - 1) * point_to_point_time(plan.output_bytes, self.mesh.names.index(pipeline.axis),
                                                          self.mesh)
        return plan

    def _memory_of(self, layout: _Layout) -> _Memory:
        graph, costs, count = self.graph, self.costs, len(layout.rank_of)
        state, act = stage_bytes(graph, costs, layout.stage_of, layout.params, count)
        buffers = buffer_stages(graph, layout.stage_of)
        working, whole = rank_working_sets(self.working_sets, layout.stage_of, layout.rank_of)
        extra = whole_step_extra(graph, costs, self.activation_bytes - whole, buffers)
        return _Memory(state=state, activations=act, buffers=held_bytes(costs, buffers, count), working=working,
                       extra=extra)

    def _with_memory(self, pipelined: PipelinePlan, memory: _Memory) -> PipelinePlan:
        """The stages' state and activation bytes, and each pp rank's peak under the schedule."""
        rank_of = [s.rank for s in pipelined.stages]
        held = [s + b for s, b in zip(memory.state, memory.buffers)]  # a stage's own buffers: the whole step
        peaks = rank_peaks(pipelined.schedule, pipelined.size, pipelined.virtual_stages, pipelined.micro_batches,
                           rank_of, held, memory.activations, memory.extra, memory.working)
        stages = [replace(s, state_bytes=memory.state[s.index], activation_bytes=memory.activations[s.index],
                          buffer_bytes=memory.buffers[s.index]) for s in pipelined.stages]
        return replace(pipelined, stages=stages, rank_memory_bytes=peaks)


def _replayed_s(pipeline: Pipeline, p: int, times: list[list[float]]) -> list[float]:
    """Each stage's seconds of its replays beyond one a micro-batch under ``pipeline``'s schedule: a split
    backward's second replay (``schedule_sim.replays``); none where no stage replays."""
    m = pipeline.micro_batches
    if not pipeline.splits_backward or m is None or not any(r for _, _, r in times):
        return []
    counts = replays(pipeline.schedule, p, pipeline.virtual_stages or 1, m)
    return [(n - m) * r for n, (_, _, r) in zip(counts, times)]


def _layout_key(pipeline: Pipeline, p: int) -> tuple[str, tuple[tuple[str, ...], ...] | None, tuple[int, ...]]:
    """What a cut into ``pipeline``'s stages depends on: its axis, pinned blocks and each stage's pp rank."""
    return pipeline.axis, pipeline.stage_blocks, tuple(pipeline.stage_rank(s, p) for s in range(pipeline.stages(p)))


def _collective_stages(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, collectives: list,
                       stage_of: dict[str, int], count: int) -> list[tuple[int, ...]]:
    """Per collective of the stage plan, the stages running it each micro-batch (none: gradient buckets,
    the summed loss): its consumer's (the loss's replication, 'output': the last); a group's, its first
    member's; a reshard of a parameter read on several stages (a tied weight), each stage with a reader
    sharing it, as each stage gathers its own copy (and gathers again in backward where a reader saved it)."""
    reading: dict[str, set[int]] = {}
    for name, s in stage_of.items():
        for src, _ in graph.nodes[name].args:
            if graph.nodes[src].kind == PARAM:
                reading.setdefault(src, set()).add(s)
    shared = {(src, first): readers for src, stages in reading.items() if len(stages) > 1
              for first, readers in readers_by_reshard(graph, chosen, ctx, src).items()}
    out: list[tuple[int, ...]] = []
    for c in collectives:
        if not c.consumer or c.consumer == SUMMED_LOSS or c.phase not in ("forward", "recompute", "backward"):
            out.append(())
            continue
        first = c.consumer.split(",")[0]
        readers = shared.get((c.tensor, first))
        if readers is None:
            out.append((stage_of.get(first, count - 1),))
            continue
        if c.phase == "backward" and c.kind == ALL_GATHER:  # gathered again: for the readers that saved it
            readers = [r for r in readers if gathers_again(graph, c.tensor, r)] or readers
        out.append(tuple(sorted({stage_of[r] for r in readers if r in stage_of})))
    return out


def _stage_seconds(graph: PlanGraph, constants: frozenset[str], stage_of: dict[str, int],
                   seconds: dict[str, tuple[float, float]], collectives: list, at: list[tuple[int, ...]],
                   count: int) -> list[list[float]]:
    """Each stage's [forward, backward] seconds of one micro-batch: its ops', their collectives' (``at``:
    the stages running each, ``_collective_stages``), and the forward of the ``constants`` of earlier stages
    it computes again rather than receives (``pipeline.crossing``), and the part of its backward that
    replays its checkpointed blocks once: [forward, backward, replay]."""
    times = [[0.0, 0.0, 0.0] for _ in range(count)]
    for name, s in stage_of.items():
        times[s][0] += seconds[name][0]
        times[s][1] += seconds[name][1]
        times[s][2] += seconds[name][0] if graph.nodes[name].replayed else 0.0
    for c, stages in zip(collectives, at):  # the stages' own collectives, once per micro-batch
        for s in stages:
            took = c.time_s if c.waited_s is None else c.waited_s
            times[s][0 if c.phase == "forward" else 1] += took
            times[s][2] += took if c.phase == "recompute" else 0.0
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


def _sync_seconds(collectives: list, params: dict[str, tuple[int, ...]], rank_of: list[int], p: int) -> list[float]:
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
