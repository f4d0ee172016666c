"""``autopar.compile``: plan once, agree on it everywhere, build this rank's program and shards."""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import replace
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.utils._pytree import tree_leaves

from autopar.api import (PlannedStep, PreparedStep, finish_step, pipeline_options, plan_pipeline, plan_step,
                         prepare_step, solve_step)
from autopar.cost.buckets import DEFAULT_BUCKET_BYTES
from autopar.mesh import Mesh
from autopar.errors import InputError, InputTypeError
from autopar.runtime.gradient_check import check_trained_parameters
from autopar.runtime.groups import inherit_world_timeout
from autopar.runtime.mixed import compute_copy, running_precision
from autopar.runtime.ops import Comm
from autopar.problem.batch import example_batch
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline import (PipelinedModule, build_pipelined_module, carved_device_mesh,
                                      stage_device_mesh)
from autopar.runtime.program import rank_program, rank_signature, rank_state, step_loss_kind
from autopar.runtime.random import RandomSource, agree_seed
from autopar.errors import CompileError
from autopar.runtime.rank_errors import agree, describe_error, gather_errors, on_every_rank, on_rank_zero
from autopar.runtime.parameters import InitFn
from autopar.errors import MemoryLimitError
from autopar.pipeline.spec import Pipeline, as_pipeline

def _step_fingerprint(prepared: PreparedStep) -> str:
    """What rank 0's solution is applied to: every node with its shapes and number of
    strategies left after pins, and the options that price them."""
    graph, ctx = prepared.graph, prepared.ctx
    items = [(n, graph.nodes[n].op, [m and list(m.shape) for m in graph.nodes[n].outputs],
              len(graph.nodes[n].strategies)) for n in graph.order]
    options = (ctx.mesh.to_json(), ctx.precision.name, ctx.train, ctx.inputs_whole, ctx.bucket_bytes,
               prepared.memory_limit, prepared.memory_options, ctx.micro_batches)
    return hashlib.sha256(repr((items, options)).encode()).hexdigest()[:16]


def _agreed_seed(seed: int | None) -> int:
    """``agree_seed``'s seed, its disagreement raised as a CompileError on every rank."""
    try:
        return agree_seed(seed)
    except ValueError as exc:
        raise CompileError(str(exc)) from None


def compile(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple[Any, ...] = (), *,
            loss_fn: Callable[..., torch.Tensor] | None = None, example_kwargs: dict[str, Any] | None = None,
            example_targets: tuple[Any, ...] = (),
            train: bool = True, constraints: dict[str, object] | None = None, constraint_axis: str = "tp",
            data_axes: tuple[str, ...] = (), expert_axes: tuple[str, ...] = (), input_sharded: bool = False,
            context_axes: tuple[str, ...] = (), context_layout: str | None = None,
            context_attention: str | None = None, init_fn: InitFn | None = None,
            init_seed: int = 0, seed: int | None = None, random_stream: str = "counter",
            hardware: str | None = None, memory_limit: float | None = None, memory_headroom: float | None = None,
            precision: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            solver_time_limit_s: float = 120.0, zero: dict[str, int] | None = None, checkpoint: str | None = None,
            offload: bool | None = None, micro_batches: int | None = None,
            checkpoint_blocks: int | None = None, regather_blocks: int | None = None,
            pipeline: Pipeline | None = None, state_placements: dict[str, tuple[Placement, ...]] | None = None,
            replica_axis: str | None = None,
            _shared_state: dict[str, torch.Tensor] | None = None) -> ParallelModule | PipelinedModule:
    """Plan ``model``'s step for ``mesh`` and return this rank's ParallelModule.

    The step is ``loss_fn(model(*example_inputs, **example_kwargs), *example_targets)`` (with
    ``loss_fn=None`` the model returns its loss, as a Hugging Face model called with
    ``labels=``); the module is then called the same way: ``pm(*inputs, *targets, **kwargs)``.
    Call on every rank with the same arguments. Every rank passes the whole batch, or,
    with ``input_sharded=True``, its shard along ``data_axes`` (default: "dp"). ``expert_axes`` (expert
    parallelism), ``context_axes`` (the sequence split on them), ``context_layout`` and
    ``context_attention`` as in :func:`autopar.prepare_step`.
    ``memory_limit``, ``memory_headroom``, the memory pins (``zero``, ``checkpoint``, ``checkpoint_blocks``,
    ``regather_blocks``, ``offload``, ``micro_batches``) and ``pipeline`` as in :func:`autopar.plan`.
    A model on the meta device is initialized module by module (``reset_parameters`` or
    ``init_fn``, seeded by ``init_seed`` and the module path) and only shards are kept.
    Random ops (dropout, ``rand_like``, ...) draw from one stream the module owns
    (``pm.generator``), seeded ``seed`` on every rank (None: rank 0's
    ``torch.initial_seed()``). ``random_stream='counter'`` (the default): a counter-based
    stream, each rank computing only its own elements, the same values on any mesh, so a
    step equals the single-device step run under ``autopar.random.stream(seed)``;
    ``'torch'``: a torch generator from which every rank draws the global tensor, keeping its
    slice, so a step equals the single-device step drawing from the default generator seeded
    ``seed``, at the price of every rank drawing every element (``autopar.runtime.random``).

    The plan is solved once: every rank captures the step and lists its strategies (its
    program is generated from them), rank 0 alone solves the ILP and broadcasts the
    solution, and every rank builds the plan from it; the ranks check that they captured
    the same step and built plans with the same hash. Errors (mesh size != world size, a
    failure on any rank, ranks planning differently or passing different seeds) are
    raised on every rank. A pipeline's open choices are rank 0's search (``pipeline_search``).
    ``state_placements``: :func:`autopar.prepare_step`'s; ``_shared_state``: another module's shards to run on.
    ``replica_axis``: an axis of identical, independent replicas (serving): each rank's module is planned
    and built on its replica's sub-mesh (``mesh`` still covers the world).
    """
    if not isinstance(mesh, DeviceMesh):  # every rank passes the same kind: each refuses it alike
        raise InputTypeError(f"compile runs on a torch DeviceMesh (torch.distributed.device_mesh.init_device_mesh"
                             f"), got {type(mesh).__name__}" + (": an autopar.Mesh describes a mesh for planning "
                                                               "only (autopar.plan)" if isinstance(mesh, Mesh) else ""))
    if isinstance(pipeline, Pipeline) and pipeline.from_axis is not None:  # rank 0 chooses the depth first
        arguments = {k: v for k, v in locals().items() if k not in ("model", "mesh", "example_inputs", "pipeline")}
        mesh, pipeline = _chosen_depth(pipeline, model, mesh, example_inputs, arguments)
        return compile(model, mesh, example_inputs, pipeline=pipeline, **arguments)
    _check_world(mesh)
    mesh = _replica_mesh(mesh, replica_axis, pipeline)
    planning_mesh = Mesh.from_device_mesh(mesh, hardware)
    precision, compute_dtype, planned_model = on_every_rank("checking the model's precision", lambda: _planning_model(
        model, precision, planning_mesh))
    data_axes = data_axes or (("dp",) if input_sharded and "dp" in planning_mesh.names else ())
    gather_errors("checking the mesh axes", _axes_error(planning_mesh, data_axes, input_sharded,
                                                        constraint_axis if constraints else None), InputError)
    if random_stream not in ("counter", "torch"):
        raise InputError(f"random_stream={random_stream!r}: pass 'counter' or 'torch'")
    seed = RandomSource(_agreed_seed(seed), exact_torch=random_stream == "torch")
    full_mesh, stage_mesh = planning_mesh, None
    if pipeline is not None:
        planning_mesh, stage_mesh, pipeline = _stage_meshes(pipeline, mesh, full_mesh, data_axes, zero, offload,
                                                            micro_batches)
    if input_sharded:  # plan for the global batch: this rank's shard stands for all of them
        example_inputs, example_kwargs, example_targets = _global_examples(
            example_inputs, example_kwargs, example_targets, math.prod(planning_mesh.axes[a] for a in data_axes))
    options = dict(loss_fn=loss_fn, example_kwargs=example_kwargs, example_targets=example_targets, train=train,
                   constraints=constraints, constraint_axis=constraint_axis, data_axes=data_axes,
                   expert_axes=expert_axes, input_sharded=input_sharded, context_axes=context_axes,
                   context_layout=context_layout, context_attention=context_attention, memory_limit=memory_limit,
                   memory_headroom=memory_headroom, precision=precision, bucket_bytes=bucket_bytes,
                   solver_time_limit_s=solver_time_limit_s, zero=zero,
                   checkpoint=checkpoint, checkpoint_blocks=checkpoint_blocks, regather_blocks=regather_blocks,
                   offload=offload, state_placements=state_placements, random_stream=random_stream,
                   _masters=compute_dtype is not None)
    step, pipeline = _planned(pipeline, planned_model, planning_mesh, full_mesh, example_inputs, micro_batches,
                              options)
    batch_leaves = whole_batch_leaves(example_inputs, example_kwargs or {}, example_targets)
    return _built(model, mesh, stage_mesh, step, pipeline, (init_fn, init_seed, seed), input_sharded, compute_dtype,
                  batch_leaves, _shared_state)


def _built(model: nn.Module, mesh: DeviceMesh, stage_mesh: DeviceMesh | None, step: PlannedStep,
           pipeline: Pipeline | None, init: tuple[InitFn | None, int, RandomSource], input_sharded: bool,
           compute_dtype: torch.dtype | None, batch_leaves: frozenset[int],
           shared: dict[str, torch.Tensor] | None) -> ParallelModule | PipelinedModule:
    """This rank's module for the agreed plan (``init``: init_fn, init_seed, seed), built on every rank."""
    init_fn, init_seed, seed = init
    for device_mesh in (mesh, stage_mesh) if stage_mesh is not None else (mesh,):
        inherit_world_timeout(device_mesh)
    # rank 0 alone: every rank planned the same step (agreed by hash)
    on_rank_zero("checking the plan's gradients against autograd",
                 lambda: check_trained_parameters(step.captured, step.graph))
    if pipeline is not None:
        assert stage_mesh is not None
        return on_every_rank("building the rank's stages", lambda: build_pipelined_module(
            model, mesh, stage_mesh, step, pipeline, init_fn, input_sharded, init_seed, seed, compute_dtype,
            batch_leaves, shared))
    return on_every_rank("building the rank's program", lambda: build_rank_module(
        model, mesh, step, init_fn, input_sharded, init_seed, seed, compute_dtype, batch_leaves, shared))


def _planned(pipeline: Pipeline | None, model: nn.Module, planning_mesh: Mesh, full_mesh: Mesh,
             example_inputs: tuple[Any, ...], micro_batches: int | None, options: dict[str, Any]
             ) -> tuple[PlannedStep, Pipeline | None]:
    """The step every rank runs, planned as ``plan`` plans it (rank 0 solving), and the pipeline
    with every choice made (None: no pipeline)."""
    if pipeline is not None:
        pipeline = _chosen_pipeline(pipeline, model, full_mesh, example_inputs, options)
        return _pipelined_everywhere(pipeline, model, planning_mesh, full_mesh, example_inputs, options), pipeline
    prepared: PreparedStep = on_every_rank("planning", lambda: prepare_step(
        model, planning_mesh, example_inputs, micro_batches=micro_batches, **options))
    return _solved_everywhere(prepared), None


def _check_world(mesh: DeviceMesh) -> None:
    if not dist.is_initialized():
        raise CompileError("autopar.compile needs torch.distributed initialized (torchrun, init_process_group)")
    if mesh.size() != dist.get_world_size():
        raise CompileError(f"the mesh has {mesh.size()} devices ({tuple(mesh.shape)}) but the world has "
                           f"{dist.get_world_size()} ranks; they must match")


def _replica_mesh(mesh: DeviceMesh, axis: str | None, pipeline: Pipeline | None) -> DeviceMesh:
    """This rank's replica of ``mesh`` along ``axis`` (``compile(replica_axis=)``; None: ``mesh``): the
    mesh without that axis, checked on every rank first (a collective: the sub-mesh is made on every rank)."""
    if axis is None:
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    error = f"replica_axis {axis!r} is not an axis of the mesh {dict(zip(names, mesh.shape))}" \
        if axis not in names else "replica_axis with pipeline= is not supported yet" if pipeline is not None else ""
    gather_errors("checking replica_axis", error, InputError)
    return stage_device_mesh(mesh, axis)


def _stage_meshes(pipeline: Pipeline, mesh: DeviceMesh, full_mesh: Mesh, data_axes: tuple[str, ...],
                  zero: dict[str, int] | None, offload: bool | None, micro_batches: int | None
                  ) -> tuple[Mesh, DeviceMesh, Pipeline]:
    """The pipeline checked on every rank, then the mesh its stages are planned on and the
    stage DeviceMesh (a collective: made before anything may fail on one rank), and the pipeline
    (``as_pipeline``: its one number of stages per rank filled in)."""
    gather_errors("checking the pipeline", _pipeline_error(pipeline, full_mesh, data_axes, zero, offload,
                                                            micro_batches), InputError)
    return pipeline.stage_mesh(full_mesh), stage_device_mesh(mesh, pipeline.axis), as_pipeline(pipeline)


def _global_examples(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, targets: tuple[Any, ...], ways: int
                     ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
    """This rank's shard of the example values, ``ways`` times along the batch: the global batch."""
    values = _global_batch(tuple((kwargs or {}).values()), ways)
    return _global_batch(inputs, ways), dict(zip(kwargs or {}, values)), _global_batch(targets, ways)


def _chosen_pipeline(pipeline: Pipeline, model: nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...],
                     options: dict[str, Any]) -> Pipeline:
    """``pipeline`` with every choice made: as given when pinned, else rank 0's search
    (``pipeline_search``) handed to every rank, whose stages are then planned as pinned."""
    if pipeline.pinned:
        return pipeline
    def search() -> tuple[str, int, int]:  # what the ranks need of rank 0's plan, not the plan
        chosen = plan_step(model, mesh, example_inputs, pipeline=pipeline, **options).plan.pipeline
        assert chosen is not None
        return chosen.schedule, chosen.micro_batches, chosen.virtual_stages
    schedule, m, v = on_rank_zero("choosing the pipeline", search)
    return replace(pipeline, schedule=schedule, micro_batches=m, virtual_stages=v)


def _chosen_depth(pipeline: Pipeline, model: nn.Module, mesh: DeviceMesh, example_inputs: tuple[Any, ...],
                  arguments: dict[str, Any]) -> tuple[DeviceMesh, Pipeline | None]:
    """Rank 0's choice of how many pp ranks to take ``from_axis`` (``pipeline_depth``), every
    choice of the pipeline made: the mesh laid out for it (a collective) and the pinned pipeline
    (None: no pipeline), which every rank then compiles as given."""
    _check_world(mesh)
    planning_mesh = Mesh.from_device_mesh(mesh, arguments["hardware"])
    error = "input_sharded=True with Pipeline(from_axis=...): each rank's shard of the batch depends on the " \
            "depth chosen; pass the whole batch or name the pipeline axis in the mesh" if arguments["input_sharded"] \
        else _depth_error(pipeline, planning_mesh)
    gather_errors("checking the pipeline", error, InputError)

    def search() -> tuple[int, str, int, int] | None:
        precision, compute_dtype, planned_model = _planning_model(model, arguments["precision"], planning_mesh)
        options = {k: v for k, v in arguments.items() if k not in ("init_fn", "init_seed", "seed", "hardware",
                                                                  "_shared_state", "replica_axis")}
        chosen = plan_step(planned_model, planning_mesh, example_inputs, pipeline=pipeline,
                           **{**options, "precision": precision, "_masters": compute_dtype is not None}).plan.pipeline
        return None if chosen is None else (chosen.size, chosen.schedule, chosen.micro_batches, chosen.virtual_stages)
    chosen = on_rank_zero("choosing the pipeline depth", search)
    if chosen is None:
        return mesh, None
    depth, schedule, m, v = chosen
    carved = on_every_rank("laying the mesh out for the pipeline", lambda: carved_device_mesh(
        mesh, pipeline.carved(planning_mesh.axes, depth)))
    return carved, replace(pipeline, from_axis=None, schedule=schedule, micro_batches=m, virtual_stages=v)


def _planning_model(model: nn.Module, precision: str | None, mesh: Mesh
                    ) -> tuple[str, torch.dtype | None, nn.Module]:
    """The precision planned, the compute dtype run, and the model planned: with mixed precision
    the bf16 compute copy (the fp32 masters stay ``model``'s)."""
    precision, compute_dtype = running_precision(model, precision, mesh.hardware.default_precision)
    return precision, compute_dtype, model if compute_dtype is None else compute_copy(model, compute_dtype)


def _depth_error(pipeline: Pipeline, mesh: Mesh) -> str:
    try:
        pipeline.check(mesh.axes)
    except InputError as exc:
        return describe_error(exc)
    return ""


def _pipelined_everywhere(pipeline: Pipeline, model: nn.Module, stage_mesh: Mesh, full_mesh: Mesh,
                          example_inputs: tuple[Any, ...], options: dict[str, Any]) -> PlannedStep:
    """The pinned ``pipeline``'s step on every rank, planned as ``plan`` plans it
    (``api.plan_pipeline``: the stage mesh's ILP without the memory limit, again under it only
    when the pipeline does not fit), each ILP solved by rank 0: the plan that runs is the one
    ``plan``, and rank 0's search, priced."""
    def plan_stage_mesh(stage_options: dict[str, Any]) -> PlannedStep:
        return _solved_everywhere(on_every_rank("planning", lambda: prepare_step(
            model, stage_mesh, example_inputs, **stage_options)), keep_memory_errors=True)
    step = on_every_rank("planning the pipeline", lambda: plan_pipeline(
        pipeline, full_mesh, example_inputs, options, plan_stage_mesh,
        prepare_stage_mesh=lambda o: prepare_step(model, stage_mesh, example_inputs, **o)))
    agree("the pipelined plans built from rank 0's solutions differ", step.plan.plan_hash())
    return step


def _solved_everywhere(prepared: PreparedStep, keep_memory_errors: bool = False) -> PlannedStep:
    """Rank 0 solves the step every rank prepared; every rank builds the plan from its solution,
    and the ranks check they agree at each end."""
    agree("their captured steps differ", _step_fingerprint(prepared))  # before rank 0 spends time solving
    start = time.perf_counter()
    solution = on_rank_zero("solving the plan", lambda: solve_step(prepared),
                            MemoryLimitError if keep_memory_errors else None)
    prepared.timings["solve"] = time.perf_counter() - start  # this rank's wall time: solving or waiting
    step: PlannedStep = on_every_rank("building the plan", lambda: finish_step(prepared, solution))
    agree("the plans built from rank 0's solution differ", step.plan.plan_hash())
    return step


def _axes_error(mesh: Mesh, data_axes: tuple[str, ...], input_sharded: bool, constraint_axis: str | None) -> str:
    """What is wrong with the mesh axes the options name ("" if nothing), checked before
    anything uses them. An unnamed DeviceMesh's axes are dim0, dim1, ... as in its plan."""
    axes = f"the mesh's axes are {mesh.names} ({mesh.describe()})"
    if isinstance(data_axes, str):
        return f"data_axes must be a tuple of axis names (write ({data_axes!r},)), got {data_axes!r}; {axes}"
    if input_sharded and not data_axes:
        return f"input_sharded=True needs data_axes=(...) naming the axes inputs are split on; {axes}"
    unknown = [a for a in data_axes if a not in mesh.names]
    if unknown:
        return f"data_axes {tuple(data_axes)} names {', '.join(map(repr, unknown))}, not an axis of the mesh; {axes}"
    if len(set(data_axes)) != len(data_axes):
        return f"data_axes {tuple(data_axes)} names an axis twice; {axes}"
    if constraint_axis is not None and constraint_axis not in mesh.names:
        return f"constraints apply to mesh axis {constraint_axis!r} (constraint_axis=), not an axis of the mesh; {axes}"
    return ""


def _pipeline_error(pipeline: Pipeline, mesh: Mesh, data_axes: tuple[str, ...], zero: dict[str, int] | None,
                    offload: bool | None, micro_batches: int | None) -> str:
    """What is wrong with ``pipeline=`` and the options beside it ("" if nothing)."""
    try:
        pipeline_options(as_pipeline(pipeline), mesh, {"data_axes": data_axes, "zero": zero, "offload": offload,
                                                       "micro_batches": micro_batches})
    except InputError as exc:
        return describe_error(exc)
    return ""


def _global_batch(values: tuple[Any, ...], ways: int) -> tuple[Any, ...]:
    if not isinstance(values, tuple):
        return values  # capture names the wrong type on every rank
    return tuple(torch.cat([v] * ways) if isinstance(v, torch.Tensor) else v for v in values)


def build_rank_module(model: nn.Module, mesh: DeviceMesh, step: PlannedStep, init_fn: InitFn | None = None,
                      input_sharded: bool = False, init_seed: int = 0, seed: RandomSource = RandomSource(0),
                      compute_dtype: torch.dtype | None = None, batch_leaves: frozenset[int] = frozenset(),
                      shared: dict[str, torch.Tensor] | None = None) -> ParallelModule:
    """This rank's ParallelModule for an agreed plan (no collectives: usable under a fake
    process group to inspect the generated program). With ``compute_dtype`` (mixed
    precision; the step captured from ``mixed.compute_copy``) the parameters stay
    ``model``'s fp32 masters and the program reads them cast (``passes.cast_parameters``).
    ``batch_leaves``: the step's input leaves cut into micro-batches (``whole_batch_leaves``);
    ``shared``: state taken from another module (``rank_state``)."""
    kind = step_loss_kind(step)  # refused before anything is built
    comm = Comm(mesh, step.ctx.mesh.zigzag_dims())
    program = rank_program(step, mesh, comm, seed, compute_dtype, input_sharded)
    state = rank_state(model, mesh, step, init_fn, init_seed, compute_dtype, shared=shared)
    outputs = []
    for out_name in step.graph.output_names:
        strategy = step.chosen.get(out_name)
        outputs.append(None if step.ctx.train or strategy is None else strategy.outputs[0])
    return ParallelModule(gm=program, plan=step.plan, device_mesh=mesh, comm=comm, placeholders=state.placeholders,
                          local=state.local, placements=state.placements, tied=step.captured.tied,
                          output_placements=outputs, input_sharded=input_sharded, frozen=state.frozen,
                          signature=rank_signature(step, mesh, input_sharded, batch_leaves), loss_kind=kind,
                          loss_dtype=torch.float32 if compute_dtype is not None and step.ctx.train else None,
                          transient=state.transient)


def whole_batch_leaves(inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: tuple[Any, ...]) -> frozenset[int]:
    """The step's leaves (in ``StepSignature`` order) whose leading dim is the batch: those
    ``micro_batches`` cuts (as ``memory.options.slice_batch`` cut the examples)."""
    batch = example_batch((inputs, kwargs, targets))
    leaves = tree_leaves((*inputs, *kwargs.values(), *targets))
    return frozenset(i for i, leaf in enumerate(leaves)
                     if isinstance(leaf, torch.Tensor) and leaf.ndim and leaf.shape[0] == batch)
