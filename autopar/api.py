"""``autopar.plan``: capture -> strategies -> (pins) -> fold repeated blocks (``prepare_step``),
then the ILP over memory scenarios (``autopar.search``) -> Plan (``autopar.step.finish_step``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from autopar.capture import CapturedGraph, capture, reuse_captures
from autopar.cost import get_precision
from autopar.cost.precision import BF16_PARAMETERS, Precision
from autopar.cost.buckets import DEFAULT_BUCKET_BYTES
from autopar.cost.model import CostContext
from autopar.errors import InputError, InputTypeError
from autopar.mesh import Mesh
from autopar.rules import DEFAULT_RULES, RuleSet
from autopar.scenarios import Scenario
from autopar.pipeline_depth import plan_depths
from autopar.pipeline_search import plan_pipelined
from autopar.search import solve_step
from autopar.solver.blocks import fold_repeated_blocks
from autopar.solver.constraints import (Pin, apply_pins, context_parallel_pins, data_parallel_pins, expert_parameters,
                                        pins_from_tp_plan, placement_pins, zero_pins)
from autopar.solver.graph import build_plan_graph
from autopar.solver.memory import MemoryOptions, check_zero, example_batch, repeated_blocks, slice_batch
from autopar.solver.nodes import PARAM, PlanGraph
from autopar.solver.plan import Plan
from autopar.solver.stage_memory import MemoryShares
from autopar.solver.strided import add_strided_strategies
from autopar.solver.zigzag import state_pins
from autopar.solver.pipeline import Pipeline, as_pipeline
from autopar.solver.context_kind import pin_context_attention
from autopar.step import PlannedStep, PreparedStep, _stage, finish_step, paused_gc, prepare_layouts, repriced

__all__ = ["PlannedStep", "PreparedStep", "finish_step", "plan", "plan_step", "prepare_step", "solve_step"]


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
    ones), ``regather_blocks=`` (with ZeRO-3: whose parameters are gathered again in
    backward, the first blocks'), ``micro_batches=`` and ``offload=`` pin them
    (``plan.memory`` says what was chosen). ``pipeline=autopar.Pipeline(axis=, schedule=,
    micro_batches=, virtual_stages=)`` pins a pipeline on one mesh axis: the stages are cut
    between repeated blocks, balanced, and planned on the other axes (``plan.pipeline``);
    ``Pipeline(from_axis=...)`` also leaves the number of pp ranks (1: none) to the planner
    (``pipeline_depth``). Nothing runs on devices; a meta-device model is planned without allocating weights.
    """
    return plan_step(model, mesh, example_inputs, **kwargs).plan


def plan_step(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), *,
              progress: bool = False, pipeline: Pipeline | None = None, _cutoff_s: float = math.inf,
              **kwargs: Any) -> PlannedStep:
    """``plan`` keeping the captured graph and chosen strategies (what execution needs).

    Arguments as :func:`prepare_step`; ``progress`` shows the stage on stderr. With
    ``pipeline`` (an ``autopar.Pipeline``), the step is planned on the mesh without the
    pipeline axis for one micro-batch (``pipeline_options``) and cut into the pipeline's
    stages (``plan.pipeline``); ``_cutoff_s`` as ``pipeline_search.plan_pipelined``'s.
    """
    if pipeline is not None:
        mesh, pipeline = _as_mesh(mesh), as_pipeline(pipeline)
        if pipeline.from_axis is not None:  # the depth is searched; the depths share their captures
            with reuse_captures():
                return plan_depths(pipeline, mesh, lambda at, chosen, cutoff_s: plan_step(
                    model, at, example_inputs, progress=progress, pipeline=chosen, _cutoff_s=cutoff_s, **kwargs))
        return plan_pipeline(pipeline, mesh, example_inputs, kwargs, lambda options: plan_step(
            model, pipeline.stage_mesh(mesh), example_inputs, progress=progress, **options), _cutoff_s,
            lambda options: prepare_step(model, pipeline.stage_mesh(mesh), example_inputs, **options))
    with paused_gc():
        prepared = prepare_step(model, mesh, example_inputs, progress=progress, **kwargs)
        return finish_step(prepared, solve_step(prepared, progress=progress))


def plan_pipeline(pipeline: Pipeline, mesh: Mesh, example_inputs: tuple[Any, ...], options: dict[str, Any],
                  plan_stage_mesh: Callable[[dict[str, Any]], PlannedStep], cutoff_s: float = math.inf,
                  prepare_stage_mesh: Callable[[dict[str, Any]], PreparedStep] | None = None) -> PlannedStep:
    """The step planned on the stage mesh for one micro-batch and cut into stages, the choices
    ``pipeline`` leaves open searched (``pipeline_search``). ``plan_stage_mesh``: ``plan_step``'s
    options -> the step planned on the stage mesh (``plan_step`` itself; in ``compile`` every
    rank prepares and rank 0 solves), so that ``plan`` and ``compile`` plan a pipeline alike;
    ``prepare_stage_mesh``: ``prepare_step``'s (every rank's alike), for pricing a stage plan at other
    micro-batch counts on one symbolic capture (None: each count solved)."""
    options = pipeline_options(pipeline, mesh, options)
    limit = _memory_limit(mesh, options.pop("memory_limit", None), options.pop("memory_headroom", None))
    batch = example_batch((example_inputs, options.get("example_kwargs"), options.get("example_targets", ())))
    ways = math.prod(mesh.axes.get(a, 1) for a in options.get("data_axes") or ())  # bad names: prepare_step says

    def plan_stage(m: int, memory_limit: float, cutoff_s: float = math.inf, try_first: Scenario | None = None
                   ) -> PlannedStep:
        return plan_stage_mesh({**options, "micro_batches": m, "memory_limit": memory_limit,
                                "_pipeline_ranks": mesh.axes[pipeline.axis], "_stage_cutoff_s": cutoff_s,
                                "_try_first": try_first})
    def reprice(step: PlannedStep, m: int) -> PlannedStep:
        assert prepare_stage_mesh is not None
        return repriced(prepare_stage_mesh({**options, "micro_batches": m, "_pipeline_ranks": mesh.axes[pipeline.axis],
                                            "_symbolic_batch": True}), step)
    with reuse_captures():  # one symbolic capture prices every count
        return plan_pipelined(plan_stage, pipeline, mesh, batch, limit, ways, cutoff_s,
                              reprice if prepare_stage_mesh is not None else None)


def pipeline_options(pipeline: Pipeline, mesh: Mesh, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for planning a pipeline's stages, checked against ``mesh`` (the whole mesh);
    the step is captured at one micro-batch (``micro_batches`` is the pipeline's)."""
    check_axis_options(options)
    check_zero(options.get("zero"))
    pipeline.check(mesh.axes)
    if options.get("micro_batches") is not None:
        raise InputError(f"micro_batches={options['micro_batches']} with a pipeline: a pipelined step runs the "
                         "pipeline's micro-batches (Pipeline(micro_batches=...); leave micro_batches out)")
    for option in ("data_axes", "context_axes", "zero"):
        if pipeline.axis in (options.get(option) or ()):
            raise InputError(f"{option} names the pipeline axis {pipeline.axis!r}: it holds stages, not data")
    if options.get("offload") or 1 in (options.get("zero") or {}).values():
        raise InputError("a pipelined step does not yet offload optimizer state or run ZeRO-1 (zero stage 1)")
    # the memory search may offload optimizer state unless told not to; build_pipelined_module refuses it
    return {**{k: v for k, v in options.items() if k != "micro_batches"}, "offload": False}


AXIS_OPTIONS = ("data_axes", "expert_axes", "context_axes")
"""Options naming mesh axes: tuples of names, never a string (read as its letters)."""


def check_axis_options(options: dict[str, Any]) -> None:
    """The options naming mesh axes are tuples (or lists) of axis names, before anything reads them."""
    for option in AXIS_OPTIONS:
        value = options.get(option) or ()
        if isinstance(value, str):
            raise InputTypeError(f"{option} must be a tuple of axis names (write ({value!r},)), got {value!r}")
        if not isinstance(value, (tuple, list)) or not all(isinstance(a, str) for a in value):
            raise InputTypeError(f"{option} must be a tuple of axis names, got {value!r}")


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
                 data_axes: tuple[str, ...] = (), expert_axes: tuple[str, ...] = (), input_sharded: bool = False,
                 context_axes: tuple[str, ...] = (), context_layout: str | None = None,
                 context_attention: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 solver_time_limit_s: float = 120.0, zero: dict[str, int] | None = None,
                 checkpoint: str | None = None, offload: bool | None = None, micro_batches: int | None = None,
                 checkpoint_blocks: int | None = None, regather_blocks: int | None = None,
                 state_placements: dict[str, tuple[Any, ...]] | None = None, random_stream: str = "counter",
                 _capture_micro_batches: int | None = None, _masters: bool = False, _pipeline_ranks: int | None = None,
                 _stage_cutoff_s: float = math.inf, _try_first: Scenario | None = None,
                 _zigzag: tuple[str, ...] | None = None, _symbolic_batch: bool = False) -> PreparedStep:
    """Capture, strategies, pins and block folding: the ILP's input.

    ``data_axes`` pins plain data parallelism on those mesh axes: parameters replicated, every user input
    split along its first (batch) dim. ``expert_axes`` (data axes too) leave stacked expert weights free there
    (``expert_parameters``): the planner may split them by expert, tokens reaching their experts by all-to-all
    (torchtitan's dp2ep: the batch split over the axis, dense weights replicated). ``input_sharded`` also pins the
    inputs replicated on every other axis (each rank receives exactly its data shard). ``context_axes``
    pins context parallelism there: parameters replicated, every user input of the first input's (batch,
    sequence) split along dim 1, attention on each rank's query rows (``rules.attention``).
    ``zero``, ``checkpoint``, ``offload``, ``micro_batches`` pin memory choices (``MemoryOptions``; m: batch / m),
    priced under ``solve_step``'s first scenario; ``PreparedStep.under`` re-prices (re-captures) for another.
    ``_masters``: the model is the bf16 compute copy of fp32 masters (``compile``'s mixed precision), not
    a bf16 model, which keeps no masters (``get_precision``). ``_pipeline_ranks``: the step is one stage mesh of
    a pipeline of that many pp ranks: no ZeRO-1 or offload (the pipelined runtime runs neither yet), a memory row
    of the busiest rank's share; ``_stage_cutoff_s``, ``_try_first``: ``PreparedStep``'s; ``_symbolic_batch``:
    captured with a symbolic micro-batch, for pricing only (``capture.symbolic``).
    Context axes are prepared contiguous and, where they may cut the sequence zig-zag, so too
    (``step.prepare_layouts``; ``_zigzag``: those axes, () for none); ``solve_step`` keeps the faster.
    ``context_layout`` pins one: "contiguous", or "zigzag". ``context_attention`` pins how attention
    runs on a split sequence: "ring" or "allgather" (``solver.context_kind``). ``state_placements`` (FQN ->
    placements) pins parameters and buffers as another step's plan, to share them (``compile_serving``).
    ``random_stream``: how random ops draw, priced so (``compile``'s: 'counter' or 'torch', ``cost.draws``)."""
    if random_stream not in ("counter", "torch"):
        raise InputError(f"random_stream={random_stream!r}: pass 'counter' or 'torch'")
    arguments = {k: v for k, v in locals().items() if k not in ("model", "mesh", "example_inputs")}
    check_axis_options(arguments)
    if _zigzag is None:  # the layouts of the context axes, each prepared with its axes
        layout = context_layout or ("contiguous" if context_attention == "ulysses" else None)  # no rows to balance
        return prepare_layouts(lambda axes: prepare_step(model, mesh, example_inputs, **{**arguments, "_zigzag": axes}),
                               tuple(context_axes), layout, zero or {})

    def recapture(m: int) -> PreparedStep:
        return prepare_step(model, mesh, example_inputs, **{**arguments, "_capture_micro_batches": m})
    whole_batch = example_batch((example_inputs, example_kwargs, example_targets))
    mesh = _as_mesh(mesh).with_zigzag(_zigzag)  # a property of the plan: priced and run so
    _check_solve_options(bucket_bytes, solver_time_limit_s)
    options = MemoryOptions(zero=zero, checkpoint=checkpoint, checkpoint_blocks=checkpoint_blocks,
                            regather_blocks=regather_blocks, offload=False if _pipeline_ranks else offload,
                            micro_batches=micro_batches, zero1_allowed=not _pipeline_ranks)
    options.check(mesh.names)
    m = _capture_micro_batches or micro_batches or 1
    example_inputs, example_kwargs, example_targets = _micro_batch_examples(
        (example_inputs, example_kwargs, example_targets), whole_batch, m, train)
    ctx = CostContext(mesh=mesh, precision=_precision(model, mesh, precision, _masters), train=train,
                      inputs_whole=not input_sharded, bucket_bytes=bucket_bytes, micro_batches=m,
                      global_draws=random_stream == "torch")
    timings: dict[str, float] = {}
    with _stage("capture", timings, progress):
        captured = capture(model, example_inputs, loss_fn=loss_fn, example_kwargs=example_kwargs,
                           example_targets=example_targets, train=train, symbolic_batch=_symbolic_batch)
    with _stage("strategies", timings, progress):
        graph = build_plan_graph(captured, rules, ctx)
        add_strided_strategies(graph, rules, ctx)
        node_pins, pinned = _apply_pins(graph, captured, mesh, constraints, constraint_axis,
                                        (data_axes, expert_axes), input_sharded, zero or {}, context_axes)
        _pin_state(graph, mesh, state_placements or {}, node_pins, pinned)
        pin_context_attention(graph, context_attention, mesh, tuple(context_axes))
        memory_notes = _apply_zero_pins(graph, mesh, zero or {}, node_pins, pinned)
        folding = fold_repeated_blocks(graph, node_pins)
    prepared = PreparedStep(captured, graph, folding, ctx, _memory_limit(mesh, memory_limit, memory_headroom),
                            _limit_origin(mesh, memory_limit, memory_headroom), timings, pinned, solver_time_limit_s,
                            options, memory_notes, base_graph=graph, batch=whole_batch, recapture=recapture,
                            batch_ways=math.prod(mesh.axes[a] for a in data_axes),
                            memory_shares=_stage_shares(graph, _pipeline_ranks), cutoff_s=_stage_cutoff_s,
                            try_first=_try_first)
    if _capture_micro_batches is not None:
        return prepared
    prepared.variants[m] = prepared
    return prepared.under(prepared.scenarios()[0])


def _precision(model: nn.Module, mesh: Mesh, precision: str | None, masters: bool) -> Precision:
    """The named precision (default: the hardware's) for ``model``'s parameter dtype; ``masters``:
    the model is the bf16 compute copy of fp32 masters (``prepare_step``). Captured from that copy
    or from a bf16 model, the graph's dtypes are those that run, and floats are priced at them."""
    policy = get_precision(precision or mesh.hardware.default_precision, None if masters else _parameter_dtype(model))
    return replace(policy, captured_as_run=True) if masters or policy is BF16_PARAMETERS else policy


def _stage_shares(graph: PlanGraph, pipeline_ranks: int | None) -> MemoryShares | None:
    """The busiest pp rank's share of the memory row of one stage mesh (None: no pipeline)."""
    if not pipeline_ranks:
        return None
    return MemoryShares.for_pipeline(pipeline_ranks, len(repeated_blocks([graph.nodes[n].module for n in graph.order])))


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
    return mesh.hardware.memory_limit_origin(memory_headroom) + ": memory_headroom= or --memory-headroom changes it"


def _apply_pins(graph: PlanGraph, captured: CapturedGraph, mesh: Mesh, constraints: dict[str, object] | None,
                constraint_axis: str, axes: tuple[tuple[str, ...], tuple[str, ...]], input_sharded: bool,
                zero: dict[str, int], context_axes: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """Pin a TP plan, data parallelism (``axes``: the data axes, and those of them that are
    expert axes), context parallelism and inputs arriving split; the pins by node (for block
    folding) and what the plan reports as pinned."""
    data_axes, expert_axes = axes
    _check_expert_axes(data_axes, expert_axes)
    experts = expert_parameters(graph) if expert_axes else frozenset()
    if expert_axes and not experts:  # naming an expert axis that changes nothing would hide the mistake
        raise InputError(f"expert_axes {tuple(expert_axes)}: no parameter of the model is a stack of expert "
                         "weights (used only as the batched operand of bmm, matmul or einsum over its dim 0, or by a "
                         "sorted dropless expert layer captured as autopar::moe_experts); experts gathered per "
                         "token are not split by expert yet")
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
        free = experts if axis_name in expert_axes else frozenset()
        data_pins = data_parallel_pins(graph, captured.user_inputs, axis, axis_name, inputs_whole=not input_sharded,
                                       free_params=free)
        _pin(graph, _stored_as_zero_says(graph, data_pins, zero.get(axis_name, 0)), mesh, axis_name, node_pins)
        pinned[f"{axis_name}: parameters, inputs"] = "data parallel"
        if free:
            pinned[f"{axis_name}: parameters, inputs"] = f"data parallel, {len(free)} expert weights free"
    for axis_name in _checked_context_axes(mesh, context_axes, data_axes, input_sharded):
        axis = mesh.names.index(axis_name)
        context_pins = context_parallel_pins(graph, captured.user_inputs, axis, axis_name)
        if axis_name in mesh.zigzag:
            context_pins = {**state_pins(graph, axis_name), **context_pins}
        _pin(graph, _stored_as_zero_says(graph, context_pins, zero.get(axis_name, 0)), mesh, axis_name, node_pins)
        pinned[f"{axis_name}: parameters, inputs"] = "context parallel (sequence split)" + \
            (", zig-zag" if axis_name in mesh.zigzag else "")
    if input_sharded:
        for axis_name in mesh.names:
            if axis_name not in data_axes:
                _pin(graph, {n: Pin(output=Replicate(), reason=f"inputs arrive split on {data_axes} only")
                             for n in captured.user_inputs if n in graph.nodes}, mesh, axis_name, node_pins)
    return node_pins, pinned



def _pin_state(graph: PlanGraph, mesh: Mesh, placements: dict[str, tuple[Any, ...]], node_pins: dict[str, Any],
               pinned: dict[str, str]) -> None:
    """Pin the parameters and buffers ``placements`` names on every axis (``state_placements``)."""
    if not placements:
        return
    for axis_name in mesh.names:
        pins = placement_pins(graph, placements, mesh.names.index(axis_name), "placed as the step sharing it")
        _pin(graph, pins, mesh, axis_name, node_pins)
    pinned["parameters, buffers"] = "placed as the step sharing them"


def _stored_as_zero_says(graph: PlanGraph, pins: dict[str, Pin], stage: int) -> dict[str, Pin]:
    """A data or context axis's pins, less its replicated-parameter pins where ZeRO-2/3 stores
    parameters split on the axis (FSDP over data and context axes alike; ZeRO's pins say how)."""
    return pins if stage < 2 else {n: p for n, p in pins.items() if graph.nodes[n].kind != PARAM}

def _checked_context_axes(mesh: Mesh, context_axes: tuple[str, ...], data_axes: tuple[str, ...],
                          input_sharded: bool) -> tuple[str, ...]:
    """``context_axes``, refused where they cannot be: not axes of the mesh, named twice or
    also as data axes, or with inputs arriving split (only along data axes, for now)."""
    for axis_name in context_axes:
        if axis_name not in mesh.names:
            raise InputError(f"context axis {axis_name!r} is not an axis of the mesh ({mesh.describe()})")
        if axis_name in data_axes:
            raise InputError(f"{axis_name!r} is named in both data_axes and context_axes: an axis splits the batch "
                             "or the sequence, not both")
    if len(set(context_axes)) != len(context_axes):
        raise InputError(f"context_axes {tuple(context_axes)} names an axis twice")
    if context_axes and input_sharded:
        raise InputError("input_sharded=True with context_axes: inputs arrive split along data axes only; pass the "
                         "whole sequence (every rank slices its own chunk)")
    return tuple(context_axes)


def _check_expert_axes(data_axes: tuple[str, ...], expert_axes: tuple[str, ...]) -> None:
    """An expert axis splits the batch too (tokens leave for their experts' ranks and come back),
    so it must be a data axis."""
    stray = [a for a in expert_axes if a not in data_axes]
    if stray:
        raise InputError(f"expert_axes {tuple(expert_axes)} names {', '.join(map(repr, stray))}, not in data_axes "
                         f"{tuple(data_axes)}: an expert axis splits the batch too (add it to data_axes)")


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

