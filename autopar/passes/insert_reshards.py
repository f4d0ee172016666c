"""insert_reshards: a ``self.reshard`` call on every edge whose placements differ.

Each call names the forward redistribution (producer's placement -> what the consumer
needs) and the backward one (the gradient the consumer sends -> what the producer
wants). A parameter's gradient stays Partial on its sync dims; the runtime all-reduces
it once after backward. User inputs arrive whole and are sliced here unless they come
already split; a training step's loss is reduced so every rank returns all of it (a pipelined
step's is left as placed: its schedule's micro-batches' sum is reduced once, ``cost.summed_loss``).
A ZeRO-3 parameter's gather is a ``self.regather`` call instead (``autopar.runtime.regather``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch.fx
from torch.distributed.tensor import Replicate

from autopar.cost.model import grad_placements, param_grad_target
from autopar.cost.summed_loss import loss_summed_once
from autopar.passes.context import PassContext, plan_name, strategy_of
from autopar.rules.redistribute import ALL_GATHER, redistribute_steps
from autopar.rules.strategy import Placements, placement_str
from autopar.problem.nodes import INPUT, PARAM


def _grad_spec(pc: PassContext, src: str, produced: Placements, required: Placements, consumer_name: str
               ) -> tuple[Placements, Placements] | None:
    producer = pc.graph.nodes[src]
    if not (pc.ctx.train and pc.graph.sends_gradient(src, consumer_name)):
        return None
    grad_in, grad_out = grad_placements(produced, required, pc.chosen[consumer_name])
    if producer.kind == PARAM:  # Partial on every sync dim of the parameter: the buckets sum it there
        grad_out = param_grad_target(produced, grad_in, pc.sync_dims.get(src, frozenset()))
    return grad_in, grad_out


def _reshard_args(x: torch.fx.Node, produced: Placements, required: Placements,
                  grad: tuple[Placements, Placements] | None) -> tuple[Any, ...] | None:
    fwd = redistribute_steps(produced, required)
    bwd = redistribute_steps(*grad) if grad is not None else []
    if not fwd and not bwd:
        return None
    args: tuple[Any, ...] = (x, placement_str(produced), placement_str(required))
    if bwd:
        args += (placement_str(grad[0]), placement_str(grad[1]))  # type: ignore[index]
    return args


def _tensor_arg_slots(node: torch.fx.Node, is_planned: Callable[[torch.fx.Node], bool]) -> list[tuple[str, Any]]:
    """(container, key) of each planned tensor argument, in the order the plan lists them."""
    slots: list[tuple[str, Any]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node) and is_planned(a):
            slots.append(("args", i))
        elif isinstance(a, (list, tuple)):
            slots.extend(("args", (i, j)) for j, b in enumerate(a) if isinstance(b, torch.fx.Node) and is_planned(b))
    for k, a in node.kwargs.items():
        if isinstance(a, torch.fx.Node) and is_planned(a):
            slots.append(("kwargs", k))
    return slots


def _replace_slot(node: torch.fx.Node, slot: tuple[str, Any], new: torch.fx.Node) -> None:
    where, key = slot
    if where == "kwargs":
        node.update_kwarg(key, new)
        return
    if isinstance(key, tuple):
        i, j = key
        seq = list(node.args[i])
        seq[j] = new
        node.update_arg(i, type(node.args[i])(seq))
    else:
        node.update_arg(key, new)


def insert_reshards(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    rerouted: list[tuple[torch.fx.Node, tuple[Any, ...] | None, dict[str, Any]]] = []  # applied after the edge pass
    shared: dict[tuple[Any, ...], torch.fx.Node] = {}  # one reshard serves every consumer needing it (per version)
    for node in list(graph.nodes):
        name = plan_name(node)
        strategy = strategy_of(node)
        if name is None or strategy is None:
            continue
        plan_node = pc.graph.nodes[name]
        if plan_node.kind == INPUT and not pc.input_sharded:
            whole = (Replicate(),) * len(pc.mesh_shape)
            rerouted.append((node, _reshard_args(node, whole, strategy.outputs[0], None), {}))
        elif node.op == "call_function" and node.target is operator.getitem:
            # a piece of a multi-output op: reshard the piece after picking it
            src, idx = plan_node.args[0]
            produced, required = pc.chosen[src].outputs[idx], strategy.inputs[0]
            rerouted.append((node, _reshard_args(node, produced, required,
                                                 _grad_spec(pc, src, produced, required, name)),
                             _sized_by_data(pc, src, idx)))
        elif node.op in ("call_function", "call_module"):
            _reshard_inputs(gm, node, name, pc, shared)
    for node, args, kwargs in rerouted:
        _insert_after(gm, node, args, kwargs)
    if pc.graph.loss is not None and not loss_summed_once(pc.ctx):
        loss = next(n for n in graph.nodes if plan_name(n) == pc.graph.loss)
        _insert_after(gm, loss, _reshard_args(loss, pc.chosen[pc.graph.loss].outputs[0],
                                              (Replicate(),) * len(pc.mesh_shape), None))
    graph.lint()
    gm.recompile()
    return gm


def _reshard_inputs(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str, pc: PassContext,
                    shared: dict[tuple[Any, ...], torch.fx.Node]) -> None:
    plan_node = pc.graph.nodes[name]
    strategy = pc.chosen[name]
    slots = _tensor_arg_slots(node, lambda a: plan_name(a) is not None)
    assert len(slots) == len(plan_node.args), (name, slots, plan_node.args)
    for k, (slot, (src, idx)) in enumerate(zip(slots, plan_node.args)):
        produced, required = pc.chosen[src].outputs[idx], strategy.inputs[k]
        args = _reshard_args(_slot_value(node, slot), produced, required, _grad_spec(pc, src, produced, required, name))
        if args is None:
            continue
        kwargs = _sized_by_data(pc, src, idx)
        if k in plan_node.as_produced:  # the solver links only equal placements on these edges
            raise RuntimeError(f"{name} must take {src} as produced (it writes into it in place, or is a view "
                               f"of a tensor written in place), but the plan reshards it: {args[1:]} "
                               "(forward, and gradient, placements)")
        target, args = _regather_call(pc, src, produced, required, args)
        # Consumers needing the same placement (and sending back the same gradient
        # placement) share one reshard: autograd sums their gradients before its backward.
        # Not across a write in place: a reshard made before it holds the old values.
        key = (target, args, plan_node.version(k))
        reshard = shared.get(key)
        if reshard is None:
            with gm.graph.inserting_before(node):
                reshard = shared[key] = gm.graph.call_module(target, args, kwargs)
        _replace_slot(node, slot, reshard)


def _sized_by_data(pc: PassContext, src: str, idx: int) -> dict[str, Any]:
    """``data_dependent=True`` for a tensor with a dim of data-dependent size (``TensorMeta.ragged``):
    the runtime logs its collectives so, as the plan lists them (their bytes planned at the hint)."""
    meta = pc.graph.nodes[src].outputs[idx]
    return {"data_dependent": True} if meta is not None and meta.ragged else {}


def _regather_call(pc: PassContext, src: str, produced: Placements, required: Placements, args: tuple[Any, ...]
                   ) -> tuple[str, tuple[Any, ...]]:
    """``self.regather(x, fqn, ...)`` for a ZeRO-3 parameter's gather (its gathered copy is
    not kept for backward: the runtime gathers it again there), else ``self.reshard(...)``.
    Only a forward that gathers: any other step leaves a tensor no bigger than the shard."""
    producer = pc.graph.nodes[src]
    fqn = producer.fqn or src
    if producer.kind != PARAM or fqn not in pc.regather:
        return "reshard", args
    if not any(step.kind == ALL_GATHER for step in redistribute_steps(produced, required)):
        return "reshard", args
    return "regather", (args[0], fqn, *args[1:])


def _slot_value(node: torch.fx.Node, slot: tuple[str, Any]) -> torch.fx.Node:
    where, key = slot
    if where == "kwargs":
        return node.kwargs[key]
    if isinstance(key, tuple):
        return node.args[key[0]][key[1]]
    return node.args[key]


def _insert_after(gm: torch.fx.GraphModule, node: torch.fx.Node, args: tuple[Any, ...] | None,
                  kwargs: dict[str, Any] | None = None) -> None:
    """Route every use of ``node`` through ``self.reshard(*args, **kwargs)``."""
    if args is None:
        return
    users = list(node.users)
    with gm.graph.inserting_after(node):
        reshard = gm.graph.call_module("reshard", args, kwargs or {})
    for user in users:
        user.replace_input_with(node, reshard)
