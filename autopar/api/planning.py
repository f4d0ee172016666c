"""``autopar.plan``: the fastest plan of a model's step on a mesh, nothing run on devices."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from autopar.config import PlanConfig, as_mesh, check
from autopar.mesh import Mesh
from autopar.result.plan import Plan
from autopar.search import planner
from autopar.search.planned import PlannedStep
from autopar.runtime.mixed import PRECISION_OF_DTYPE, compute_copy, mixed_compute_dtype
from autopar.search.problem import Problem, Problems, Step, first_place


def plan(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), *,
         loss_fn: Callable[..., torch.Tensor] | None = None, example_kwargs: dict[str, Any] | None = None,
         example_targets: tuple[Any, ...] = (), progress: bool = False, **options: Any) -> Plan:
    """Find the fastest placement of one training (or forward) step that fits the memory limit.

    ``loss_fn(model(*example_inputs, **example_kwargs), *example_targets)`` is the step; with
    ``loss_fn=None`` the model's output must be the scalar loss. ``mesh``: an ``autopar.Mesh`` (or a dict of
    axis sizes, or a DeviceMesh). ``options`` are ``PlanConfig``'s fields by their friendly names
    (``config.OPTIONS``): ``memory_limit`` (bytes per device; default the device memory less
    ``memory_headroom``), ``constraints`` (a torch tensor-parallel plan on ``constraint_axis``), ``data_axes``,
    ``expert_axes``, ``context_axes``, ``zero``, ``checkpoint``, ``checkpoint_blocks``, ``regather_blocks``,
    ``micro_batches``, ``offload`` (each pins what the memory search otherwise chooses), ``pipeline``
    (``autopar.Pipeline``), ``precision``, ``train``, ... ``progress`` shows the stage on stderr. Nothing runs
    on devices; a meta-device model is planned without allocating weights.
    """
    return plan_step(model, mesh, example_inputs, loss_fn=loss_fn, example_kwargs=example_kwargs,
                     example_targets=example_targets, progress=progress, **options).plan


def plan_step(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), *,
              loss_fn: Callable[..., torch.Tensor] | None = None, example_kwargs: dict[str, Any] | None = None,
              example_targets: tuple[Any, ...] = (), progress: bool = False, **options: Any) -> PlannedStep:
    """``plan``, keeping the captured graph and the chosen strategies (what running it needs)."""
    config, mesh = PlanConfig.from_options(**options), as_mesh(mesh)
    model, config = as_compiled(model, config, mesh)
    step = Step(model=model, example_inputs=example_inputs, example_kwargs=example_kwargs,
                example_targets=example_targets, loss_fn=loss_fn)
    return planner.plan(step, config, mesh, progress=progress)


def as_compiled(model: nn.Module, config: PlanConfig, mesh: Mesh) -> tuple[nn.Module, PlanConfig]:
    """The model and config ``compile`` plans: under mixed precision an fp32 model's bf16 compute copy
    (``runtime.mixed``), whose captured dtypes are those that run (a norm's or a loss's ``x.float()``
    priced at fp32, not at the compute width), and ``masters`` set; any other model as it is."""
    dtype = mixed_compute_dtype(model, config.precision, mesh.hardware.default_precision) \
        if isinstance(model, nn.Module) else None
    if dtype is None:
        return model, config
    return compute_copy(model, dtype), replace(config, precision=PRECISION_OF_DTYPE[dtype], masters=True)


def prepare(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), *,
            loss_fn: Callable[..., torch.Tensor] | None = None, example_kwargs: dict[str, Any] | None = None,
            example_targets: tuple[Any, ...] = (), **options: Any) -> Problem:
    """The step's ILP problem as the search first prepares it (captured, strategies listed, the options'
    pins applied, blocks folded, priced under the memory choices pinned), for tools that solve or inspect
    one ILP without searching (``search.ilp.solve``)."""
    config, mesh = PlanConfig.from_options(**options), as_mesh(mesh)
    check(config, mesh)
    model, config = as_compiled(model, config, mesh)
    step = Step(model=model, example_inputs=example_inputs, example_kwargs=example_kwargs,
                example_targets=example_targets, loss_fn=loss_fn)
    return Problems(step, config).first(first_place(config, mesh), config.memory.limit(mesh))
