"""The planning problem of one step at one place of the search: the step captured at a micro-batch
size, its strategies listed and priced on a mesh, the config's pins applied and repeated blocks
folded (``prepare``), then priced under a memory scenario (``priced_under``). A ``Problem`` is
everything the ILP needs; it holds no search state."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from autopar.capture import CapturedGraph, capture
from autopar.capture.symbolic import SymbolicRefused, named_as
from autopar.config import PlanConfig
from autopar.cost import get_precision
from autopar.cost.model import CostContext
from autopar.cost.precision import BF16_PARAMETERS, Precision
from autopar.errors import InputError
from autopar.memory.options import MemoryOptions
from autopar.memory.recompute import Replayed, checkpointed
from autopar.memory.regather import Regathered, regathering
from autopar.memory.scenarios import Scenario, candidates
from autopar.mesh import Mesh
from autopar.pipeline.stage_memory import MemoryShares
from autopar.problem.batch import example_batch, micro_batch_examples
from autopar.problem.block_paths import repeated_blocks
from autopar.problem.folding import Folding, fold_repeated_blocks, split_folding
from autopar.problem.graph import build_plan_graph, priced_parameter
from autopar.problem.nodes import PARAM, ObjectMemo, PlanGraph, PlanNode
from autopar.problem.pinning import pin_config
from autopar.problem.strided import add_strided_strategies
from autopar.problem.shared import BuildMemo
from autopar.search.account import Account, timed
from autopar.solver.edge_prices import EdgePrices
from autopar.solver.ilp import Built, NoPlan, Solution


@dataclass(frozen=True, kw_only=True)
class Step:
    """The step to plan: ``loss_fn(model(*example_inputs, **example_kwargs), *example_targets)``;
    with ``loss_fn=None`` the model returns its loss."""

    model: nn.Module
    example_inputs: tuple[Any, ...] = ()
    example_kwargs: dict[str, Any] | None = None
    example_targets: tuple[Any, ...] = ()
    loss_fn: Callable[..., torch.Tensor] | None = None

    @property
    def batch(self) -> int | None:
        """The whole batch: the leading dim of the first example tensor that has one."""
        return example_batch((self.example_inputs, self.example_kwargs, self.example_targets))


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where in the search a step is prepared: on which mesh (its zig-zag axes set), at how many
    micro-batches (captured at batch / m), as one stage mesh of a pipeline of how many pp ranks, and
    whether its micro-batch size is a symbol (for pricing only: ``capture.symbolic``)."""

    mesh: Mesh
    micro_batches: int = 1
    pipeline_ranks: int | None = None
    symbolic: bool = False


@dataclass
class PricedParts:
    """The parts of a prepared problem that memory scenarios price anew, each priced once per choice of
    its own (``priced_under``)."""

    ops: dict[tuple[Any, ...], tuple[dict[str, PlanNode], Folding]] = field(default_factory=dict)
    """(checkpointing, its blocks, regathering, its blocks) -> the ops it prices anew, and their folding."""
    params: dict[tuple[Any, ...], dict[str, PlanNode]] = field(default_factory=dict)
    """(offload, pinned, ZeRO-1 dims, pinned) -> every parameter priced with its state twins."""
    replayed: dict[str, Replayed] = field(default_factory=dict)
    """Checkpointing policy -> the ops of every block priced as replayed (``memory.recompute.checkpointed``)."""
    regathered: Regathered = field(default_factory=dict)
    """Ops priced as gathering their parameters again (``memory.regather.regathering``)."""
    edge_prices: dict[tuple[Any, ...], EdgePrices] = field(default_factory=dict)
    """The edge prices of its solves, by what of the context prices an edge (``EdgePrices.key``)."""
    kept_model: Built | None = None
    """The model of its last LP bound that did not rule its problem out, until that problem's solve takes
    it (``search.ilp``)."""
    by_graph: ObjectMemo = field(default_factory=ObjectMemo)
    """What the memory search's bounds read off a scenario's graph (``search.bounds``), made once per graph:
    each pipeline count's memory search asks again of the same scenarios."""


@dataclass
class Problem:
    """Everything the ILP needs, under one memory scenario."""

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
    """The step's whole batch (the leading dim of the first example input)."""
    batch_ways: int = 1
    """How many ways the data axes split the batch: a micro-batch must split as many ways."""
    memory_shares: MemoryShares | None = None
    """For one stage mesh of a pipeline: the busiest pp rank's share of the memory row (None: all of it)."""
    place: Place | None = None
    """Where in the search it was prepared."""
    parts: PricedParts = field(default_factory=PricedParts)
    """What every scenario of this prepared problem shares (each scenario's copy holds the same one)."""

    def edge_prices(self) -> EdgePrices:
        """Edge prices kept for every solve of this prepared problem under a context like this one's."""
        key = EdgePrices.key_of(self.ctx)
        if key not in self.parts.edge_prices:
            self.parts.edge_prices[key] = EdgePrices(self.ctx)
        return self.parts.edge_prices[key]

    @property
    def blocks(self) -> list[str]:
        """The repeated blocks' module paths, in program order."""
        graph = self.base_graph or self.graph
        return repeated_blocks([graph.nodes[n].module for n in graph.order])


def prepare(step: Step, config: PlanConfig, place: Place, account: Account | None = None,
            shared: BuildMemo | None = None) -> Problem:
    """Capture ``step`` at ``place``, list and price its strategies, pin what ``config`` pins and fold
    its repeated blocks: the problem under the default scenario of its pinned memory choices.
    ``shared``: what the places of one search share in building their plan graphs."""
    mesh, m, train = place.mesh, place.micro_batches, config.train
    ctx = CostContext(mesh=mesh, precision=_precision(step.model, mesh, config.precision, config.masters),
                      train=train, inputs_whole=not config.axes.input_sharded,
                      bucket_bytes=config.solver.bucket_bytes, micro_batches=m,
                      global_draws=config.random_stream == "torch", pipelined=bool(place.pipeline_ranks))
    timings: dict[str, float] = {}
    account = account or Account()
    with timed("capture", timings, account):
        captured = captured_at(step, config, m, place.symbolic)
    with timed("strategies", timings, account):
        graph = build_plan_graph(captured, config.rules, ctx, shared)
        add_strided_strategies(graph, config.rules, ctx)
        pinned = pin_config(graph, captured, mesh, config)
        folding = fold_repeated_blocks(graph, pinned.node_pins)
    options = config.memory.options(pipelined=bool(place.pipeline_ranks))
    if place.pipeline_ranks:  # a stage plan runs the pipeline's micro-batches
        options = replace(options, micro_batches=m)
    return Problem(captured, graph, folding, ctx, config.memory.limit(mesh), config.memory.limit_origin(mesh), timings,
                   pinned.pinned, config.solver.time_limit_s, options, pinned.notes, base_graph=graph, batch=step.batch,
                   batch_ways=math.prod(mesh.axes[a] for a in config.axes.data),
                   memory_shares=_stage_shares(graph, place.pipeline_ranks), place=place)


def captured_at(step: Step, config: PlanConfig, m: int, symbolic: bool) -> CapturedGraph:
    """``step`` captured at micro-batches of batch / m rows, that size a symbol if ``symbolic``."""
    inputs, kwargs, targets = micro_batch_examples((step.example_inputs, step.example_kwargs, step.example_targets),
                                                   step.batch, m, config.train)
    return capture(step.model, inputs, loss_fn=step.loss_fn, example_kwargs=kwargs, example_targets=targets,
                   train=config.train, symbolic_batch=symbolic)


def scenarios(problem: Problem) -> list[Scenario]:
    """The memory scenarios the search tries for ``problem``, the default of its pins first; a count of
    micro-batches that the data axes cannot split evenly is left out."""
    mesh = problem.ctx.mesh
    axes = tuple(n for n, size in zip(mesh.names, mesh.shape) if size > 1)
    batch = problem.batch
    return [s for s in candidates(problem.memory_options, batch, len(problem.blocks), problem.ctx.train, axes)
            if batch is None or s.micro_batches == 1 or (batch // s.micro_batches) % problem.batch_ways == 0]


def priced_under(base: Problem, scenario: Scenario) -> Problem:
    """``base`` (prepared at the scenario's micro-batch count) priced under ``scenario``: parameters
    with their state twins where state may be offloaded or sharded, checkpointed blocks replaying
    their forward, parameters gathered again in backward. The two parts touch disjoint nodes (ops,
    parameters), each priced once per choice of its own (``Problem.parts``): a memory search prices
    hundreds of scenarios out of a few checkpointing and state choices."""
    assert base.ctx.micro_batches == scenario.micro_batches, "price a scenario on its micro-batch count's capture"
    graph = base.base_graph or base.graph
    ctx = replace(base.ctx, offload=scenario.offload, offload_pinned=scenario.offload_pinned,
                  zero1_pinned=scenario.zero1_pinned, zero1=tuple(base.ctx.mesh.names.index(a) for a in scenario.zero1))
    ops_key = (scenario.checkpoint, scenario.checkpoint_blocks, scenario.regather, scenario.regather_blocks)
    if ops_key not in base.parts.ops:
        base.parts.ops[ops_key] = _ops_under(base, graph, scenario, ctx)
    ops, folding = base.parts.ops[ops_key]
    params: dict[str, PlanNode] = {}
    if scenario.offload or scenario.zero1:  # parameters priced again, with twins keeping their state elsewhere
        state_key = (ctx.offload, ctx.offload_pinned, ctx.zero1, ctx.zero1_pinned)
        if state_key not in base.parts.params:
            base.parts.params[state_key] = {n: priced_parameter(node, ctx) for n, node in graph.nodes.items()
                                            if node.kind == PARAM}
        params = base.parts.params[state_key]
    if ops or params:
        graph = replace(graph, nodes={**graph.nodes, **ops, **params})
    return replace(base, graph=graph, ctx=ctx, scenario=scenario, folding=folding)


def _ops_under(base: Problem, graph: PlanGraph, scenario: Scenario, ctx: CostContext
               ) -> tuple[dict[str, PlanNode], Folding]:
    """The ops ``scenario`` prices anew (checkpointed blocks, parameters gathered again; none of its
    parameters), and the folding of the graph they make."""
    blocks = base.blocks
    checkpointing = blocks if scenario.checkpoint_blocks is None else blocks[:scenario.checkpoint_blocks]
    priced = checkpointed(graph, scenario.checkpoint, checkpointing if scenario.checkpoint != "none" else [], ctx,
                          base.parts.replayed)
    if scenario.regather:
        priced = regathering(priced, None if scenario.regather_blocks is None else blocks[:scenario.regather_blocks],
                             base.parts.regathered)
    partly = any(k is not None and k < len(blocks) for k in (scenario.checkpoint_blocks, scenario.regather_blocks))
    folding = split_folding(base.folding, priced) if partly else base.folding
    return {n: node for n, node in priced.nodes.items() if node is not graph.nodes[n]}, folding


def _parameter_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating parameters, when they share one (None for what is
    not a module: capture names the wrong type)."""
    if not isinstance(model, nn.Module):
        return None
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return next(iter(dtypes)) if len(dtypes) == 1 else None


def _precision(model: nn.Module, mesh: Mesh, precision: str | None, masters: bool) -> Precision:
    """The named precision (default: the hardware's) for ``model``'s parameter dtype; ``masters``:
    the model is the bf16 compute copy of fp32 masters (``PlanConfig.masters``). Captured from that
    copy or from a bf16 model, the graph's dtypes are those that run, and floats are priced at them."""
    policy = get_precision(precision or mesh.hardware.default_precision, None if masters else _parameter_dtype(model))
    return replace(policy, captured_as_run=True) if masters or policy is BF16_PARAMETERS else policy


def _stage_shares(graph: PlanGraph, pipeline_ranks: int | None) -> MemoryShares | None:
    """The busiest pp rank's share of the memory row of one stage mesh (None: no pipeline)."""
    if not pipeline_ranks:
        return None
    return MemoryShares.for_pipeline(pipeline_ranks, len(repeated_blocks([graph.nodes[n].module for n in graph.order])))


class Problems:
    """The problems of one step and config: each place prepared once (captured, strategies listed,
    pins applied, blocks folded), each scenario priced once. Every level of the search asks here."""

    def __init__(self, step: Step, config: PlanConfig, progress: bool = False, *, unpipelined: str = "") -> None:
        self.step, self.config = step, config
        self.account = Account(progress)
        """What the search tried (``Plan.account``), shown on stderr as it goes with ``progress``."""
        if unpipelined:  # the default pipeline search stood down (``config.settled``)
            self.account.record("depth", "pipelines", "not searched", None, unpipelined)
        self._prepared: dict[tuple[Any, ...], Problem] = {}
        self._shared = BuildMemo(config.rules)
        self._priced: dict[tuple[Any, ...], Problem] = {}
        self._free: dict[tuple[Any, ...], Solution | NoPlan] = {}
        self._floors: dict[tuple[Any, ...], float] = {}
        self.stand_in = False
        """Prepare a place of micro-batches of two rows or more on the step's one capture with a symbolic
        micro-batch, where that capture has the concrete one's nodes (``_stands_in``): one export serves
        every count. The search sets it while it runs; its plan then moves onto a concrete capture
        (``search.planner``), which replaying a plan and compiling always use."""
        self._stands: bool | None = None

    def _routed(self, place: Place) -> Place:
        """Where ``place`` is prepared: on the symbolic capture where it stands in (``stand_in``)."""
        batch = self.step.batch
        if not self.stand_in or place.symbolic or place.micro_batches == 1 or batch is None \
                or batch // place.micro_batches < 2:  # export specializes a size of 1
            return place
        return replace(place, symbolic=True) if self._named(place.micro_batches) else place

    def _named(self, m: int) -> bool:
        """Whether the symbolic capture stands in (worked out once, at a count ``m`` cut from the batch,
        naming its nodes before any place prices them)."""
        if self._stands is None:
            self._stands = _stands_in(self.step, self.config, m)
        return self._stands

    def at(self, place: Place) -> Problem:
        """``place``'s problem as prepared, before any scenario prices it."""
        routed = self._routed(place)
        key = _key(routed)
        if key not in self._prepared:
            if routed.symbolic:  # named as the concrete capture before any is priced
                self._named(routed.micro_batches)
            try:
                self._prepared[key] = prepare(self.step, self.config, routed, self.account, self._shared)
            except (SymbolicRefused, InputError):  # a capture's refusal, made a value at this boundary
                if routed is place:
                    raise
                self._stands = False  # the stand-in fails where a concrete capture may not: none stands in
                return self.at(place)
        return self._prepared[key]

    def refused_symbolic(self, place: Place) -> str:
        """Why ``place`` (a symbolic one) cannot be prepared ("" when it can): export could not keep the
        micro-batch size a symbol, or the symbolic graph failed where the concrete one did not."""
        try:
            self.at(place)
        except (SymbolicRefused, InputError) as exc:  # a capture's refusal, made a value at this boundary
            return str(exc)
        return ""

    def under(self, place: Place, scenario: Scenario, memory_limit: float) -> Problem:
        """``place``'s problem priced under ``scenario`` (prepared at its micro-batch count), within ``memory_limit``."""
        place = self._routed(replace(place, micro_batches=scenario.micro_batches))
        key = (_key(place), scenario)
        if key not in self._priced:
            self._priced[key] = priced_under(self.at(place), scenario)
        return replace(self._priced[key], memory_limit=memory_limit)

    def solved_free(self, place: Place, scenario: Scenario, solve: Callable[[], Solution | NoPlan]
                    ) -> Solution | NoPlan:
        """``solve()``, the ILP of ``place`` under ``scenario`` without the memory row, run once: a pipeline
        search asks for a stage plan's free solve, then its memory search under the limit asks again."""
        key = self._free_key(place, scenario)
        if key not in self._free:
            self._free[key] = solve()
        return self._free[key]

    def free_floor(self, place: Place, scenario: Scenario) -> tuple[float, bool]:
        """Seconds no plan of ``place`` under ``scenario`` without the memory row beats (0: none known),
        and whether that is its free solve's own optimum (else a bound an LP proved: ``bounded_free``)."""
        key = self._free_key(place, scenario)
        free = self._free.get(key)
        if isinstance(free, Solution) and free.status == "optimal":
            return free.objective_s, True
        return self._floors.get(key, 0.0), False

    def bounded_free(self, place: Place, scenario: Scenario, floor_s: float) -> None:
        """Keep ``floor_s``, a bound an LP relaxation proved on ``place``'s free solve under ``scenario``."""
        key = self._free_key(place, scenario)
        self._floors[key] = max(self._floors.get(key, 0.0), floor_s)

    def _free_key(self, place: Place, scenario: Scenario) -> tuple[Any, ...]:
        return _key(self._routed(replace(place, micro_batches=scenario.micro_batches))), scenario

    def first(self, place: Place, memory_limit: float) -> Problem:
        """``place``'s problem under its first scenario: the memory choices pinned, nothing else searched."""
        return self.under(place, scenarios(self.at(place))[0], memory_limit)


def _stands_in(step: Step, config: PlanConfig, m: int) -> bool:
    """Whether the step's capture with a symbolic micro-batch stands in for its concrete captures: its nodes
    are the concrete capture's (of the whole batch) by op in order, and named so (``capture.symbolic.named_as``:
    export names the symbol's own arithmetic, shifting later names, and a plan names nodes). Where it is, it
    prices every size as that size's concrete capture would (``capture.symbolic``). ``m``: a count whose
    micro-batches are cut from the batch (the whole batch's tensors are other objects, which a capture
    tells apart), as every count but 1 is."""
    concrete = captured_at(step, config, 1, False)
    try:
        symbolic = captured_at(step, config, m, True)
    except SymbolicRefused:  # a capture's refusal, made a value at this boundary
        return False
    return named_as(symbolic, concrete)


def first_place(config: PlanConfig, mesh: Mesh) -> Place:
    """Where a search without a pipeline prepares the step first: the contiguous layout, at the pinned
    micro-batch count (a caller may prepare it ahead)."""
    return Place(mesh=mesh.with_zigzag(()), micro_batches=config.memory.micro_batches or 1)


def _key(place: Place) -> tuple[Any, ...]:
    mesh = place.mesh
    return (tuple(mesh.axes.items()), mesh.hardware, mesh.devices_per_node, mesh.zigzag, place.micro_batches,
            place.pipeline_ranks, place.symbolic)
