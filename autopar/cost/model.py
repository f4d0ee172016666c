"""Price one node's strategy and one edge's reshard, forward and backward."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autopar.capture.aliasing import writes_first_arg
from autopar.capture.graph import TensorMeta
from torch.distributed.tensor import Partial

from autopar.cost.buckets import DEFAULT_BUCKET_BYTES
from autopar.cost.collectives import (ALL_REDUCE, CollectiveCall, collective_time, grad_placement_at_consumer,
                                      grad_placement_at_producer, reshard)
from autopar.cost.compute import (BACKWARD_FACTOR, VIEW_OPS, gradient_sums_time, op_bytes, op_efficiency,
                                  rank_flops, ring_launches, ring_of, roofline_time, with_fixed_cost)
from autopar.cost.draws import draw_time
from autopar.cost.groups import grouped_calls
from autopar.cost.moe import compute_factor, is_moe, pair_share
from autopar.cost.offload import offloaded_parameter
from autopar.cost.zero1 import ALL_GATHER, REDUCE_SCATTER, chunk_elements, padded_elements
from autopar.cost.precision import Precision
from autopar.cost.saved import SavedTensors
from autopar.mesh import Mesh
from autopar.rules.redistribute import redistribute_steps
from autopar.rules.strategy import (OpCall, Placements, Strategy, is_partial, is_replicate, local_numel,
                                    shard_dim)


@dataclass(frozen=True, kw_only=True)
class CostContext:
    """Everything pricing needs besides the graph."""

    mesh: Mesh
    precision: Precision
    train: bool
    """Price backward and optimizer too (else forward only)."""
    inputs_whole: bool = True
    """Every rank receives the whole global batch (else only its data-parallel shard)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Gradient bucket size: gradients are all-reduced in buckets of this many bytes."""
    micro_batches: int = 1
    """The captured step is one micro-batch; a training step runs it this many times
    (forward, backward and their collectives), then syncs gradients and updates once."""
    offload: bool = False
    """Trainable parameters may keep their optimizer state and fp32 master weights in host
    memory and update there (``cost.offload``): each of their strategies gets an offloaded
    twin (``Strategy.offload``; ``problem.graph.state_twins``)."""
    offload_pinned: bool = False
    """Offload is pinned: every trainable parameter's state is on the host (only the twins
    are offered); else the ILP chooses per parameter."""
    zero1: tuple[int, ...] = ()
    """Mesh dims where trainable parameters stored replicated may keep a 1/n shard of their
    optimizer state (ZeRO-1, ``cost.zero1``): gradients reduce-scattered and updated shards
    all-gathered at the optimizer step, instead of all-reduced. Each such placement gets a
    ZeRO-1 twin strategy (``Strategy.zero1``; ``problem.graph.priced_parameter``)."""
    zero1_pinned: bool = False
    """ZeRO stage 1 is pinned on ``zero1``'s dims: every trainable parameter replicated on one
    is ZeRO-1 (only the twins are offered); else the ILP chooses per parameter."""
    global_draws: bool = False
    """Random ops draw the global tensor on every rank (``compile(random_stream='torch')``),
    else each rank its own elements from the counter stream (``cost.draws``)."""
    pipelined: bool = False
    """The step is a pipeline's stage-mesh plan, cut into stages between repeated blocks: parameters
    outside every block are grouped per stretch between blocks (``problem.groups.group_names``),
    which a cut never splits."""


@dataclass(frozen=True)
class NodeCost:
    time: float
    """Seconds of compute per step (forward, plus backward when training; every micro-batch)."""
    memory: float
    """Bytes per device this node keeps alive at peak (model state or saved activation)."""
    forward: float = 0.0
    """Seconds of the forward part of ``time`` (what recomputing the op in backward costs)."""
    output_bytes: float = 0.0
    """Bytes per device of all the op's outputs (what a checkpoint policy keeping its
    outputs holds, whether or not autograd would); 0 for a view or in-place op."""


@dataclass(frozen=True)
class EdgeCost:
    time: float
    """Seconds of the collectives below per step (each runs once per micro-batch)."""
    forward: tuple[CollectiveCall, ...]
    backward: tuple[CollectiveCall, ...]
    recompute: tuple[CollectiveCall, ...] = ()
    """Forward reshards run again in backward: the consumer recomputes (a checkpointed
    block), or a parameter is gathered again instead of held (``regathered``: ZeRO-3)."""
    unwaited: float = 0.0
    """Seconds of one run of the backward's last collective when it is a parameter gradient's
    reduce-scatter: the runtime leaves it running beside the rest of backward
    (``runtime.ops.Comm.run_unwaited``), so in the last micro-batch it shares the gradient
    buckets' window (``exposed_sync_time``). Included in ``time``."""


def splits_work(strategy: Strategy, mesh_dim: int) -> bool:
    """True when each rank does only its part of the op's work along ``mesh_dim``.

    The work is split by inputs that are actually split: some input sharded (plain or
    strided) on this dim, a split contraction with a Partial output included. Partial and
    replicated inputs are whole tensors on every rank, so an op reading only those does
    the whole work whatever its output (``mm(Partial, Replicate) -> Partial`` multiplies
    the whole matrix on every rank). An op with neither, producing a sharded output (a
    factory building its slice), computes only its slice. This is not
    ``Strategy.is_active``, which decides where gradients come back Partial.
    """
    inputs = [placements[mesh_dim] for placements in strategy.inputs]
    if any(shard_dim(p) is not None for p in inputs):
        return True
    if any(is_partial(p) for p in inputs):
        return False
    return any(o is not None and shard_dim(o[mesh_dim]) is not None for o in strategy.outputs)


def op_cost(call: OpCall, strategy: Strategy, ctx: CostContext, *, backward: bool | None = None,
            saved: bool | None = None, kept: SavedTensors | None = None, grad_sums: tuple[int, ...] = ()
            ) -> NodeCost:
    """One rank's seconds for the op in a step (its share of the work by roofline, forward
    and, when its backward runs, backward at ``BACKWARD_FACTOR`` times, each phase after its
    fixed cost), and the bytes it keeps for backward. ``backward`` (default: a training
    step) says the op's backward runs; ``saved`` (default: likewise) that backward keeps
    anything of it (a frozen prefix runs neither); ``kept`` which outputs autograd keeps and
    what it keeps inside (``problem.saved_activations``; default: every output); ``grad_sums`` per tensor
    input whether autograd adds the gradient it sends back to earlier readers' (``gradient_sums``)."""
    backward = ctx.train if backward is None else backward
    saved = ctx.train if saved is None else saved
    mesh = ctx.mesh
    ways = math.prod(n for i, n in enumerate(mesh.shape) if splits_work(strategy, i))
    flops = rank_flops(call, strategy, ways, mesh) * compute_factor(call, strategy, mesh)  # the busiest expert rank
    placements = [*strategy.inputs, *strategy.outputs]
    # Each tensor at its local size: a Partial or replicated tensor is whole on every rank.
    nbytes = op_bytes(call.target, call.tensor_inputs, call.outputs, ctx.precision,
                      lambda meta, k: local_numel(meta, placements[k] or (), mesh.shape))
    work = roofline_time(flops, nbytes, mesh, ctx.precision, op_efficiency(call, strategy, flops, mesh, ctx.precision))
    hw = mesh.hardware
    kernel = call.target not in VIEW_OPS  # a view runs no kernel: priced free
    ring = ring_of(call, strategy) is not None  # ring attention launches ops per block (``ring_launches``)
    launches = ring_launches(call, strategy, mesh) if ring else int(kernel)
    forward = with_fixed_cost(work, hw.op_overhead * launches, hw) + draw_time(call, strategy, mesh, ctx.precision,
                                                                              ctx.global_draws)
    time = forward
    memory = 0.0
    if backward and any(_differentiable(o) for o in call.outputs):  # else nothing to differentiate: no backward op
        launches = ring_launches(call, strategy, mesh, backward=True) if ring else int(kernel)
        time += with_fixed_cost(BACKWARD_FACTOR * work, hw.backward_op_overhead * launches, hw)
        time += gradient_sums_time(call, strategy, mesh, ctx.precision, grad_sums)
    # outputs saved for backward; views and in-place ops return their input's memory
    sizes = [ctx.precision.tensor_bytes(o, local_numel(o, pl, mesh.shape)) if o is not None and pl is not None
             else 0 for o, pl in zip(call.outputs, strategy.outputs)]
    owns = kernel and not writes_first_arg(call.target)
    if saved and owns:
        memory = float(sum(sizes)) if kept is None else \
            float(sum(b for b, k in zip(sizes, kept.outputs) if k)) + _internal_bytes(call, strategy, ctx, kept)
    runs = step_repeats(ctx)  # every micro-batch runs the op; one micro-batch's activations are alive at a time
    return NodeCost(time * runs, memory, forward * runs, float(sum(sizes)) if owns else 0.0)


def _differentiable(meta: TensorMeta | None) -> bool:
    """An output autograd sends a gradient back through: floating or complex (a rotary embedding's
    complex product has a backward kernel as a real one does)."""
    return meta is not None and (meta.dtype.is_floating_point or meta.dtype.is_complex)


def _internal_bytes(call: OpCall, strategy: Strategy, ctx: CostContext, kept: SavedTensors) -> float:
    """What the op keeps inside (probed at global shapes), at this rank's share: split as its
    largest floating tensor is (a loss's ``log_softmax`` is split as its logits)."""
    if not kept.internal_bytes:
        return 0.0
    if is_moe(call.target):  # what it keeps is per (token, expert) pair: the rank's pairs, not its weights' share
        return kept.internal_bytes * pair_share(call, strategy, ctx.mesh)
    tensors = [(m, pl) for m, pl in zip([*call.tensor_inputs, *call.outputs], [*strategy.inputs, *strategy.outputs])
               if m is not None and pl is not None and m.dtype.is_floating_point and m.numel]
    if not tensors:
        return float(kept.internal_bytes)
    meta, placements = max(tensors, key=lambda t: t[0].numel)
    return kept.internal_bytes * local_numel(meta, placements, ctx.mesh.shape) / meta.numel


def backward_time(cost: NodeCost, ctx: CostContext) -> float:
    """Seconds of an op's backward in the last micro-batch (what gradient buckets can overlap;
    a checkpointed op's recompute runs in backward too)."""
    return (cost.time - cost.forward) / step_repeats(ctx)


def exposed_sync_time(sync_s: float, backward_s: float, ctx: CostContext) -> float:
    """Seconds of gradient communication beside backward a step waits for: of the bucket
    all-reduces and the last micro-batch's unwaited parameter reduce-scatters
    (``EdgeCost.unwaited``), those beyond what runs beside the last micro-batch's backward
    (``HardwareProfile.grad_sync_overlap``)."""
    overlap = ctx.mesh.hardware.grad_sync_overlap if ctx.train else 0.0
    return max(0.0, sync_s - overlap * backward_s)


def step_repeats(ctx: CostContext) -> int:
    """How many times a step runs the captured (micro-batch) program: once per micro-batch."""
    return ctx.micro_batches if ctx.train else 1


def parameter_cost(meta: TensorMeta, placements: Placements, ctx: CostContext, *, trainable: bool = True,
                   offloaded: bool = False, zero1: int | None = None) -> NodeCost:
    """Model state of one parameter, and the optimizer's elementwise update over its shard.
    A frozen parameter (``requires_grad=False``) or a forward-only step keeps the weights
    alone: no gradient, no master copy, no optimizer state, no update. An ``offloaded``
    parameter keeps its master copy and optimizer state in host memory: the device holds
    weights and gradient, and the step pays the copies over the host link and the host's
    update (``autopar.cost.offload``). A ZeRO-1 parameter (``zero1``: the mesh dim its
    optimizer state is sharded on) keeps weights and gradient whole and the rest of its
    state, and its update, for its chunk only."""
    numel = local_numel(meta, placements, ctx.mesh.shape)
    if not ctx.train or not trainable:
        return NodeCost(0.0, float(numel * ctx.precision.weight_bytes_per_param))
    if offloaded:
        cost = offloaded_parameter(meta, placements, ctx.mesh, ctx.precision)
        return NodeCost(cost.time_s, cost.device_bytes)
    precision = ctx.precision
    # elements the optimizer updates and keeps state of
    stepped = numel if zero1 is None else chunk_elements(numel, ctx.mesh.shape[zero1])
    whole = precision.master_bytes_per_param + precision.grad_bytes_per_param
    state = numel * whole + stepped * (precision.state_bytes_per_param - whole)
    # Adam reads and writes weights, master copy, m and v and reads the gradient, in as many passes
    # as the profile's ``optimizer_traffic`` says (torch's foreach AdamW on a GPU: 20 element accesses)
    hw = ctx.mesh.hardware
    moved = hw.optimizer_traffic * stepped * precision.state_bytes_per_param
    update = with_fixed_cost(roofline_time(10.0 * stepped, moved, ctx.mesh, precision), hw.optimizer_param_overhead, hw)
    return NodeCost(update, float(state))


def zero1_gather_call(meta: TensorMeta, strategy: Strategy, ctx: CostContext) -> CollectiveCall | None:
    """A ZeRO-1 parameter strategy's share of the all-gather buckets after the update (None:
    not ZeRO-1)."""
    d = strategy.zero1 if ctx.train else None
    placements = strategy.outputs[0]
    if d is None or placements is None:
        return None
    numel = padded_elements(local_numel(meta, placements, ctx.mesh.shape), ctx.mesh.shape[d])
    return CollectiveCall(ALL_GATHER, d, numel * ctx.precision.master_bytes_per_param, bucketed=True)


def input_cost(meta: TensorMeta, placements: Placements, ctx: CostContext) -> NodeCost:
    numel = local_numel(meta, placements, ctx.mesh.shape)
    return NodeCost(0.0, float(ctx.precision.tensor_bytes(meta, numel)))


def grad_placements(produced: Placements, required: Placements, consumer: Strategy) -> tuple[Placements, Placements]:
    """(gradient placement the consumer sends back, placement the producer wants)."""
    return _grad_placements(produced, required, tuple(consumer.is_active(i) for i in range(len(required))))


@functools.lru_cache(maxsize=65536)
def _grad_placements(produced: Placements, required: Placements, active: tuple[bool, ...]
                     ) -> tuple[Placements, Placements]:
    """``grad_placements`` by the consumer's split per mesh dim: edge pricing asks for the
    same few placement pairs ~16,000 times on the Llama-3-8B shape."""
    grad_in = tuple(grad_placement_at_consumer(r, a) for r, a in zip(required, active))
    grad_out = tuple(grad_placement_at_producer(p) for p in produced)
    return grad_in, grad_out


def grad_sync_dims(produced: Placements, grad_in: Placements, mesh_shape: tuple[int, ...]) -> frozenset[int]:
    """Mesh dims where a parameter stored replicated gets a Partial gradient back from one
    consumer. The parameter's gradient is reduced there once per step, in buckets (as DDP
    does), over the union of its consumers' sync dims, never on the edge itself. A mesh dim
    of one rank has nothing to reduce."""
    return frozenset(d for d, (p, g) in enumerate(zip(produced, grad_in))
                     if is_replicate(p) and is_partial(g) and mesh_shape[d] > 1)


def param_grad_target(produced: Placements, grad_in: Placements, sync_dims: frozenset[int]) -> Placements:
    """Placement one consumer's gradient of a parameter is resharded to: Partial on the
    parameter's sync dims (the bucketed all-reduce sums it there; a replicated contribution
    becomes Partial for free by keeping it on one rank), else what the parameter's shard needs.

    The collectives of ``grad_in -> target`` do not depend on which sync dims besides this
    consumer's own are in ``sync_dims`` (on those dims the gradient is Replicate or Shard and
    the parameter Replicate: gathering to Partial or to Replicate runs the same all-gather),
    so ``edge_cost`` prices each edge with its own sync dims and the program, which needs the
    union of all consumers', runs the same collectives."""
    grad_out = tuple(grad_placement_at_producer(p) for p in produced)
    return tuple(Partial() if d in sync_dims else g for d, g in enumerate(grad_out))


def param_sync_calls(meta: TensorMeta, produced: Placements, sync_dims: frozenset[int], ctx: CostContext,
                     zero1: int | None = None) -> list[CollectiveCall]:
    """One parameter's share of the gradient buckets: an all-reduce of its local gradient on
    each sync dim, but a reduce-scatter of the padded gradient on its ZeRO-1 dim ``zero1``
    (``cost.zero1``). Its transfer time is the parameter's; latency is paid per bucket."""
    numel = local_numel(meta, produced, ctx.mesh.shape)
    grads = ctx.precision.for_gradients()
    return [CollectiveCall(REDUCE_SCATTER, d, grads.tensor_bytes(meta, padded_elements(numel, ctx.mesh.shape[d])),
                           bucketed=True) if d == zero1 else
            CollectiveCall(ALL_REDUCE, d, grads.tensor_bytes(meta, numel), bucketed=True) for d in sorted(sync_dims)]


@dataclass(frozen=True)
class EdgeCalls:
    """An edge's collectives both ways and their seconds per run, all of ``edge_cost`` but whether the forward
    runs again: a memory scenario's flags change only that (``EdgePrices`` keeps these per edge, not per scenario)."""

    forward: tuple[CollectiveCall, ...]
    backward: tuple[CollectiveCall, ...]
    unwaited: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]


def edge_cost(meta: TensorMeta, produced: Placements, required: Placements, consumer: Strategy,
              ctx: CostContext, *, from_parameter: bool, needs_grad: bool, recomputed: bool = False,
              saves_input: bool = True, regathered: bool = False, grouped: bool = False) -> EdgeCost:
    """Collectives between a producer's output and a consumer's input, both directions.

    Backward sends the consumer's gradient (placement from the consumer's split) back to
    the placement the producer's backward wants. A parameter's gradient is left Partial on
    the dims this consumer makes it Partial (``param_grad_target``); the bucketed all-reduce
    that sums it there is priced once per parameter (``param_sync_calls``), not per edge.
    The forward reshard runs again in backward when the consumer is ``recomputed`` (a
    checkpointed block replays it) or when it gathers a parameter the consumer saves
    (``saves_input``) and ``regathered`` (the consumer frees its gathered parameters after
    forward: ZeRO-3, FSDP's ``reshard_after_forward``); otherwise a resharded tensor the consumer
    saves is held until backward (``held_reshard_bytes``). ``grouped``: a parameter read once,
    whose gather (again) and gradient reduce-scatter join its block's one collective of each
    (``cost.groups``): priced at their transfers here, their group pays the call.
    """
    calls = edge_calls(meta, produced, required, consumer, ctx, from_parameter=from_parameter, needs_grad=needs_grad,
                       grouped=grouped)
    return priced_edge(calls, ctx, runs_again(ctx, from_parameter, needs_grad, recomputed, saves_input, regathered))


def priced_edge(calls: EdgeCalls, ctx: CostContext, again: bool) -> EdgeCost:
    """``edge_cost`` of an edge whose collectives are ``calls``, its forward run ``again`` in backward or not."""
    seconds = calls.forward_s + calls.backward_s + (calls.forward_s if again else ())
    return EdgeCost(sum(seconds) * step_repeats(ctx), calls.forward, calls.backward, calls.forward if again else (),
                    calls.unwaited)


def edge_calls(meta: TensorMeta, produced: Placements, required: Placements, consumer: Strategy, ctx: CostContext,
               *, from_parameter: bool, needs_grad: bool, grouped: bool = False) -> EdgeCalls:
    """``edge_cost``'s collectives, each way, and their seconds."""
    mesh, precision = ctx.mesh, ctx.precision
    forward = reshard(meta, produced, required, mesh, precision)
    if grouped:
        forward = grouped_calls(forward, ALL_GATHER, mesh)
    backward: list[CollectiveCall] = []
    unwaited = 0.0
    if ctx.train and needs_grad:
        grad_in, grad_out = grad_placements(produced, required, consumer)
        syncs = grad_sync_dims(produced, grad_in, mesh.shape) if from_parameter else frozenset()
        if from_parameter:  # a parameter's gradient is reduced at its own width (fp32)
            grad_out = param_grad_target(produced, grad_in, syncs)
        backward.extend(reshard(meta, grad_in, grad_out, mesh, precision.for_gradients() if from_parameter
                                else precision))
        if grouped and not syncs:  # one summed in the buckets too takes its own way (``runtime.grouped``)
            backward = grouped_calls(backward, REDUCE_SCATTER, mesh)
        # the runtime leaves it running only where it reduces at the parameter's own width (a bf16
        # model's gradient is cast up to fp32 first, and that path waits: ``_Redistribute.backward``)
        if backward and backward[-1].grouped:  # a group's reduce-scatter is left running whatever the width
            unwaited = collective_time(backward[-1], mesh)
        elif (from_parameter and precision.reduce_bytes_per_param == precision.master_bytes_per_param
                and _ends_scattering(grad_in, grad_out, mesh.shape)):
            unwaited = collective_time(backward[-1], mesh)
    return EdgeCalls(tuple(forward), tuple(backward), unwaited, tuple(collective_time(c, mesh) for c in forward),
                     tuple(collective_time(c, mesh) for c in backward))


@functools.lru_cache(maxsize=4096)
def _ends_scattering(src: Placements, dst: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """The redistribution's last step is a reduce-scatter over more than one rank (what
    ``Comm.run_unwaited`` leaves running)."""
    steps = redistribute_steps(src, dst)
    return bool(steps) and steps[-1].kind == REDUCE_SCATTER and mesh_shape[steps[-1].mesh_dim] > 1


def runs_again(ctx: CostContext, from_parameter: bool, needs_grad: bool, recomputed: bool,
               saves_input: bool, regathered: bool) -> bool:
    """The edge's forward reshard runs again in backward (see ``edge_cost``)."""
    if not ctx.train:
        return False
    return recomputed or (from_parameter and regathered and needs_grad and saves_input)


def held_reshard_bytes(meta: TensorMeta, produced: Placements, required: Placements, ctx: CostContext,
                       *, from_parameter: bool, recomputed: bool = False, needs_grad: bool = True,
                       saves_input: bool = True, regathered: bool = False, grouped: bool = False) -> float:
    """Bytes a tensor resharded for its consumer keeps alive until backward: the consumer's
    backward saves the resharded copy (a column-parallel linear saves its all-gathered input,
    a gathered parameter is held until backward). 0 when the tensor is used as produced, when
    the consumer's backward does not save it (or does not run), it recomputes it (a
    checkpointed block), and for a parameter gathered again in backward (ZeRO-3); ``grouped`` changes
    nothing here (a group's buffers are its members' copies). The producer's own output is
    priced by its node (held when its op or some consumer saves it). A parameter used as
    stored under mixed precision is read through a bf16 cast copy (``passes.cast_parameters``),
    which a saving consumer holds; consumers sharing one parameter's copy (tied weights) are
    each priced for it, an overcount of at most that copy."""
    if not ctx.train or recomputed or not saves_input:
        return 0.0
    copy = float(ctx.precision.tensor_bytes(meta, local_numel(meta, required, ctx.mesh.shape)))
    if tuple(produced) == tuple(required):
        # Under mixed precision the consumer reads (and saves) a cast copy of the fp32 master.
        return copy if from_parameter and ctx.precision.casts_parameters else 0.0
    if from_parameter and regathered:
        return 0.0
    if from_parameter:  # the parameter's node prices its state, not this copy
        return copy
    # The producer's node already prices its output as kept when a consumer saves it; the
    # saved copy replaces it when only this consumer keeps it, so only a larger copy adds
    # (sequence-split norm -> all-gathered input of a column linear: the gathered size).
    return max(0.0, copy - ctx.precision.tensor_bytes(meta, local_numel(meta, produced, ctx.mesh.shape)))
