"""Price one node's strategy and one edge's reshard, forward and backward."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.capture.graph import TensorMeta
from autopar.cost.collectives import (CollectiveCall, collective_time, grad_placement_at_consumer,
                                      grad_placement_at_producer, reshard)
from autopar.cost.compute import BACKWARD_FACTOR, VIEW_OPS, op_bytes, op_flops, roofline_time
from autopar.cost.precision import Precision
from autopar.mesh import Mesh
from autopar.rules.strategy import OpCall, Placements, Strategy, local_numel


@dataclass(frozen=True, kw_only=True)
class CostContext:
    """Everything pricing needs besides the graph."""

    mesh: Mesh
    precision: Precision
    train: bool
    """Price backward and optimizer too (else forward only)."""


@dataclass(frozen=True)
class NodeCost:
    time: float
    """Seconds of compute per step (forward, plus backward when training)."""
    memory: float
    """Bytes per device this node keeps alive at peak (model state or saved activation)."""


@dataclass(frozen=True)
class EdgeCost:
    time: float
    forward: tuple[CollectiveCall, ...]
    backward: tuple[CollectiveCall, ...]


def op_cost(call: OpCall, strategy: Strategy, ctx: CostContext) -> NodeCost:
    mesh = ctx.mesh
    ways = math.prod(n for i, n in enumerate(mesh.shape) if strategy.is_active(i))
    flops = op_flops(call) / ways
    nbytes = op_bytes(call.target, call.tensor_inputs, call.outputs, ctx.precision) / ways
    time = roofline_time(flops, nbytes, mesh, ctx.precision)
    memory = 0.0
    if ctx.train:
        time *= 1 + BACKWARD_FACTOR
        if call.target not in VIEW_OPS:  # outputs saved for backward; views alias them
            memory = sum(ctx.precision.tensor_bytes(o, local_numel(o, pl, mesh.shape))
                         for o, pl in zip(call.outputs, strategy.outputs) if o is not None and pl is not None)
    return NodeCost(time, memory)


def parameter_cost(meta: TensorMeta, placements: Placements, ctx: CostContext) -> NodeCost:
    """Model state of one parameter, and the optimizer's elementwise update over its shard."""
    numel = local_numel(meta, placements, ctx.mesh.shape)
    if not ctx.train:
        return NodeCost(0.0, float(numel * ctx.precision.weight_bytes_per_param))
    state = numel * ctx.precision.state_bytes_per_param
    # Adam reads and writes weights, master copy, m, v and reads the gradient: ~2x the state.
    update = roofline_time(10.0 * numel, 2.0 * state, ctx.mesh, ctx.precision)
    return NodeCost(update, float(state))


def input_cost(meta: TensorMeta, placements: Placements, ctx: CostContext) -> NodeCost:
    numel = local_numel(meta, placements, ctx.mesh.shape)
    return NodeCost(0.0, float(ctx.precision.tensor_bytes(meta, numel)))


def edge_cost(meta: TensorMeta, produced: Placements, required: Placements, consumer: Strategy,
              ctx: CostContext, *, from_parameter: bool, needs_grad: bool) -> EdgeCost:
    """Collectives between a producer's output and a consumer's input, both directions.

    Backward sends the consumer's gradient (placement from the consumer's split) back to
    the placement the producer's backward wants. A parameter gathered in forward is
    gathered again in backward (it is freed after use, as FSDP does).
    """
    mesh, precision = ctx.mesh, ctx.precision
    forward = reshard(meta, produced, required, mesh, precision)
    backward: list[CollectiveCall] = []
    if ctx.train and needs_grad:
        grad_in = tuple(grad_placement_at_consumer(r, consumer.is_active(i)) for i, r in enumerate(required))
        grad_out = tuple(grad_placement_at_producer(p) for p in produced)
        if from_parameter:
            backward.extend(forward)
            backward.extend(dataclasses.replace(c, bucketed=True)
                            for c in reshard(meta, grad_in, grad_out, mesh, precision))
        else:
            backward.extend(reshard(meta, grad_in, grad_out, mesh, precision))
    time = sum(collective_time(c, mesh) for c in (*forward, *backward))
    return EdgeCost(time, tuple(forward), tuple(backward))
