"""What a plan holds (``PlanRecord``, and its parts: placements, collectives, predictions, where it was
found), read back from JSON (``result.saved``); ``result.plan.Plan`` adds its renderings."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from autopar.cost.buckets import GradBucket, ShardBucket
from autopar.memory.options import MemoryPlan
from autopar.memory.scenarios import Scenario
from autopar.pipeline.stages import PipelinePlan
from autopar.result.saved import from_json

R = TypeVar("R", bound="PlanRecord")


@dataclass(frozen=True, kw_only=True)
class PlannedCollective:
    kind: str
    """all_reduce, all_gather, reduce_scatter or all_to_all."""
    axis: str
    """Mesh axis name it runs over."""
    bytes: int
    """Size M of the formulas: the full (gathered / reduced) local tensor, in bytes."""
    phase: str
    """'forward' or 'backward'."""
    tensor: str
    """Node whose output is resharded (a parameter's gradient for 'backward' grad sync); a group's
    members', comma-separated (``cost.groups``)."""
    consumer: str
    """Node that needs the new placement ('' for gradient synchronization); a group's members'."""
    module: str
    """Module path of the consumer (or of the parameter); a group's block ('(root)' outside blocks)."""
    time_s: float
    """Seconds of one run."""
    count: int = 1
    """Runs per step: once per micro-batch for the program's own collectives, once for
    gradient buckets."""
    waited_s: float | None = None
    """Of ``time_s``, the seconds the step waits for; the rest runs beside compute (a
    prefetched gather in its window, a gradient bucket beside backward). None: all of it."""
    data_dependent: bool = False
    """``bytes`` is an expectation: what runs depends on the data (an expert-parallel layer's
    all-to-alls, ``cost.moe``: the busiest rank's rows under the profile's imbalance)."""


@dataclass(frozen=True, kw_only=True)
class NodePlacement:
    name: str
    op: str
    module: str
    outputs: list[str]
    inputs: list[str]
    fallback: str | None
    """Why the op runs replicated only (no rule, or a call its rule does not handle); None otherwise."""
    shapes: list[list[int]]
    """Global shape of each output (None-free; [] for a scalar)."""
    forward_s: float = 0.0
    """Predicted seconds of the op's forward in one micro-batch (0 for leaves)."""
    backward_s: float = 0.0
    """Predicted seconds of its backward in one micro-batch (a checkpointed op's replay included)."""
    update_s: float = 0.0
    """For a parameter: predicted seconds of its optimizer update (with an offloaded one's
    copies), once per step; 0 for ops and other leaves."""


@dataclass(frozen=True, kw_only=True)
class Fallback:
    """Nodes of one op that run replicated for one reason."""

    op: str
    """The aten overload ('aten.matmul.default')."""
    reason: str
    """'no sharding rule for this op', or what the op's rule does not handle in these calls."""
    nodes: list[str]
    """The graph nodes concerned, in graph order."""

    def __str__(self) -> str:
        return f"{self.op} ({self.reason}) x{len(self.nodes)}" if len(self.nodes) > 1 else f"{self.op} ({self.reason})"


@dataclass(kw_only=True)
class Predicted:
    step_time_s: float
    """Seconds per training step: forward, backward, optimizer and the communication not hidden."""
    compute_time_s: float
    comm_time_s: float
    """Seconds of communication the step waits for (exposed)."""
    peak_memory_bytes: float
    """Per device: model state (or weights) plus activations kept for backward."""
    parameter_memory_bytes: float
    activation_memory_bytes: float
    comm_bytes: dict[str, float]
    """Bytes one device sends per step, by mesh axis."""
    memory_parts: dict[str, float] = field(default_factory=dict)
    """Peak memory per device by kind: weights, gradients, optimizer state (master copy
    included), activations (saved for backward, parameters held gathered, a checkpointed
    block's recompute)."""
    terms: dict[str, float] = field(default_factory=dict)
    """``step_time_s`` by name (``solver.milp.TERMS``: compute, own collectives, reshards, gradient sync,
    gathers in windows): the ILP's objective at the plan, what defines the step's predicted seconds; a
    pipelined plan's are its stage plan's."""
    hidden_comm_time_s: float = 0.0
    """Seconds of communication that runs beside compute (not in the step time): gradient-bucket
    all-reduces and the last micro-batch's parameter gradient reduce-scatters beside backward,
    and prefetched parameter gathers beside the neighbouring block (``solver.overlap``);
    ``comm_time_s`` + this is all the step's communication."""


@dataclass(frozen=True, kw_only=True)
class AccountRow:
    """One thing the search tried (``Plan.account``): a pipeline depth, a pipeline, a context layout, a
    memory scenario, an ILP."""

    level: str
    """'depth', 'pipeline', 'layout', 'memory' or 'ilp'."""
    item: str
    """What was tried ('pp=2', '1f1b x1 m=4', 'zig-zag on cp', a scenario, ...)."""
    outcome: str
    """What came of it: 'chosen', 'planned', 'priced', 'pruned', 'does not fit', 'refused', an ILP's status."""
    seconds: float | None = None
    """Its predicted step (a plan or bound), or an ILP's build and solve seconds; None: none."""
    detail: str = ""
    """Why, or its figures."""


@dataclass(kw_only=True)
class PlanSource:
    """What makes the plan again without searching (``autopar.compile(plan=...)``): where its ILP was
    solved and what it chose there."""

    mesh: dict[str, int]
    """The axes of the mesh the ILP placed on (a pipeline's stage mesh)."""
    zigzag: list[str]
    """Its axes cut zig-zag."""
    micro_batches: int
    """The step was captured at batch / this many rows."""
    pipeline_ranks: int | None
    """The stage mesh of a pipeline of this many pp ranks (None: no pipeline)."""
    scenario: Scenario
    """The memory scenario the ILP was priced under."""
    choice: dict[str, int]
    """Each representative node (of folded blocks) -> the index of its chosen strategy."""


@dataclass(kw_only=True)
class PlanRecord:
    """What a plan holds: the placements of every node, the collectives they imply, the predicted figures,
    and where it was found; ``Plan`` adds its renderings."""

    mesh: dict[str, Any]
    precision: str
    train: bool
    parameters: dict[str, str]
    """Parameter FQN -> placements, one per mesh axis ('S(0)R')."""
    nodes: list[NodePlacement]
    collectives: list[PlannedCollective]
    predicted: Predicted
    fallbacks: list[Fallback]
    """Calls run replicated because no rule handles them, grouped by op and reason."""
    grad_buckets: list[GradBucket] = field(default_factory=list)
    """Gradient all-reduce buckets after backward (parameter node names, mesh dims, bytes)."""
    shard_buckets: list[ShardBucket] = field(default_factory=list)
    """ZeRO-1 buckets the optimizer step runs: gradients reduce-scattered, then updated
    chunks all-gathered (``autopar.cost.zero1``)."""
    solver: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    pinned: dict[str, str] = field(default_factory=dict)
    """Module pattern -> style for plans priced with constraints."""
    memory_limit_bytes: float | None = None
    """Per-device memory the plan had to fit in (device memory less headroom, or as given)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know the plan did not do, e.g. inputs whose batch could not be split."""
    memory: MemoryPlan = field(default_factory=MemoryPlan)
    """Micro-batches, activation checkpointing, ZeRO stages and offload the plan runs."""
    pipeline: PipelinePlan | None = None
    """The pipeline's stages, schedule and predicted bubble (None: no pipeline); the
    placements above are each stage's, on ``pipeline.stage_mesh``."""
    source: PlanSource | None = None
    """What makes this plan again without searching (None: a plan not made by the planner)."""
    account: list[AccountRow] = field(default_factory=list)
    """What the search tried, what came of each and why (``autopar plan --verbose`` prints it)."""

    @classmethod
    def from_json(cls: type[R], data: dict[str, Any]) -> R:
        """The plan ``to_json`` wrote (read back from a file with ``json.load``): equal to the plan written."""
        return from_json(cls, {k: v for k, v in data.items() if k != "plan_hash"})

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if out["pipeline"] is not None:
            del out["pipeline"]["stage_of"]  # derived from the stages' blocks
            pipe = self.pipeline
            assert pipe is not None
            out["pipeline"].update(bubble_fraction=pipe.bubble_fraction, bubble_s=pipe.bubble_s, p2p_s=pipe.p2p_s)
        out["plan_hash"] = self.plan_hash()
        return out

    def plan_hash(self) -> str:
        """Fingerprint of the decisions (placements), identical on every rank and run."""
        decisions = {"mesh": self.mesh, "nodes": [(n.name, n.op, n.shapes, n.outputs, n.inputs) for n in self.nodes],
                     "memory": asdict(self.memory)}
        if self.pipeline is not None:  # absent otherwise: plans without a pipeline keep their hashes
            p = self.pipeline
            decisions["pipeline"] = [p.axis, p.schedule, p.virtual_stages, p.micro_batches,
                                     [(s.index, s.rank, s.blocks) for s in p.stages]]
        return hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).hexdigest()[:16]
