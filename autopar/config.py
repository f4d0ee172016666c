"""A plan's options in one place: frozen, keyword-only dataclasses with a docstring per field,
and ``check``, the one function that validates them against a mesh.

``plan``, ``compile``, ``compile_serving`` and the command line build a ``PlanConfig`` from their
keyword arguments (``PlanConfig.from_options``: ``data_axes=``, ``zero=``, ``memory_limit=``, ...
are the friendly spelling of its fields, ``OPTIONS`` maps one to the other), and every level of the
search reads it. Checks that need the captured step (an expert axis with no expert weights, more
checkpointed blocks than the model has) are made where the step is captured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.tensor import Placement

from autopar.cost.buckets import DEFAULT_BUCKET_BYTES
from autopar.errors import InputError, InputTypeError
from autopar.memory.options import MemoryOptions, check_zero
from autopar.mesh import Mesh
from autopar.pipeline.spec import Pipeline, as_pipeline
from autopar.rules import DEFAULT_RULES, RuleSet

BUCKET_ALIGN_BYTES = 8
"""``bucket_bytes`` is a multiple of this: a whole number of elements of any gradient dtype."""
RANDOM_STREAMS = ("counter", "torch")
"""How random ops draw: a counter-based stream, each rank computing its own elements; or torch's
generator, every rank drawing the global tensor (``runtime.random``)."""
CONTEXT_LAYOUTS = (None, "contiguous", "zigzag")


@dataclass(frozen=True, kw_only=True)
class AxesConfig:
    """What the mesh axes are pinned to do."""

    data: tuple[str, ...] = ()
    """Axes that split the batch (data parallelism): parameters replicated there (or stored split
    under ZeRO-2/3), every user input split along its leading dim."""
    expert: tuple[str, ...] = ()
    """Data axes that also split stacked expert weights by expert, tokens reaching their experts by
    all-to-all (expert parallelism)."""
    context: tuple[str, ...] = ()
    """Axes that split the sequence (context parallelism): parameters replicated, every user input's
    dim 1 split there, attention on each rank's query rows."""
    constraints: Mapping[str, object] | None = None
    """A hand-written tensor-parallel plan (``torch.distributed.tensor.parallel`` styles by module
    pattern, as torchtitan writes them), pinned on ``constraint_axis``."""
    constraint_axis: str = "tp"
    """The axis ``constraints`` pins."""
    input_sharded: bool = False
    """Each rank receives its own shard of the batch along ``data``, not the whole batch."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The memory limit, and the memory choices pinned (None: the planner decides by the limit)."""

    limit_bytes: float | None = None
    """Bytes per device a plan must fit in; None: the device's memory less ``headroom``."""
    headroom: float | None = None
    """Fraction of device memory the default limit leaves free; None: the hardware profile's."""
    zero: Mapping[str, int] | None = None
    """Data axis -> ZeRO stage (0-3) of every trainable parameter there (``memory.options``)."""
    checkpoint: str | None = None
    """Activation checkpointing of the repeated blocks: 'none', 'selective', 'selective_op' (torchtitan's
    op-level policy: attention and every other linear matmul kept) or 'full'."""
    checkpoint_blocks: int | None = None
    """How many repeated blocks checkpoint, the first ones; None: all when ``checkpoint`` is pinned."""
    regather_blocks: int | None = None
    """With ZeRO-3 pinned: the first this many blocks' parameters are gathered again in backward."""
    offload: bool | None = None
    """True: every trainable parameter's optimizer state on the host; False: none; None: the planner's."""
    micro_batches: int | None = None
    """The step's batch runs as this many micro-batches (gradient accumulation)."""

    def options(self, *, pipelined: bool = False) -> MemoryOptions:
        """The pins as the memory scenarios read them; a pipeline's stage mesh offloads nothing and
        shards no optimizer state on its own (its runtime runs neither yet)."""
        return MemoryOptions(zero=dict(self.zero) if self.zero is not None else None, checkpoint=self.checkpoint,
                             checkpoint_blocks=self.checkpoint_blocks, regather_blocks=self.regather_blocks,
                             offload=False if pipelined else self.offload, micro_batches=self.micro_batches,
                             zero1_allowed=not pipelined)

    def limit(self, mesh: Mesh) -> float:
        """Bytes per device the plan must fit in: given, or the device's memory less headroom."""
        if self.limit_bytes is None:
            return mesh.hardware.memory_limit(self.headroom)
        return float(self.limit_bytes)

    def limit_origin(self, mesh: Mesh) -> str:
        """Where the limit comes from, for a memory-limit error ("" when the user gave it)."""
        if self.limit_bytes is not None:
            return ""
        return mesh.hardware.memory_limit_origin(self.headroom) + ": memory_headroom= or --memory-headroom changes it"


@dataclass(frozen=True, kw_only=True)
class ContextConfig:
    """How a sequence split on the context axes is laid out and attended."""

    layout: str | None = None
    """'contiguous' or 'zigzag' chunks; None: the planner keeps the faster."""
    attention: str | None = None
    """'ring', 'allgather' or 'ulysses'; None: the solver's choice per attention call."""


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    """What the ILP solver and the gradient buckets are given."""

    time_limit_s: float = 120.0
    """Seconds HiGHS may search one ILP; a plan found by then is returned and says it is not proven optimal."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Size of a gradient all-reduce bucket (DDP's ``bucket_cap_mb``)."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Everything a plan is asked for besides the model, its example step and the mesh."""

    train: bool = True
    """Plan a training step (forward, loss, backward, optimizer); False: forward only."""
    precision: str | None = None
    """'bf16' (mixed) or 'fp32'; None: the hardware profile's default."""
    random_stream: str = "counter"
    """How random ops draw, priced so: one of ``RANDOM_STREAMS``."""
    axes: AxesConfig = field(default_factory=AxesConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    pipeline: Pipeline | bool | None = True
    """A pipeline on one mesh axis (its open choices searched), or taken out of a mesh axis
    (``Pipeline(from_axis=...)``: the depth searched too). True (the default): the depth searched out of
    the mesh's first axis wherever a training step can pipeline (``settled``). False or None: no pipeline."""
    context: ContextConfig = field(default_factory=ContextConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    state_placements: Mapping[str, tuple[Placement, ...]] | None = None
    """Parameter and buffer FQN -> placements pinned on every axis: another step's, to share its state
    (``compile_serving``)."""
    rules: RuleSet = DEFAULT_RULES
    """The sharding rules by op."""
    masters: bool = False
    """The model planned is the bf16 compute copy of fp32 masters (``compile``'s mixed precision), not a
    bf16 model, which keeps no masters."""

    @classmethod
    def from_options(cls, **options: Any) -> PlanConfig:
        """A config from the keyword arguments ``plan`` and ``compile`` take (``OPTIONS``); a name that
        is none of them is refused."""
        sections: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for name, value in options.items():
            if name not in OPTIONS:
                raise InputTypeError(f"unknown option {name}={value!r}; the options are {', '.join(sorted(OPTIONS))}")
            section, attr = OPTIONS[name]
            (sections.setdefault(section, {}) if section else top)[attr] = value
        kinds = {"axes": AxesConfig, "memory": MemoryConfig, "context": ContextConfig, "solver": SolverConfig}
        built = {section: kinds[section](**values) for section, values in sections.items()}
        return cls(**top, **built)

    def with_options(self, **options: Any) -> PlanConfig:
        """This config with some options changed (``OPTIONS``' names)."""
        changed = PlanConfig.from_options(**options)
        out = self
        for name in options:
            section, attr = OPTIONS[name]
            if section:
                part = replace(getattr(out, section), **{attr: getattr(getattr(changed, section), attr)})
                out = replace(out, **{section: part})
            else:
                out = replace(out, **{attr: getattr(changed, attr)})
        return out


OPTIONS: dict[str, tuple[str, str]] = {
    "train": ("", "train"), "precision": ("", "precision"), "random_stream": ("", "random_stream"),
    "pipeline": ("", "pipeline"), "state_placements": ("", "state_placements"), "rules": ("", "rules"),
    "data_axes": ("axes", "data"), "expert_axes": ("axes", "expert"), "context_axes": ("axes", "context"),
    "constraints": ("axes", "constraints"), "constraint_axis": ("axes", "constraint_axis"),
    "input_sharded": ("axes", "input_sharded"),
    "memory_limit": ("memory", "limit_bytes"), "memory_headroom": ("memory", "headroom"), "zero": ("memory", "zero"),
    "checkpoint": ("memory", "checkpoint"), "checkpoint_blocks": ("memory", "checkpoint_blocks"),
    "regather_blocks": ("memory", "regather_blocks"), "offload": ("memory", "offload"),
    "micro_batches": ("memory", "micro_batches"),
    "context_layout": ("context", "layout"), "context_attention": ("context", "attention"),
    "solver_time_limit_s": ("solver", "time_limit_s"), "bucket_bytes": ("solver", "bucket_bytes"),
}
"""Keyword argument of ``plan``/``compile`` -> (section of ``PlanConfig``, field); "" the config itself."""

AXIS_OPTIONS = ("data_axes", "expert_axes", "context_axes")
"""Options naming mesh axes: tuples of names, never a string (read as its letters)."""


def check(config: PlanConfig, mesh: Mesh) -> None:
    """Refuse, with a message naming the option, whatever in ``config`` no plan on ``mesh`` can take;
    run once, before anything is captured. A pipeline's axes are checked against the whole mesh."""
    _check_types(config)
    if mesh.open:
        _check_open(config, mesh)
    axes = config.axes
    _check_data_axes(axes, mesh)
    _check_context_axes(axes, mesh)
    if axes.constraints and axes.constraint_axis not in mesh.names:
        raise InputError(f"constraints apply to mesh axis {axes.constraint_axis!r} (constraint_axis=), not an axis of "
                         f"the mesh; the mesh's axes are {mesh.names} ({mesh.describe()})")
    if config.random_stream not in RANDOM_STREAMS:
        raise InputError(f"random_stream={config.random_stream!r}: pass 'counter' or 'torch'")
    _check_solver(config.solver)
    _check_memory(config.memory, mesh)
    if config.context.layout not in CONTEXT_LAYOUTS:
        raise InputError(f"context_layout is 'contiguous', 'zigzag' or None (the faster), got {config.context.layout!r}")
    if isinstance(config.pipeline, Pipeline):
        _check_pipeline(config, mesh)


def _check_types(config: PlanConfig) -> None:
    """The options naming mesh axes are tuples (or lists) of axis names, ``zero`` a dict."""
    for option in AXIS_OPTIONS:
        section, attr = OPTIONS[option]
        value = getattr(getattr(config, section), attr) or ()
        if isinstance(value, str):
            raise InputTypeError(f"{option} must be a tuple of axis names (write ({value!r},)), got {value!r}")
        if not isinstance(value, (tuple, list)) or not all(isinstance(a, str) for a in value):
            raise InputTypeError(f"{option} must be a tuple of axis names, got {value!r}")
    check_zero(config.memory.zero)
    if not isinstance(config.pipeline, bool) and config.pipeline is not None:
        as_pipeline(config.pipeline)


def _check_open(config: PlanConfig, mesh: Mesh) -> None:
    """A mesh whose axes the planner lays out takes no option naming an axis."""
    axes, memory = config.axes, config.memory
    named = [name for name, given in (
        ("data_axes", axes.data), ("expert_axes", axes.expert), ("context_axes", axes.context),
        ("constraints", axes.constraints), ("input_sharded", axes.input_sharded), ("zero", memory.zero),
        ("pipeline", isinstance(config.pipeline, Pipeline)), ("state_placements", config.state_placements))
        if given]
    if named:
        raise InputError(f"{', '.join(named)} {'names' if len(named) == 1 else 'name'} mesh axes, and the mesh "
                         f"({mesh.describe()}) leaves its axes to the planner: pass a mesh with axes, such as "
                         "Mesh({'dp': 8, 'tp': 8}) or a DeviceMesh with mesh_dim_names, to pin them")


def _check_data_axes(axes: AxesConfig, mesh: Mesh) -> None:
    where = f"the mesh's axes are {mesh.names} ({mesh.describe()})"
    unknown = [a for a in axes.data if a not in mesh.names]
    if unknown:
        raise InputError(f"data_axes {tuple(axes.data)} names {', '.join(map(repr, unknown))}, not an axis of the "
                         f"mesh; {where}")
    if len(set(axes.data)) != len(axes.data):
        raise InputError(f"data_axes {tuple(axes.data)} names an axis twice; {where}")
    stray = [a for a in axes.expert if a not in axes.data]
    if stray:  # tokens leave for their experts' ranks and come back: the axis splits the batch
        raise InputError(f"expert_axes {tuple(axes.expert)} names {', '.join(map(repr, stray))}, not in data_axes "
                         f"{tuple(axes.data)}: an expert axis splits the batch too (add it to data_axes)")
    if axes.input_sharded and not axes.data:
        raise InputError(f"input_sharded=True needs data_axes=(...) naming the axes inputs are split on; {where}")


def _check_context_axes(axes: AxesConfig, mesh: Mesh) -> None:
    for name in axes.context:
        if name not in mesh.names:
            raise InputError(f"context axis {name!r} is not an axis of the mesh ({mesh.describe()})")
        if name in axes.data:
            raise InputError(f"{name!r} is named in both data_axes and context_axes: an axis splits the batch "
                             "or the sequence, not both")
    if len(set(axes.context)) != len(axes.context):
        raise InputError(f"context_axes {tuple(axes.context)} names an axis twice")
    if axes.context and axes.input_sharded:
        raise InputError("input_sharded=True with context_axes: inputs arrive split along data axes only; pass the "
                         "whole sequence (every rank slices its own chunk)")


def _check_solver(solver: SolverConfig) -> None:
    bucket = solver.bucket_bytes
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket <= 0 or bucket % BUCKET_ALIGN_BYTES:
        raise InputError(f"bucket_bytes must be a positive whole number of bytes, a multiple of "
                         f"{BUCKET_ALIGN_BYTES} (so that gradients of any dtype fill a bucket exactly), got {bucket!r}")
    limit = solver.time_limit_s
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise InputError(f"solver_time_limit_s must be a positive number of seconds, got {limit!r}")


def _check_memory(memory: MemoryConfig, mesh: Mesh) -> None:
    if memory.limit_bytes is not None:
        if memory.headroom is not None:
            raise InputError("pass memory_limit (bytes per device) or memory_headroom (a fraction of device "
                             "memory), not both")
        limit = memory.limit_bytes
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0 or math.isnan(limit):
            raise InputError(f"memory_limit must be a positive number of bytes per device, got {limit!r}")
    else:
        mesh.hardware.memory_limit(memory.headroom)  # refuses a headroom outside [0, 1)
    memory.options().check(mesh.names)


def settled(config: PlanConfig, mesh: Mesh) -> tuple[PlanConfig, str]:
    """``config`` (checked: ``check``) with its pipeline a ``Pipeline`` or None, and why the default searches
    none ("" when it does, or when the pipeline was given). The default (True) is
    ``Pipeline(from_axis=<first axis>)``: every depth of the mesh's first axis, 1 (no pipeline) among them,
    for a training step whose other options a pipeline can run beside; else no pipeline. An open mesh's
    config is left as it is: each layout settles its own (``search.layout``)."""
    if mesh.open:
        return config, ""
    if isinstance(config.pipeline, bool) or config.pipeline is None:
        why = _unpipelined(config, mesh) if config.pipeline else ""
        searched = Pipeline(from_axis=mesh.names[0]) if config.pipeline and not why else None
        return replace(config, pipeline=searched), why
    return config, ""


def _unpipelined(config: PlanConfig, mesh: Mesh) -> str:
    """Why the default pipeline search leaves ``config`` unpipelined on ``mesh`` ("" when it searches)."""
    first = mesh.names[0]  # a mesh has at least one axis
    if not config.train:
        return "a forward-only step (compile_serving pipelines its steps with pipeline=Pipeline(axis=...))"
    if mesh.axes[first] < 2:
        return "the mesh's first axis has one rank: no depth to take out of it"
    if Pipeline().axis in mesh.names:
        return f"the mesh names a {Pipeline().axis!r} axis: Pipeline(axis={Pipeline().axis!r}) lays stages on it"
    if config.state_placements is not None:
        return "the parameters' placements are another step's (state_placements)"
    return _pipeline_refusal(config, Pipeline(from_axis=first))


def _check_pipeline(config: PlanConfig, mesh: Mesh) -> None:
    """A pipeline, and the options beside it, checked against the whole mesh."""
    pipeline = as_pipeline(config.pipeline)
    pipeline.check(mesh.axes)
    refused = _pipeline_refusal(config, pipeline)
    if refused:
        raise InputError(refused)


def _pipeline_refusal(config: PlanConfig, pipeline: Pipeline) -> str:
    """What among the options beside ``pipeline`` no pipelined step can run ("" when nothing)."""
    memory = config.memory
    if memory.micro_batches is not None:
        return (f"micro_batches={memory.micro_batches} with a pipeline: a pipelined step runs the "
                "pipeline's micro-batches (Pipeline(micro_batches=...); leave micro_batches out)")
    for option, names in (("data_axes", config.axes.data), ("context_axes", config.axes.context),
                          ("zero", memory.zero or {})):
        if pipeline.axis in names:
            return f"{option} names the pipeline axis {pipeline.axis!r}: it holds stages, not data"
    if memory.offload or 1 in (memory.zero or {}).values():
        return "a pipelined step does not yet offload optimizer state or run ZeRO-1 (zero stage 1)"
    if pipeline.from_axis is not None and config.axes.input_sharded:
        return ("input_sharded=True with Pipeline(from_axis=...): each rank's shard of the batch depends on "
                "the depth chosen; pass the whole batch or name the pipeline axis in the mesh")
    return ""


def as_mesh(mesh: Any) -> Mesh:
    """A planning mesh from what ``plan`` takes: an ``autopar.Mesh``, a dict of axis sizes or a DeviceMesh."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, dict):
        return Mesh(mesh)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        return Mesh.from_device_mesh(mesh)
    raise InputTypeError(f"mesh must be an autopar.Mesh, a dict of axis sizes or a DeviceMesh, "
                         f"got {type(mesh).__name__}")

