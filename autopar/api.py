"""``autopar.plan``: capture -> strategies -> (pins) -> fold repeated blocks -> ILP -> Plan."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autopar.capture import capture
from autopar.cost import get_precision
from autopar.cost.model import CostContext
from autopar.mesh import Mesh
from autopar.rules import DEFAULT_RULES, RuleSet
from autopar.solver.blocks import fold_repeated_blocks
from autopar.solver.constraints import apply_pins, pins_from_tp_plan
from autopar.solver.graph import build_plan_graph
from autopar.solver.ilp import solve
from autopar.solver.plan import Plan, build_plan


def _as_mesh(mesh: Any) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, dict):
        return Mesh(mesh)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        return Mesh.from_device_mesh(mesh)
    raise TypeError(f"mesh must be an autopar.Mesh, a dict of axis sizes or a DeviceMesh, got {type(mesh).__name__}")


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


def plan(model: nn.Module, mesh: Mesh | Any, example_inputs: tuple[Any, ...] = (), *,
         loss_fn: Callable[..., torch.Tensor] | None = None, example_kwargs: dict[str, Any] | None = None,
         example_targets: tuple[Any, ...] = (), train: bool = True, memory_limit: float | None = None,
         precision: str | None = None, constraints: dict[str, object] | None = None,
         constraint_axis: str = "tp", rules: RuleSet = DEFAULT_RULES, progress: bool = False) -> Plan:
    """Find the cheapest DP/TP/SP placement of one training (or forward) step.

    ``loss_fn(model(*example_inputs, **example_kwargs), *example_targets)`` is the step;
    with ``loss_fn=None`` the model's output must be the scalar loss. ``memory_limit`` is
    bytes per device (None: the hardware's memory). ``constraints`` is a
    ``torch.distributed.tensor.parallel`` plan dict pinned on mesh axis ``constraint_axis``.
    Nothing runs on devices; a meta-device model is planned without allocating weights.
    """
    mesh = _as_mesh(mesh)
    precision_policy = get_precision(precision or mesh.hardware.default_precision)
    limit = float(mesh.hardware.memory_bytes) if memory_limit is None else float(memory_limit)
    ctx = CostContext(mesh=mesh, precision=precision_policy, train=train)
    timings: dict[str, float] = {}
    with _stage("capture", timings, progress):
        captured = capture(model, tuple(example_inputs), loss_fn=loss_fn, example_kwargs=example_kwargs,
                           example_targets=tuple(example_targets), train=train)
    with _stage("strategies", timings, progress):
        graph = build_plan_graph(captured, rules, ctx)
        pins: dict = {}
        pinned: dict[str, str] = {}
        if constraints:
            if constraint_axis not in mesh.names:
                raise ValueError(f"constraints apply to mesh axis {constraint_axis!r}, which the mesh "
                                 f"({mesh.describe()}) does not have")
            axis = mesh.names.index(constraint_axis)
            pins, pinned = pins_from_tp_plan(graph, constraints, axis)
            apply_pins(graph, pins, axis, constraint_axis, mesh.shape[axis])
        folding = fold_repeated_blocks(graph, pins)
    with _stage("solve", timings, progress):
        solution = solve(graph, folding, ctx, limit)
    return build_plan(graph, folding, solution, ctx, timings, pinned)
