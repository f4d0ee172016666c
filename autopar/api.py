"""``autopar.plan``: capture -> strategies -> (pins) -> fold repeated blocks -> ILP -> Plan."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from dataclasses import dataclass, field, replace

from autopar.capture import CapturedGraph, capture
from autopar.cost import get_precision
from autopar.cost.buckets import DEFAULT_BUCKET_BYTES
from autopar.cost.model import CostContext
from autopar.errors import InputError, InputTypeError
from autopar.mesh import Mesh
from autopar.rules import DEFAULT_RULES, RuleSet
from autopar.solver.blocks import Folding, fold_repeated_blocks, split_folding
from autopar.rules.strategy import Strategy
from torch.distributed.tensor import Replicate

from autopar.solver.constraints import Pin, apply_pins, data_parallel_pins, pins_from_tp_plan, zero_pins
from autopar.solver.graph import build_plan_graph, priced_parameter
from autopar.solver.nodes import PARAM, PlanGraph
from autopar.solver.strided import add_strided_strategies
from autopar.solver.ilp import MemoryLimitError, Solution, SolverTimeLimitError, solve
from autopar.units import fmt_bytes
from autopar.solver.notes import unsplit_batch_notes
from autopar.solver.memory import MemoryOptions, MemoryPlan, example_batch, repeated_blocks, slice_batch
from autopar.solver.plan import Plan, build_plan
from autopar.solver.recompute import checkpointed
from autopar.scenarios import Scenario, candidates, leanest, zero1_note
from autopar.solver.report import solver_note


def _as_mesh(mesh: Any) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, dict):
        return Mesh(mesh)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        return Mesh.from_device_mesh(mesh)
    raise InputTypeError(f"mesh must be an autopar.Mesh, a dict of axis sizes or a DeviceMesh, "
                         f"got {type(mesh).__name__}")


def _memory_limit(mesh: Mesh, memory_limit: float | None, memory_headroom: float | None) -> float:
    """Bytes per device the plan must fit in: given, or the device's memory less headroom."""
    if memory_limit is None:
        return mesh.hardware.memory_limit(memory_headroom)
    if memory_headroom is not None:
        raise InputError("pass memory_limit (bytes per device) or memory_headroom (a fraction of device "
                         "memory), not both")
    if not isinstance(memory_limit, (int, float)) or not memory_limit > 0:
        raise InputError(f"memory_limit must be a positive number of bytes per device, got {memory_limit!r}")
    return float(memory_limit)


BUCKET_ALIGN_BYTES = 8
"""``bucket_bytes`` is a multiple of this: a whole number of elements of any gradient dtype."""


def _check_solve_options(bucket_bytes: int, solver_time_limit_s: float) -> None:
    """Refuse option values the plan would only trip over after capture and the solve."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0 \
            or bucket_bytes % BUCKET_ALIGN_BYTES:
        raise InputError(f"bucket_bytes must be a positive whole number of bytes, a multiple of "
                         f"{BUCKET_ALIGN_BYTES} (so that gradients of any dtype fill a bucket exactly), "
                         f"got {bucket_bytes!r}")
    if isinstance(solver_time_limit_s, bool) or not isinstance(solver_time_limit_s, (int, float)) \
            or not solver_time_limit_s > 0:
        raise InputError(f"solver_time_limit_s must be a positive number of seconds, got {solver_time_limit_s!r}")


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


@dataclass
class PlannedStep:
    """A plan with what produced it: the captured graph and the chosen strategy per node."""

    plan: Plan
    captured: CapturedGraph
    graph: PlanGraph
    chosen: dict[str, Strategy]
    ctx: CostContext


def plan(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), **kwargs: Any) -> Plan:
    """Find the cheapest DP/TP/SP placement of one training (or forward) step.

    ``loss_fn(model(*example_inputs, **example_kwargs), *example_targets)`` is the step;
    with ``loss_fn=None`` the model's output must be the scalar loss. ``memory_limit`` is
    bytes per device; by default it is the device memory less ``memory_headroom`` (a
    fraction; None: the hardware profile's, 10%). ``constraints`` is a
    ``torch.distributed.tensor.parallel`` plan dict pinned on mesh axis ``constraint_axis``.
    When the cheapest plan does not fit, the memory limit decides ZeRO sharding,
    checkpointing, micro-batches, re-gathering and offload (``autopar.scenarios``);
    ``zero=``, ``checkpoint=`` (with ``checkpoint_blocks=``: how many blocks, the first
    ones), ``micro_batches=`` and ``offload=`` pin them (``plan.memory`` says what was chosen). Nothing runs on devices; a meta-device model is planned without
    allocating weights.
    """
    return plan_step(model, mesh, example_inputs, **kwargs).plan


def plan_step(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), *,
              progress: bool = False, **kwargs: Any) -> PlannedStep:
    """``plan`` keeping the captured graph and chosen strategies (what execution needs).

    Arguments as :func:`prepare_step`; ``progress`` shows the stage on stderr.
    """
    prepared = prepare_step(model, mesh, example_inputs, progress=progress, **kwargs)
    return finish_step(prepared, solve_step(prepared, progress=progress))


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
        blocks = repeated_blocks([graph.nodes[n].module for n in graph.order]) if scenario.checkpoint != "none" else []
        ctx = replace(base.ctx, regather=scenario.regather, offload=scenario.offload,
                      zero1=tuple(base.ctx.mesh.names.index(a) for a in scenario.zero1))
        if scenario.offload or scenario.zero1:  # parameters priced again: their state lives on the host, or split
            graph = replace(graph, nodes={n: priced_parameter(node, ctx) if node.kind == PARAM else node
                                          for n, node in graph.nodes.items()})
        if scenario.checkpoint_blocks is not None and scenario.checkpoint_blocks < len(blocks):
            graph = checkpointed(graph, scenario.checkpoint, blocks[:scenario.checkpoint_blocks])
            return replace(base, graph=graph, ctx=ctx, scenario=scenario, folding=split_folding(base.folding, graph))
        return replace(base, graph=checkpointed(graph, scenario.checkpoint, blocks), ctx=ctx, scenario=scenario)


def _parameter_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating parameters, when they share one (None for what is
    not a module: capture names the wrong type)."""
    if not isinstance(model, nn.Module):
        return None
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return next(iter(dtypes)) if len(dtypes) == 1 else None


def prepare_step(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), *,
                 loss_fn: Callable[..., torch.Tensor] | None = None, example_kwargs: dict[str, Any] | None = None,
                 example_targets: tuple[Any, ...] = (), train: bool = True, memory_limit: float | None = None,
                 memory_headroom: float | None = None, precision: str | None = None,
                 constraints: dict[str, object] | None = None, constraint_axis: str = "tp",
                 rules: RuleSet = DEFAULT_RULES, progress: bool = False,
                 data_axes: tuple[str, ...] = (), input_sharded: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, solver_time_limit_s: float = 120.0,
                 zero: dict[str, int] | None = None, checkpoint: str | None = None, offload: bool | None = None,
                 micro_batches: int | None = None, checkpoint_blocks: int | None = None,
                 _capture_micro_batches: int | None = None,
                 _masters: bool = False) -> PreparedStep:
    """Capture, strategies, pins and block folding: the ILP's input.

    ``data_axes`` pins plain data parallelism on those mesh axes: parameters replicated,
    every user input split along its first (batch) dim. ``input_sharded`` also pins the
    inputs replicated on every other axis (each rank receives exactly its data shard).
    ``zero``, ``checkpoint``, ``offload`` and ``micro_batches`` pin memory choices
    (``MemoryOptions``); with ``micro_batches=m`` the step is captured at batch / m.
    The result is priced under the first scenario ``solve_step`` searches (``scenarios``);
    ``PreparedStep.under`` re-prices it (and re-captures it) for another. ``_masters``: the
    model is the bf16 compute copy of fp32 masters (``compile``'s mixed precision), not a
    bf16 model, which keeps no masters (``get_precision``).
    """
    arguments = {k: v for k, v in locals().items() if k not in ("model", "mesh", "example_inputs")}

    def recapture(m: int) -> PreparedStep:
        return prepare_step(model, mesh, example_inputs, **{**arguments, "_capture_micro_batches": m})
    whole_batch = example_batch((example_inputs, example_kwargs, example_targets))
    mesh = _as_mesh(mesh)
    _check_solve_options(bucket_bytes, solver_time_limit_s)
    options = MemoryOptions(zero=zero, checkpoint=checkpoint, checkpoint_blocks=checkpoint_blocks, offload=offload,
                            micro_batches=micro_batches)
    options.check(mesh.names)
    m = _capture_micro_batches or micro_batches or 1
    example_inputs, example_kwargs, example_targets = _micro_batch_examples(
        (example_inputs, example_kwargs, example_targets), whole_batch, m, train)
    precision_policy = get_precision(precision or mesh.hardware.default_precision,
                                     None if _masters else _parameter_dtype(model))
    limit = _memory_limit(mesh, memory_limit, memory_headroom)
    origin = _limit_origin(mesh, memory_limit, memory_headroom)
    ctx = CostContext(mesh=mesh, precision=precision_policy, train=train, inputs_whole=not input_sharded,
                      bucket_bytes=bucket_bytes, micro_batches=m)
    timings: dict[str, float] = {}
    with _stage("capture", timings, progress):
        captured = capture(model, example_inputs, loss_fn=loss_fn, example_kwargs=example_kwargs,
                           example_targets=example_targets, train=train)
    with _stage("strategies", timings, progress):
        graph = build_plan_graph(captured, rules, ctx)
        add_strided_strategies(graph, rules, ctx)
        node_pins, pinned = _apply_pins(graph, captured, mesh, constraints, constraint_axis, data_axes,
                                        input_sharded, zero or {})
        memory_notes = _apply_zero_pins(graph, mesh, zero or {}, node_pins, pinned)
        folding = fold_repeated_blocks(graph, node_pins)
    prepared = PreparedStep(captured, graph, folding, ctx, limit, origin, timings, pinned, solver_time_limit_s,
                            options, memory_notes, base_graph=graph, batch=whole_batch, recapture=recapture,
                            batch_ways=math.prod(mesh.axes[a] for a in data_axes))
    if _capture_micro_batches is not None:
        return prepared
    prepared.variants[m] = prepared
    return prepared.under(prepared.scenarios()[0])


def _micro_batch_examples(examples: tuple[Any, Any, Any], batch: int | None, m: int, train: bool
                          ) -> tuple[Any, Any, Any]:
    """The example values of one micro-batch (the step is captured at batch / m)."""
    if m == 1:
        return examples
    if not train:
        raise InputError("micro_batches applies to training steps (train=True)")
    if batch is None or batch % m:
        raise InputError(f"micro_batches={m} must divide the batch (the leading dim of the first input"
                         f"{'' if batch is None else f', {batch}'})")
    return slice_batch(examples, batch, m)


def _limit_origin(mesh: Mesh, memory_limit: float | None, memory_headroom: float | None) -> str:
    """Where the memory limit comes from, for a memory-limit error ("" when the user gave it)."""
    if memory_limit is not None:
        return ""
    hw = mesh.hardware
    return (f"the {hw.name}'s {fmt_bytes(hw.memory_bytes)} less a headroom of "
            f"{hw.memory_headroom if memory_headroom is None else memory_headroom:.0%}: memory_headroom= or "
            "--memory-headroom changes it")


def _apply_pins(graph: PlanGraph, captured: CapturedGraph, mesh: Mesh, constraints: dict[str, object] | None,
                constraint_axis: str, data_axes: tuple[str, ...], input_sharded: bool, zero: dict[str, int]
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """Pin a TP plan, data parallelism and inputs arriving split; the pins by node (for
    block folding) and what the plan reports as pinned."""
    node_pins: dict[str, Any] = {}
    pinned: dict[str, str] = {}
    if constraints:
        if constraint_axis not in mesh.names:
            raise InputError(f"constraints apply to mesh axis {constraint_axis!r}, which the mesh "
                             f"({mesh.describe()}) does not have")
        axis = mesh.names.index(constraint_axis)
        tp_pins, pinned = pins_from_tp_plan(graph, constraints, axis)
        apply_pins(graph, tp_pins, axis, constraint_axis, mesh.shape[axis])
        node_pins.update(tp_pins)
    for axis_name in data_axes:
        if axis_name not in mesh.names:
            raise InputError(f"data axis {axis_name!r} is not an axis of the mesh ({mesh.describe()})")
        axis = mesh.names.index(axis_name)
        data_pins = data_parallel_pins(graph, captured.user_inputs, axis, axis_name, inputs_whole=not input_sharded)
        if zero.get(axis_name, 0) >= 2:  # parameters stored split: ZeRO's pins say how
            data_pins = {n: p for n, p in data_pins.items() if graph.nodes[n].kind != PARAM}
        _pin(graph, data_pins, mesh, axis_name, node_pins)
        pinned[f"{axis_name}: parameters, inputs"] = "data parallel"
    if input_sharded:
        for axis_name in mesh.names:
            if axis_name not in data_axes:
                _pin(graph, {n: Pin(output=Replicate(), reason=f"inputs arrive split on {data_axes} only")
                             for n in captured.user_inputs if n in graph.nodes}, mesh, axis_name, node_pins)
    return node_pins, pinned


def _pin(graph: PlanGraph, pins: dict[str, Pin], mesh: Mesh, axis_name: str, node_pins: dict[str, Any]) -> None:
    axis = mesh.names.index(axis_name)
    apply_pins(graph, pins, axis, axis_name, mesh.shape[axis])
    for name, pin in pins.items():
        node_pins[name] = (node_pins.get(name), axis_name, pin)


def _apply_zero_pins(graph: PlanGraph, mesh: Mesh, zero: dict[str, int], node_pins: dict[str, Any],
                     pinned: dict[str, str]) -> list[str]:
    """Pin each ZeRO stage on its axis; notes on parameters that could not be split."""
    notes = []
    for axis_name, stage in zero.items():
        axis = mesh.names.index(axis_name)
        pins, unsplittable = zero_pins(graph, axis, axis_name, stage, mesh.shape[axis])
        apply_pins(graph, pins, axis, axis_name, mesh.shape[axis])
        for name, pin in pins.items():
            node_pins[name] = (node_pins.get(name), axis_name, pin)
        pinned[f"{axis_name}: parameters"] = f"ZeRO-{stage}"
        if unsplittable:
            notes.append(f"ZeRO-{stage} on {axis_name}: {len(unsplittable)} parameters have no dim that divides "
                         f"by {mesh.shape[axis]} and stay replicated ({', '.join(unsplittable[:4])}"
                         f"{', ...' if len(unsplittable) > 4 else ''})")
    return notes


def solve_step(prepared: PreparedStep, progress: bool = False) -> Solution:
    """The cheapest plan within the memory limit over the memory scenarios (``scenarios``)."""
    with _stage("solve", prepared.timings, progress):
        try:
            return _search(prepared)
        except MemoryLimitError as exc:
            if not prepared.memory_limit_origin:
                raise
            raise MemoryLimitError(f"{exc} (the limit is {prepared.memory_limit_origin})") from exc


def _solve(prepared: PreparedStep, memory_limit: float | None, **kwargs: Any) -> Solution:
    solution = solve(prepared.graph, prepared.folding, prepared.ctx, memory_limit,
                     time_limit_s=prepared.solver_time_limit_s, **kwargs)
    solution.scenario = prepared.scenario
    return solution


def _search(prepared: PreparedStep) -> Solution:
    """Today's scenario unconstrained if its plan fits; else the fastest plan of every scenario."""
    scenarios = prepared.scenarios()
    first = prepared.under(scenarios[0]) if prepared.scenario != scenarios[0] else prepared
    if len(scenarios) == 1:
        return _solve(first, prepared.memory_limit)
    free = _solve(first, None)
    if free.memory_bytes <= prepared.memory_limit:
        return free
    best: Solution | None = None
    failed: list[str] = []
    faster: list[str] = []  # ZeRO-1 scenarios faster than the plan with memory to spare (not taken)
    quicker: Solution | None = None  # the fastest of them: the plan when nothing else fits
    bounds = _lower_bounds(prepared, scenarios)
    for scenario in sorted(scenarios, key=lambda s: bounds[s]):  # the likeliest first: they prune the rest
        if best is not None and bounds[scenario] >= best.objective_s:
            break  # no plan of this scenario, or of any after it, beats the best
        step = prepared.under(scenario)
        if best is not None and _node_bound(step.graph) >= best.objective_s:
            continue  # bounded at its own micro-batch count
        try:
            found = _solve(step, prepared.memory_limit, explain=False,
                           cutoff_s=None if best is None else best.objective_s)
        except MemoryLimitError:
            continue
        except (RuntimeError, SolverTimeLimitError) as exc:  # said in the plan, not hidden
            failed.append(f"memory scenario '{scenario.describe()}' not searched: {exc}")
            continue
        if scenario.zero1 != scenarios[0].zero1 and found.objective_s < free.objective_s:  # added by the search
            if quicker is None or found.objective_s < quicker.objective_s:
                quicker = found
            faster.append(zero1_note(scenario, found.objective_s, free.objective_s))
            continue
        if best is None or found.objective_s < best.objective_s:
            best = found
    if best is None and quicker is not None:  # a plan fits: ZeRO-1, faster than with memory to spare, not an error
        quicker.notes = failed + [zero1_note(quicker.scenario, quicker.objective_s, free.objective_s, taken=True)]
        return quicker
    if best is None:
        if failed:
            raise RuntimeError("; ".join(failed))
        raise _nothing_fits(prepared, scenarios)
    best.notes = failed + faster[:1]
    return best


def _lower_bounds(prepared: PreparedStep, scenarios: list[Scenario]) -> dict[Scenario, float]:
    """Seconds no plan of each scenario can beat: every node at its fastest strategy, with
    no collective (edges, gradient sync and exposed communication cost >= 0), priced with
    the fewest micro-batches searched, so that no scenario is captured again to be bounded.
    Running the batch as more micro-batches never makes a node faster (its FLOPs add up to
    the same, its bytes and fixed costs do not shrink), so that bounds every count."""
    fewest = min(s.micro_batches for s in scenarios)
    bounds: dict[Scenario, float] = {}
    by_rest: dict[Scenario, float] = {}
    for scenario in scenarios:
        rest = replace(scenario, micro_batches=fewest)
        if rest not in by_rest:
            by_rest[rest] = _node_bound(prepared.under(rest).graph)
        bounds[scenario] = by_rest[rest]
    return bounds


def _node_bound(graph: PlanGraph) -> float:
    """Every node at its fastest strategy, nothing else: no plan of ``graph`` is faster."""
    return sum(min(c.time + comm for c, comm in zip(node.costs, node.comm_times or [0.0] * len(node.costs)))
               for node in graph.nodes.values() if node.costs)


def _nothing_fits(prepared: PreparedStep, scenarios: list[Scenario]) -> MemoryLimitError:
    """The error when no scenario fits: what the leanest plan needs, and its largest parts."""
    lean = [(sol, p) for p in map(prepared.under, leanest(scenarios))
            for sol in [_solve(p, None, minimize_memory=True)]]
    solution, step = min(lean, key=lambda pair: pair[0].memory_bytes)
    predicted = finish_step(step, solution).plan.predicted
    parts = ", ".join(f"{kind} {fmt_bytes(b)}" for kind, b in
                      sorted(predicted.memory_parts.items(), key=lambda item: -item[1]) if b)
    return MemoryLimitError(
        f"no plan fits the memory limit of {fmt_bytes(prepared.memory_limit)} per device; the plan with the least "
        f"memory ({step.scenario.describe()}) needs {fmt_bytes(predicted.peak_memory_bytes)} per device: {parts}")


def _memory_plan(prepared: PreparedStep) -> MemoryPlan:
    """The memory decisions of the scenario the plan was solved under (``build_plan`` adds
    which parameters are gathered again)."""
    scenario, graph = prepared.scenario, prepared.graph
    blocks = sorted({n.block for n in graph.nodes.values() if n.block is not None},
                    key=[graph.nodes[n].block for n in graph.order].index)
    offload = sorted(graph.nodes[n].fqn or n for n in graph.order
                     if graph.nodes[n].kind == PARAM and graph.nodes[n].needs_grad) if scenario.offload else []
    return MemoryPlan(micro_batches=prepared.ctx.micro_batches, checkpoint=scenario.checkpoint if blocks else "none",
                      checkpoint_blocks=blocks, offload=offload, zero=dict(prepared.memory_options.zero or {}))


def finish_step(prepared: PreparedStep, solution: Solution) -> PlannedStep:
    """The plan a solution gives (deterministic: every rank builds the same one from it)."""
    if solution.scenario is not None and solution.scenario != prepared.scenario:
        prepared = prepared.under(solution.scenario)
    graph, folding = prepared.graph, prepared.folding
    chosen = {n: graph.nodes[n].strategies[solution.choice[folding.representative[n]]] for n in graph.order}
    captured = prepared.captured
    notes = unsplit_batch_notes(graph, chosen, prepared.ctx.mesh, dict(zip(captured.user_inputs,
                                                                           captured.signature.labels)))
    result = build_plan(graph, folding, solution, prepared.ctx, prepared.timings, prepared.pinned,
                        memory_limit=prepared.memory_limit, notes=notes + prepared.memory_notes + solution.notes,
                        memory=_memory_plan(prepared))
    if solution.status != "optimal":
        warnings.warn(f"autopar: {solver_note(result.solver)}", stacklevel=4)  # the caller of plan()
    return PlannedStep(result, prepared.captured, graph, chosen, prepared.ctx)
