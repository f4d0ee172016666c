"""The Megatron-style grid of ``benchmarks/hand_plan_grid.py``: its configurations, and each one
priced by autopar's own functions (a plan with every choice pinned; see that script's docstring)."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

import autopar
from autopar.config import PlanConfig
from autopar.search.problem import Problems, Step
from autopar.search.stage_plans import StageMesh
from autopar.hardware import get_profile
from autopar.pipeline.spec import Pipeline
from autopar.search.planned import PlannedStep, with_pipeline
from examples import gpt, llama

GiB = 2**30
NODE = 8
"""Devices per node: tensor parallelism stays inside one."""
STATE_BYTES_PER_PARAM = 16
"""A lower bound on a parameter's training state: bf16 weight and gradient, fp32 master and two Adam moments."""


@dataclass(frozen=True, kw_only=True)
class Point:
    """One Megatron-style configuration, every choice pinned."""

    tp: int
    """Tensor-parallel degree (the example's TP or TP+SP plan pinned on the ``tp`` axis)."""
    pp: int
    """Pipeline degree (1: no pipeline)."""
    dp: int
    """Data-parallel degree, parameters replicated."""
    sp: bool
    """Sequence parallelism (the TP+SP plan) rather than the TP plan."""
    b: int
    """Micro-batch size, sequences per data-parallel rank."""
    m: int
    """Micro-batches per step (global batch / (dp b))."""
    schedule: str | None
    """'1f1b' or 'interleaved_1f1b' (None when pp = 1: gradient accumulation)."""
    v: int
    """Stages per pp rank (1 but for interleaved 1F1B)."""
    checkpoint: str
    """Activation checkpointing of every block: 'full' or 'none'."""

    def key(self) -> tuple[object, ...]:
        return (self.tp, self.pp, self.dp, self.sp, self.b, self.m, self.schedule, self.v, self.checkpoint)


@dataclass(frozen=True, kw_only=True)
class Priced(Point):
    """A point as autopar's cost model prices it."""

    step_s: float
    """Predicted step seconds."""
    peak_gib: float
    """Predicted peak memory of the busiest rank, GiB."""
    tflops: float
    """The shape's FLOPs per step (``Shape.flops``) over the step, per device, in TFLOP/s."""
    fits: bool
    """Whether the peak is within the memory limit."""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A model shape, its cluster and its step."""

    name: str
    """Printed name."""
    config: gpt.GPTConfig | llama.LlamaConfig
    """The example model's configuration (examples/gpt.py or examples/llama.py)."""
    devices: int
    """Devices in the cluster."""
    hardware: str
    """Hardware profile name (``autopar.Mesh(hardware=...)``)."""
    batch: int
    """Global batch, sequences."""
    memory_limit: float | None = None
    """Bytes per device; None: the hardware's default (``HardwareProfile.memory_limit()``)."""
    published_tflops: float | None = None
    """Published TFLOP/s per device of ``published``."""
    published: Point | None = None
    """The published run's configuration."""
    gap_note: str = ""
    """Why prediction and publication may differ (printed when they differ by over 20%)."""

    @property
    def is_gpt(self) -> bool:
        return isinstance(self.config, gpt.GPTConfig)

    @property
    def seq(self) -> int:
        return self.config.max_seq_len

    @property
    def limit(self) -> float:
        return self.memory_limit or get_profile(self.hardware).memory_limit()

    @property
    def flops_label(self) -> str:
        return ("TFLOP/s by Megatron's 96 B s l h^2 (1 + s/6h + V/16lh)" if self.is_gpt
                else "TFLOP/s by 6 N T + 12 l h s T, model FLOPs, no recompute")

    def flops(self, params: int) -> float:
        """FLOPs of one step (module docstring: Megatron's formula for GPT, model FLOPs for Llama)."""
        c, b, s = self.config, self.batch, self.seq
        if self.is_gpt:
            l, h = c.layers, c.hidden
            return 96 * b * s * l * h ** 2 * (1 + s / (6 * h) + c.vocab_size / (16 * l * h))
        return 6 * params * b * s + 12 * c.layers * c.hidden * s * b * s


@dataclass(frozen=True, kw_only=True)
class Grid:
    """The grid's ranges."""

    tps: tuple[int, ...]
    """Tensor-parallel degrees."""
    bs: tuple[int, ...]
    """Micro-batch sizes."""
    vs: tuple[int, ...]
    """Stages per rank of interleaved 1F1B."""
    pps: tuple[int, ...] | None = None
    """Pipeline degrees; None: every one dividing devices / tp with the layers dividing into them."""
    checkpoints: tuple[str, ...] = ("none", "full")
    """Activation checkpointing policies."""


@dataclass(kw_only=True)
class GridResult:
    """The grid priced."""

    shape: Shape
    """What was priced."""
    priced: list[Priced] = field(default_factory=list)
    """Points that fit."""
    over: list[Priced] = field(default_factory=list)
    """Points priced over the memory limit (skipped)."""
    stage_plans: int = 0
    """Stage meshes planned (one per tp, sp, pp, b, checkpointing)."""
    pruned_state: int = 0
    """(tp, pp) pairs whose state alone is over the limit."""
    pruned_b: int = 0
    """Configurations skipped because a smaller micro-batch did not fit."""
    seconds: float = 0.0
    """Wall seconds pricing the grid."""

    @property
    def unfit(self) -> int:
        return len(self.over)

    @property
    def pps(self) -> tuple[int, ...]:
        """The pipeline degrees the grid planned (past the state bound)."""
        return tuple(sorted({p.pp for p in self.priced + self.over}))

    @property
    def best(self) -> Priced | None:
        return min(self.priced, key=lambda p: p.step_s, default=None)


def build(shape: Shape) -> tuple[nn.Module, torch.Tensor]:
    """The example model on the meta device and a global batch of tokens."""
    with torch.device("meta"):
        model = gpt.GPT(shape.config) if shape.is_gpt else llama.Llama(shape.config)
        tokens = torch.randint(0, shape.config.vocab_size, (shape.batch, shape.seq))
    return model, tokens


def mesh_axes(pp: int, dp: int, tp: int) -> dict[str, int]:
    """``{"pp", "dp", "tp"}``, pp outermost, axes of size 1 left out (a lone axis kept)."""
    axes = {name: size for name, size in (("pp", pp), ("dp", dp), ("tp", tp)) if size > 1}
    return axes or {"dp": 1}


def pins(shape: Shape, tokens: torch.Tensor, point: Point) -> dict[str, Any]:
    """``plan``'s options pinning ``point``'s TP/SP plan, checkpointing and replicated data parallelism."""
    module = gpt if shape.is_gpt else llama
    options: dict[str, Any] = {"loss_fn": module.lm_loss, "example_targets": (tokens,),
                               "checkpoint": point.checkpoint}
    if point.dp > 1:
        options.update(zero={"dp": 0}, data_axes=("dp",))
    if point.tp > 1:
        options["constraints"] = module.TP_SP_PLAN if point.sp else module.TP_PLAN
    return options


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def pp_degrees(shape: Shape, tp: int, grid: Grid) -> list[int]:
    """Pipeline degrees dividing devices / tp into which the layers divide (Megatron's stages)."""
    per, layers = shape.devices // tp, shape.config.layers
    return [pp for pp in (grid.pps or range(1, per + 1)) if per % pp == 0 and layers % pp == 0]


def schedules(shape: Shape, pp: int, m: int, vs: tuple[int, ...]) -> list[tuple[str | None, int]]:
    """Megatron's schedules on pp ranks and m micro-batches: 1F1B (m >= pp), interleaved 1F1B with v
    stages per rank where the layers divide into pp v stages and m is a multiple of pp; pp = 1: none."""
    if pp == 1:
        return [(None, 1)]
    out: list[tuple[str | None, int]] = [("1f1b", 1)] if m >= pp else []
    return out + [("interleaved_1f1b", v) for v in vs if shape.config.layers % (pp * v) == 0 and m % pp == 0]


def _priced(shape: Shape, point: Point, plan: autopar.Plan, params: int) -> Priced:
    step_s, peak = plan.predicted.step_time_s, plan.predicted.peak_memory_bytes
    return Priced(**vars(point), step_s=step_s, peak_gib=peak / GiB, fits=peak <= shape.limit,
                  tflops=shape.flops(params) / step_s / shape.devices / 1e12)


def price_config(shape: Shape, model: nn.Module, tokens: torch.Tensor, point: Point,
                 choices: list[tuple[str | None, int]], **extra: Any) -> list[Priced]:
    """``point`` at each (schedule, v) of ``choices``, priced by autopar: the stage mesh planned once as
    ``autopar.plan`` plans a pinned pipeline (``search.stage_plans.StageMesh``; no memory limit, so that no
    memory search changes the pinned configuration), each choice priced on it by ``with_pipeline``; ``extra``:
    further ``autopar.plan`` options (``random_stream``)."""
    mesh = autopar.Mesh(mesh_axes(point.pp, point.dp, point.tp), hardware=shape.hardware)
    options = {**pins(shape, tokens, point), "memory_limit": math.inf, **extra}
    params = parameters(model)
    if point.pp == 1:
        plan = autopar.plan(model, mesh, (tokens,), micro_batches=point.m, **options)
        return [_priced(shape, replace(point, schedule=None, v=1), plan, params)]
    first = Pipeline(axis="pp", schedule="1f1b", micro_batches=point.m, virtual_stages=1)
    step = Step(model=model, example_inputs=(tokens,), loss_fn=options.pop("loss_fn"),
                example_targets=options.pop("example_targets"))
    problems = Problems(step, PlanConfig.from_options(pipeline=first, **options))
    stage = StageMesh(problems, first, mesh).plan(point.m, math.inf)
    assert isinstance(stage, PlannedStep), stage
    out = []
    for schedule, v in choices:
        choice = Pipeline(axis="pp", schedule=schedule, micro_batches=point.m, virtual_stages=v)
        choice.check_counts(point.pp)
        staged = with_pipeline(stage, choice, mesh)
        assert isinstance(staged, PlannedStep), staged
        out.append(_priced(shape, replace(point, schedule=schedule, v=v), staged.plan, params))
    return out


def price_point(shape: Shape, model: nn.Module, tokens: torch.Tensor, point: Point, **extra: Any) -> Priced:
    """One pinned point (Megatron's published configuration)."""
    return price_config(shape, model, tokens, point, [(point.schedule, point.v)], **extra)[0]


def price_grid(shape: Shape, model: nn.Module, tokens: torch.Tensor, grid: Grid) -> GridResult:
    """Every point of ``grid`` priced (module docstring), the pruned ones counted."""
    began = time.perf_counter()
    result = GridResult(shape=shape)
    params = parameters(model)
    for tp in grid.tps:
        for pp in pp_degrees(shape, tp, grid):
            if STATE_BYTES_PER_PARAM * params / (tp * pp) > shape.limit:
                result.pruned_state += 1
                continue
            for sp in (False, True) if tp > 1 else (False,):
                for checkpoint in grid.checkpoints:
                    base = Point(tp=tp, pp=pp, dp=shape.devices // (tp * pp), sp=sp, b=0, m=0, schedule=None, v=1,
                                 checkpoint=checkpoint)
                    _price_bs(shape, model, tokens, grid, result, base)
    result.seconds = time.perf_counter() - began
    return result


def _price_bs(shape: Shape, model: nn.Module, tokens: torch.Tensor, grid: Grid, result: GridResult,
              base: Point) -> None:
    """``base`` at each micro-batch size, smallest first, until one of them has no point that fits."""
    bs = [b for b in sorted(grid.bs) if shape.batch % (base.dp * b) == 0 and shape.batch // (base.dp * b) >= base.pp]
    for i, b in enumerate(bs):
        point = replace(base, b=b, m=shape.batch // (base.dp * b))
        started = time.perf_counter()
        priced = price_config(shape, model, tokens, point, schedules(shape, base.pp, point.m, grid.vs))
        result.stage_plans += 1
        fit = [p for p in priced if p.fits]
        result.priced += fit
        result.over += [p for p in priced if not p.fits]
        best = min((p.step_s for p in fit), default=None)
        print(f"  {shape.name} tp{base.tp} pp{base.pp} dp{base.dp} {'sp ' if base.sp else ''}b{b} {base.checkpoint}: "
              f"{len(fit)}/{len(priced)} fit" + (f", best {best:.2f} s" if best else "")
              + f" ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
        if not fit:
            result.pruned_b += len(bs) - i - 1
            return
