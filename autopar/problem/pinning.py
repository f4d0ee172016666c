"""The pins a config puts on the planning graph, one axis at a time (``problem.constraints``): a
hand-written tensor-parallel plan on its axis, data and expert parallelism, context parallelism,
inputs arriving split, state placed as another step's, ZeRO stages, and how context attention runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.tensor import Placement, Replicate

from autopar.capture import CapturedGraph
from autopar.config import PlanConfig
from autopar.errors import InputError
from autopar.mesh import Mesh
from autopar.problem.constraints import (Pin, apply_pins, context_parallel_pins, data_parallel_pins, expert_parameters,
                                         pins_from_tp_plan, placement_pins, zero_pins)
from autopar.problem.context_kind import pin_context_attention
from autopar.problem.nodes import PARAM, PlanGraph
from autopar.problem.zigzag import state_pins


@dataclass
class Pinned:
    """What the pins did: each node's pins (for block folding: blocks pinned alike fold), what the plan
    reports as pinned, and notes on pins that could not apply everywhere."""

    node_pins: dict[str, Any] = field(default_factory=dict)
    pinned: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def pin(self, graph: PlanGraph, pins: dict[str, Pin], mesh: Mesh, axis_name: str) -> None:
        axis = mesh.names.index(axis_name)
        apply_pins(graph, pins, axis, axis_name, mesh.shape[axis])
        for name, p in pins.items():
            self.node_pins[name] = (self.node_pins.get(name), axis_name, p)


def pin_config(graph: PlanGraph, captured: CapturedGraph, mesh: Mesh, config: PlanConfig) -> Pinned:
    """Apply every pin ``config`` asks for to ``graph`` (its strategies narrowed in place)."""
    out = Pinned()
    zero = dict(config.memory.zero or {})
    _pin_tensor_parallel(graph, mesh, config, out)
    _pin_data_axes(graph, captured, mesh, config, zero, out)
    _pin_context_axes(graph, captured, mesh, config.axes.context, zero, out)
    if config.axes.input_sharded:
        data = config.axes.data
        for axis_name in mesh.names:
            if axis_name not in data:
                out.pin(graph, {n: Pin(output=Replicate(), reason=f"inputs arrive split on {data} only")
                                for n in captured.user_inputs if n in graph.nodes}, mesh, axis_name)
    _pin_state(graph, mesh, dict(config.state_placements or {}), out)
    pin_context_attention(graph, config.context.attention, mesh, tuple(config.axes.context))
    _pin_zero(graph, mesh, zero, out)
    return out


def _pin_tensor_parallel(graph: PlanGraph, mesh: Mesh, config: PlanConfig, out: Pinned) -> None:
    axes = config.axes
    if not axes.constraints:
        return
    axis = mesh.names.index(axes.constraint_axis)
    tp_pins, pinned = pins_from_tp_plan(graph, dict(axes.constraints), axis)
    apply_pins(graph, tp_pins, axis, axes.constraint_axis, mesh.shape[axis])
    out.node_pins.update(tp_pins)
    out.pinned.update(pinned)


def _pin_data_axes(graph: PlanGraph, captured: CapturedGraph, mesh: Mesh, config: PlanConfig, zero: dict[str, int],
                   out: Pinned) -> None:
    """Data parallelism on each data axis; on an expert axis too, the stacked expert weights left free."""
    data, expert = config.axes.data, config.axes.expert
    experts = expert_parameters(graph) if expert else frozenset()
    if expert and not experts:  # naming an expert axis that changes nothing would hide the mistake
        raise InputError(f"expert_axes {tuple(expert)}: no parameter of the model is a stack of expert "
                         "weights (used only as the batched operand of bmm, matmul or einsum over its dim 0, or by a "
                         "sorted dropless expert layer captured as autopar::moe_experts); experts gathered per "
                         "token are not split by expert yet")
    for axis_name in data:
        axis = mesh.names.index(axis_name)
        if mesh.shape[axis] == 1:  # one rank (a pipeline took the axis's others): every placement is whole
            continue
        free = experts if axis_name in expert else frozenset()
        pins = data_parallel_pins(graph, captured.user_inputs, axis, axis_name,
                                  inputs_whole=not config.axes.input_sharded, free_params=free)
        out.pin(graph, _stored_as_zero_says(graph, pins, zero.get(axis_name, 0), used_whole=True), mesh, axis_name)
        out.pinned[f"{axis_name}: parameters, inputs"] = \
            f"data parallel, {len(free)} expert weights free" if free else "data parallel"


def _pin_context_axes(graph: PlanGraph, captured: CapturedGraph, mesh: Mesh, context: tuple[str, ...],
                      zero: dict[str, int], out: Pinned) -> None:
    for axis_name in context:
        axis = mesh.names.index(axis_name)
        if mesh.shape[axis] == 1:
            continue
        pins = context_parallel_pins(graph, captured.user_inputs, axis, axis_name)
        if axis_name in mesh.zigzag:
            pins = {**state_pins(graph, axis_name), **pins}
        out.pin(graph, _stored_as_zero_says(graph, pins, zero.get(axis_name, 0)), mesh, axis_name)
        out.pinned[f"{axis_name}: parameters, inputs"] = "context parallel (sequence split)" + \
            (", zig-zag" if axis_name in mesh.zigzag else "")


def _pin_state(graph: PlanGraph, mesh: Mesh, placements: dict[str, tuple[Placement, ...]], out: Pinned) -> None:
    """Pin the parameters and buffers ``placements`` names on every axis (``state_placements``)."""
    if not placements:
        return
    for axis_name in mesh.names:
        out.pin(graph, placement_pins(graph, placements, mesh.names.index(axis_name), "placed as the step sharing it"),
                mesh, axis_name)
    out.pinned["parameters, buffers"] = "placed as the step sharing them"


def _stored_as_zero_says(graph: PlanGraph, pins: dict[str, Pin], stage: int, *, used_whole: bool = False
                         ) -> dict[str, Pin]:
    """A data or context axis's pins where ZeRO-2/3 stores parameters split on the axis (ZeRO's pins
    say how): its replicated-parameter pins are dropped. On a data axis (``used_whole``) each reader
    takes such a parameter whole instead, as FSDP runs: the batch split, every weight gathered for
    its use, so that the axis splits the batch and nothing else, as it does without ZeRO. On a
    context axis the readers stay free (attention may split heads there: Ulysses)."""
    if stage < 2:
        return pins
    out = {n: p for n, p in pins.items() if graph.nodes[n].kind != PARAM}
    if not used_whole:
        return out
    for name, readers in graph.consumers().items():
        pin = pins.get(name)
        if graph.nodes[name].kind != PARAM or pin is None or not isinstance(pin.output, Replicate):
            continue
        for reader, arg, _ in readers:
            given = out.get(reader)
            out[reader] = given = Pin(reason=pin.reason) if given is None else replace(given, inputs=dict(given.inputs))
            given.inputs[arg] = Replicate()
    return out


def _pin_zero(graph: PlanGraph, mesh: Mesh, zero: dict[str, int], out: Pinned) -> None:
    """Pin each ZeRO stage on its axis; notes on parameters that could not be split."""
    for axis_name, stage in zero.items():
        axis = mesh.names.index(axis_name)
        pins, unsplittable = zero_pins(graph, axis, axis_name, stage, mesh.shape[axis])
        out.pin(graph, pins, mesh, axis_name)
        out.pinned[f"{axis_name}: parameters"] = f"ZeRO-{stage}"
        if unsplittable:
            out.notes.append(f"ZeRO-{stage} on {axis_name}: {len(unsplittable)} parameters have no dim that divides "
                             f"by {mesh.shape[axis]} and stay replicated ({', '.join(unsplittable[:4])}"
                             f"{', ...' if len(unsplittable) > 4 else ''})")
