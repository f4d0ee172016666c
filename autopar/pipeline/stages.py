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

import functools
from dataclasses import dataclass, field
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from autopar.errors import InputError
from autopar.problem.block_paths import block_of
from autopar.problem.nodes import OP, PlanGraph
from autopar.pipeline.spec import simulate_pipeline
from autopar.pipeline.schedule_sim import Simulation
from autopar.pipeline.tied import TiedWeight, shared_ends
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
    """Predicted seconds of its backward for one micro-batch (its checkpointed blocks replayed once)."""
    parameter_bytes: float
    """Bytes of the weights it holds per device (its parameters' local shards)."""
    parameters: int
    """Number of parameter tensors it holds."""
    sends_bytes: float
    """Bytes per device of the activations it sends to the next stage per micro-batch (0 for the last):
    values computed by it or an earlier stage that a later stage reads, user inputs and values of
    constants alone aside (``pipeline.crossing``)."""
    replay_s: float = 0.0
    """Of ``backward_s``, the seconds of one replay of its checkpointed blocks (their ops the policy does
    not keep, and their forward collectives): a split backward replays them in its input and its weight
    pass (``schedule_sim.split_backward``)."""
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
    loss_s: float = 0.0
    """Predicted seconds of a training step's loss, summed over its micro-batches, all-reduced on the
    stage mesh by the last stage's ranks after their tied weights, before they send it
    (``cost.summed_loss``)."""
    tied: list[TiedWeight] = field(default_factory=list)
    """Weights held by several pp ranks (read by stages on each), whose gradients a training step
    all-reduces between them after the buckets (``pipeline.tied``), in the order it runs them."""
    estimate: str = ("the pipelined step time is an estimate (torch's schedule order played out with each stage's "
                     "predicted seconds, backward halved into input and weight gradients where the schedule splits "
                     "them, the first stage's all in its weight pass, transfers delaying only their receivers); the "
                     "ILP placed each stage for one micro-batch on the stage mesh")
    stage_of: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    """Captured op node -> stage (derived from ``stages``; what the split pass cuts by)."""

    @functools.cached_property
    def _spans(self) -> tuple[float, float, float]:
        """(the span transfers aside, its bubble, the span): two plays of the schedule, made for a plan's
        report only (a search prices many pipelines and keeps one)."""
        compute = self.simulate(transfers=False)
        return compute.span_s, compute.bubble_s, self.simulate().span_s

    @property
    def bubble_fraction(self) -> float:
        """Predicted share of the pipeline's compute span the busiest rank idles (``pipeline.spec``)."""
        compute, bubble, _ = self._spans
        return bubble / compute if compute else 0.0

    @property
    def bubble_s(self) -> float:
        """The span, transfers aside, less the busiest rank's compute seconds."""
        return self._spans[1]

    @property
    def p2p_s(self) -> float:
        """Predicted seconds the point-to-point transfers add to the span (they delay their receivers)."""
        compute, _, span = self._spans
        return span - compute

    def simulate(self, transfers: bool = True) -> Simulation:
        """The schedule played out with the stages' predicted seconds (``pipeline.schedule_sim``)."""
        return simulate_pipeline(self.schedule, self.size, self.virtual_stages, self.micro_batches,
                                 [(s.forward_s, s.backward_s, s.replay_s) for s in self.stages],
                                 [s.send_s for s in self.stages] if transfers else ())

    def rank_ends(self, sim: Simulation) -> list[RankEnd]:
        """Each rank after its pipeline drains, as ``runtime.pipeline.PipelinedModule.step`` runs
        it: its gradient buckets, its tied weights' all-reduces (each once all its ranks are
        ready), then the loss broadcast from the last stage's rank (which sends it after its own
        buckets, tied weights and the loss's all-reduce on the stage mesh: ``loss_s``), then its
        optimizer step. The step ends at the latest."""
        drained = [acts[-1][4] if acts else 0.0 for acts in sim.placed]
        synced = [d + g for d, g in zip(drained, self.grad_sync_per_rank_s)]
        tied = shared_ends(self.tied, synced)
        loss_at = tied[self.stages[-1].rank][1] + self.loss_s
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
    """Why a step was not cut into a pipeline's stages and priced (what ``StagePricing.price`` returns
    instead): the model has too few units for its stages, or (``outrun``) its busiest rank's own work
    (``work_floor_s``) already takes longer than the seconds it had to beat, so it is not played out."""

    reason: str
    outrun: bool = False


def work_floor_s(micro_batches: int, stage_s: list[tuple[float, float]], rank_of: list[int], sync_s: list[float],
                 update_s: list[float], send_s: list[float], replayed_s: Sequence[float] = ()) -> float:
    """Seconds no pipelined step of these stages beats: a rank runs its actions one after another
    (every micro-batch's forward and backward of each of its stages), then its gradient buckets and
    tied weights' all-reduces (the last stage's rank also the summed loss's: ``sync_s``) and its
    optimizer step (``PipelinePlan.rank_ends``), and none of them before the first micro-batch's
    forward has come through the stages before its first (each action of a stage waits on that
    stage's forward, which waits on the one before it: their forward seconds and the transfers across
    their cuts, ``send_s``, 0 within a rank), so the step lasts at least the longest such sum,
    whatever else the bubble, transfers and waits add. ``replayed_s``: each stage's seconds of the
    replays of its checkpointed blocks beyond one a micro-batch (a split backward's: ``schedule_sim.replays``)."""
    work = [0.0] * len(sync_s)
    for (f, b), r in zip(stage_s, rank_of):
        work[r] += micro_batches * (f + b)
    for extra, r in zip(replayed_s, rank_of):
        work[r] += extra
    fill, reached = [-1.0] * len(sync_s), 0.0  # each rank's first stage's earliest start
    for (f, _), r, send in zip(stage_s, rank_of, send_s):
        if fill[r] < 0:
            fill[r] = reached
        reached += f + send
    return max(max(t, 0.0) + w + g + u for t, w, g, u in zip(fill, work, sync_s, update_s))
