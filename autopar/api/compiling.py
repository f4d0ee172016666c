"""``autopar.compile``: plan once (rank 0, the planner ``plan`` runs), make that plan on every rank
(``search.replay``), lay the device mesh out for it and build this rank's program and shards."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.config import PlanConfig, check, settled
from autopar.errors import CompileError, InputError, InputTypeError
from autopar.hardware import HardwareProfile
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline
from autopar.result.plan import Plan
from autopar.runtime.build import build_rank_module, whole_batch_leaves
from autopar.runtime.gloo import racing_dims
from autopar.runtime.gradient_check import check_trained_parameters
from autopar.runtime.groups import inherit_world_timeout
from autopar.runtime.mixed import compute_copy, running_precision
from autopar.runtime.module import ParallelModule
from autopar.runtime.parameters import InitFn
from autopar.runtime.pipeline import PipelinedModule, build_pipelined_module, carved_device_mesh, stage_device_mesh
from autopar.runtime.random import RandomSource, agree_seed
from autopar.runtime.rank_errors import agree, gather_errors, on_every_rank, on_rank_zero
from autopar.search import planner
from autopar.search.planned import PlannedStep
from autopar.search.problem import Problem, Problems, Step, first_place
from autopar.search.replay import pinned_pipeline, replay, run_axes


def compile(model: nn.Module, mesh: DeviceMesh | int, example_inputs: tuple[Any, ...] = (), *,
            loss_fn: Callable[..., torch.Tensor] | None = None, example_kwargs: dict[str, Any] | None = None,
            example_targets: tuple[Any, ...] = (), plan: Plan | dict[str, Any] | None = None,
            init_fn: InitFn | None = None, init_seed: int = 0, seed: int | None = None,
            hardware: str | HardwareProfile | None = None,
            replica_axis: str | None = None, _shared_state: dict[str, torch.Tensor] | None = None,
            **options: Any) -> ParallelModule | PipelinedModule:
    """Plan ``model``'s step for ``mesh`` and return this rank's module. Call on every rank with the same
    arguments; every rank passes the whole batch, or, with ``input_sharded=True``, its shard along
    ``data_axes`` (default: "dp").

    The step and ``options`` are ``autopar.plan``'s. The plan is made once: rank 0 searches, every rank
    makes rank 0's plan for its own capture of the step (``search.replay``) and the ranks check that they
    made the same one; ``plan=`` (a ``Plan`` or its JSON, e.g. the CLI's ``--json``) runs a saved plan
    without searching, refused with what differs when it was made for another model, mesh or options. A
    plan that pipelines lays ``mesh``'s ranks out for its axes (a depth taken out of the first axis); a 1-D
    mesh without axis names, or the world size as an int, leaves its axes to the planner (``search.layout``),
    the ranks laid out on them (``pm.device_mesh``; the plan's notes say what each layout gave). A
    model on the meta device is initialized module by module (``reset_parameters`` or ``init_fn``, seeded
    by ``init_seed`` and the module path) and only shards are kept. Random ops draw from one stream the
    module owns (``pm.generator``), seeded ``seed`` on every rank (None: rank 0's ``torch.initial_seed()``):
    with ``random_stream='counter'`` (the default) a counter-based stream, each rank computing only its own
    elements, so that a step equals the single-device step run under ``autopar.random.stream(seed)``; with
    ``'torch'`` every rank draws the global tensor from a torch generator. ``replica_axis``: an axis of
    identical, independent replicas (serving): each rank's module is planned and built on its replica's
    sub-mesh. Errors are raised on every rank. ``_shared_state``: another module's shards to run on.
    """
    mesh = _world_mesh(mesh) if isinstance(mesh, int) and not isinstance(mesh, bool) else mesh
    if not isinstance(mesh, DeviceMesh):  # every rank passes the same kind: each refuses it alike
        raise InputTypeError(f"compile runs on a torch DeviceMesh (torch.distributed.device_mesh.init_device_mesh"
                             f") or the world size (an int), got {type(mesh).__name__}" + (": an autopar.Mesh describes a mesh for planning "
                                                               "only (autopar.plan)" if isinstance(mesh, Mesh) else ""))
    _check_world(mesh)
    _warn_racing_workers(mesh)
    config = PlanConfig.from_options(**options)
    pipeline_pinned = isinstance(config.pipeline, Pipeline)
    mesh = _replica_mesh(mesh, replica_axis, config)
    planning_mesh = Mesh.from_device_mesh(mesh, hardware)
    config, unpipelined = _checked(config, planning_mesh, replica_axis)
    precision, compute_dtype, planned_model = on_every_rank("checking the model's precision", lambda: _planning_model(
        model, config.precision, planning_mesh))
    config = replace(config, precision=precision, masters=compute_dtype is not None)
    random = RandomSource(_agreed_seed(seed), exact_torch=config.random_stream == "torch")
    step = _step(planned_model, example_inputs, example_kwargs, example_targets, loss_fn, config, planning_mesh)
    whole = ""
    if plan is None:  # a plan given was made for this step already
        config, whole = on_every_rank("checking the loss", lambda: planner.whole_batch(step, config, pipeline_pinned))
    problems = Problems(step, config, unpipelined=whole or unpipelined)
    if config.pipeline is None:  # every rank captures the step at once, checked alike before rank 0 solves it
        first = on_every_rank("capturing the step", lambda: problems.at(first_place(config, planning_mesh)))
        agree("their captured steps differ", _fingerprint(first))
    chosen = _chosen_plan(plan, problems, planning_mesh)
    run_mesh = _laid_out(mesh, chosen, planning_mesh.open)
    made = on_every_rank("building the plan", lambda: replay(problems, Mesh.from_device_mesh(run_mesh, hardware),
                                                             chosen))
    agree("the plans made from rank 0's differ", made.plan.plan_hash())
    leaves = whole_batch_leaves(step.example_inputs, step.example_kwargs or {}, step.example_targets)
    return _built(model, run_mesh, made, (init_fn, init_seed, random), config.axes.input_sharded, compute_dtype,
                  leaves, _shared_state)


def _fingerprint(problem: Problem) -> str:
    """What a plan is made for: every node with its shapes and number of strategies left after pins, and
    the options that price them."""
    graph, ctx = problem.graph, problem.ctx
    items = [(n, graph.nodes[n].op, [m and list(m.shape) for m in graph.nodes[n].outputs],
              len(graph.nodes[n].strategies)) for n in graph.order]
    options = (ctx.mesh.to_json(), ctx.precision.name, ctx.train, ctx.inputs_whole, ctx.bucket_bytes,
               problem.memory_limit, problem.memory_options, ctx.micro_batches)
    return hashlib.sha256(repr((items, options)).encode()).hexdigest()[:16]


def _checked(config: PlanConfig, mesh: Mesh, replica_axis: str | None) -> tuple[PlanConfig, str]:
    """``config`` settled and checked on every rank (``config.settled``, ``config.check``), and why the default
    searches no pipeline; inputs arriving split default to the "dp" axis, replicas to no pipeline."""
    if config.axes.input_sharded and not config.axes.data and "dp" in mesh.names and not mesh.open:
        config = replace(config, axes=replace(config.axes, data=("dp",)))
    unpipelined = ""
    if replica_axis is not None and config.pipeline is True:
        config, unpipelined = replace(config, pipeline=None), "replicas (replica_axis) run unpipelined"
    on_every_rank("checking the options", lambda: check(config, mesh))
    config, why = settled(config, mesh)
    return config, unpipelined or why


def _step(model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, targets: tuple[Any, ...],
          loss_fn: Callable[..., torch.Tensor] | None, config: PlanConfig, mesh: Mesh) -> Step:
    """The step to plan: with inputs arriving split, this rank's shard stands for all of them (the global batch)."""
    if config.axes.input_sharded:
        ways = math.prod(mesh.axes[a] for a in config.axes.data)
        values = _global_batch(tuple((kwargs or {}).values()), ways)
        inputs, kwargs, targets = _global_batch(inputs, ways), dict(zip(kwargs or {}, values)), \
            _global_batch(targets, ways)
    return Step(model=model, example_inputs=inputs, example_kwargs=kwargs, example_targets=targets, loss_fn=loss_fn)


def _chosen_plan(plan: Plan | dict[str, Any] | None, problems: Problems, mesh: Mesh) -> Plan:
    """The plan every rank makes: rank 0's search, or the one given."""
    if plan is None:
        return Plan.from_json(on_rank_zero("planning", lambda: planner.search(problems, mesh).plan.to_json()))
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return on_every_rank("reading the plan", lambda: Plan.from_json(plan))
    raise InputTypeError(f"plan= takes an autopar.Plan or its JSON (Plan.to_json()), got {type(plan).__name__}")


def _laid_out(mesh: DeviceMesh, plan: Plan, open_axes: bool) -> DeviceMesh:
    """``mesh``'s ranks laid out on the axes ``plan`` runs on: as they are, with a pipeline depth taken out
    of the first axis, or (``open_axes``: a 1-D mesh without names) on the axes the planner chose (same
    ranks, reshaped; a collective). A plan for other axes is refused."""
    names = tuple(mesh.mesh_dim_names or ())
    given, axes = dict(zip(names, mesh.shape)), run_axes(plan)
    if given == axes:
        return mesh
    fits = math.prod(axes.values()) == mesh.size() if open_axes else _carves(given, axes, plan)
    gather_errors("laying the mesh out for the plan", "" if fits else
                  f"the plan runs on a mesh {axes}; this mesh is {given or mesh.size()}", InputError)
    return on_every_rank("laying the mesh out for the pipeline", lambda: carved_device_mesh(mesh, axes))


def _carves(given: dict[str, int], axes: dict[str, int], plan: Plan) -> bool:
    """Whether ``axes`` are ``given`` with the plan's pipeline depth taken out of the first axis."""
    pipe = plan.pipeline
    if pipe is None or not given or pipe.axis in given:
        return False
    first = next(iter(given))
    return given[first] % pipe.size == 0 and \
        Pipeline(axis=pipe.axis, from_axis=first).carved(given, pipe.size) == axes


def _built(model: nn.Module, mesh: DeviceMesh, step: PlannedStep, init: tuple[InitFn | None, int, RandomSource],
           input_sharded: bool, compute_dtype: torch.dtype | None, batch_leaves: frozenset[int],
           shared: dict[str, torch.Tensor] | None) -> ParallelModule | PipelinedModule:
    """This rank's module for the agreed plan (``init``: init_fn, init_seed, seed), built on every rank."""
    init_fn, init_seed, seed = init
    pipeline = pinned_pipeline(step.plan)
    stage_mesh = None if pipeline is None else on_every_rank("making the stage meshes", lambda: stage_device_mesh(
        mesh, pipeline.axis))
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


def _world_mesh(devices: int) -> DeviceMesh:
    """A 1-D DeviceMesh of the world's ranks, without axis names (the planner lays them out), on the device
    type of the world's backend; ``devices`` must be the world size."""
    _check_initialized()
    world = dist.get_world_size()
    if devices != world:
        raise InputError(f"compile(mesh={devices}): an int is the number of devices, which must be the world size "
                         f"({world} ranks)")
    device_type = "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world,))


def _warn_racing_workers(mesh: DeviceMesh) -> None:
    """Say where the mesh's gloo groups run torch's two worker threads, which race (``runtime.gloo``)."""
    racing = racing_dims(mesh)
    if racing:
        warnings.warn(f"the mesh's gloo groups on {', '.join(racing)} run two worker threads each, which in torch "
                      "2.13 race on the group's status and now and then corrupt the heap ('malloc(): unaligned "
                      "tcache chunk detected'): call autopar.runtime.gloo.one_worker_per_group() before "
                      "init_process_group", RuntimeWarning, stacklevel=3)


def _check_initialized() -> None:
    if not dist.is_initialized():
        raise CompileError("autopar.compile needs torch.distributed initialized (torchrun, init_process_group)")


def _check_world(mesh: DeviceMesh) -> None:
    _check_initialized()
    if mesh.size() != dist.get_world_size():
        raise CompileError(f"the mesh has {mesh.size()} devices ({tuple(mesh.shape)}) but the world has "
                           f"{dist.get_world_size()} ranks; they must match")


def _replica_mesh(mesh: DeviceMesh, axis: str | None, config: PlanConfig) -> DeviceMesh:
    """This rank's replica of ``mesh`` along ``axis`` (``compile(replica_axis=)``; None: ``mesh``): the
    mesh without that axis, checked on every rank first (a collective: the sub-mesh is made on every rank)."""
    if axis is None:
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    pinned = isinstance(config.pipeline, Pipeline)
    error = f"replica_axis {axis!r} is not an axis of the mesh {dict(zip(names, mesh.shape))}" \
        if axis not in names else "replica_axis with pipeline= is not supported yet" if pinned else ""
    gather_errors("checking replica_axis", error, InputError)
    return stage_device_mesh(mesh, axis)


def _planning_model(model: nn.Module, precision: str | None, mesh: Mesh) -> tuple[str, torch.dtype | None, nn.Module]:
    """The precision planned, the compute dtype run, and the model planned: with mixed precision
    the bf16 compute copy (the fp32 masters stay ``model``'s)."""
    precision, compute_dtype = running_precision(model, precision, mesh.hardware.default_precision)
    return precision, compute_dtype, model if compute_dtype is None else compute_copy(model, compute_dtype)


def _agreed_seed(seed: int | None) -> int:
    """``agree_seed``'s seed, its disagreement raised as a CompileError on every rank."""
    try:
        return agree_seed(seed)
    except ValueError as exc:
        raise CompileError(str(exc)) from None


def _global_batch(values: tuple[Any, ...], ways: int) -> tuple[Any, ...]:
    if not isinstance(values, tuple):
        return values  # capture names the wrong type on every rank
    return tuple(torch.cat([v] * ways) if isinstance(v, torch.Tensor) else v for v in values)
