"""Compute cost per op: FLOPs and bytes, priced with a roofline per hardware profile."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch

from autopar.capture.graph import TensorMeta
from autopar.cost.precision import Precision
from autopar.hardware import HardwareProfile
from autopar.mesh import Mesh
from autopar.cost.moe import is_moe, moe_flops
from autopar.rules.attention import ATTENTION_OPS, busiest_pairs, ring_dim, splits_causal_rows
from autopar.rules.conv import CONV_OPS, is_transposed
from autopar.rules.ring import busiest_steps
from autopar.rules.routing import HF_GROUPED_MM
from autopar.rules.strategy import OpCall, Strategy, local_numel, shard_dim

aten = torch.ops.aten

# Ops that only re-describe memory: no kernel, no bytes moved, nothing saved for backward.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.t.default,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.alias.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
    aten.detach.default,
    # a complex view of real pairs and back (torch.view_as_complex / view_as_real): same storage
    aten.view_as_complex.default, aten.view_as_real.default,
    operator.getitem,  # picks one output of a multi-output op: Python, not even a dispatch
}

SHAPE_ONLY_ARGS: dict[object, tuple[int, ...]] = {
    aten.type_as.default: (1,),
    **{op: (0,) for op in (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                           aten.empty_like.default, aten.new_zeros.default, aten.new_ones.default,
                           aten.new_full.default, aten.new_empty.default)},
}
"""Inputs an op reads for their dtype, shape or device only, never their elements: ``x.type_as(y)``
casts x to y's dtype; a ``*_like`` or ``new_*`` factory writes a tensor shaped or typed like its input."""

INTERNAL_WRITES: dict[object, int] = {aten.cross_entropy_loss.default: 0}
"""Ops that write a tensor the size of one of their inputs (its index here) besides their outputs, and
read it back: ``cross_entropy_loss`` runs ``log_softmax`` over its logits, then ``nll_loss`` picks the
targets' entries of it (forward: read the logits, write their log-softmax; backward, at twice the
forward as every op: ``nll_loss``'s gradient written at the logits' size, ``log_softmax``'s backward
reading it and the log-softmax and writing the logits' gradient)."""


def op_flops(call: OpCall) -> float:
    """Forward FLOPs of the whole (unsplit) op."""
    target, inputs, outputs = call.target, call.tensor_inputs, call.outputs
    out = outputs[0] if outputs else None
    if target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default):
        a = inputs[1] if target is aten.addmm.default else inputs[0]
        return 2.0 * (out.numel if out else 0) * a.shape[-1]
    if target is aten.linear.default or is_grouped_mm(target):
        # a grouped matmul: each token row meets one expert's (in, out) matrix
        return 2.0 * (out.numel if out else 0) * inputs[0].shape[-1]
    if target is aten.einsum.default:
        sizes: dict[str, int] = {}
        for labels, meta in zip(call.args[0].replace(" ", "").split("->")[0].split(","), inputs):
            sizes.update(zip(labels, meta.shape))
        return 2.0 * math.prod(sizes.values())
    if is_moe(target):
        return moe_flops(call)
    if target in ATTENTION_OPS:
        return attention_flops(call, bool(call.get("is_causal", False)))
    if target in CONV_OPS:
        return conv_flops(call)
    if target in VIEW_OPS:
        return 0.0
    return float(sum(o.numel for o in outputs if o is not None))  # about one op per element


def attention_flops(call: OpCall, causal: bool) -> float:
    """QK^T and PV over every (query, key) pair, half of them when causal (a kernel skips
    the masked half)."""
    q, k = call.tensor_inputs[0], call.tensor_inputs[1]
    full = 4.0 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return full / 2 if causal else full


def rank_flops(call: OpCall, strategy: Strategy, ways: int, mesh: Mesh | None = None) -> float:
    """One rank's forward FLOPs when the op's work is split ``ways`` ways: its share, except
    for a causal attention split on its query rows (context parallelism). A rank runs its
    rows against the keys up to their last position with an explicit mask
    (``runtime.attention``), which no kernel skips, so the step waits for the busiest rank's
    rows x keys pairs (``rules.attention.busiest_pairs``): contiguous chunks on n ranks, the
    last rank's L/n x L, the non-causal share (twice the causal one); zig-zag chunks on a
    zig-zag axis of ``mesh``, (2n+1)/2n of the causal share. Ring attention: the sum of its
    steps' (``ring_step_flops``). Other splits divide evenly."""
    if ring_of(call, strategy) is not None:
        if mesh is None:
            raise ValueError("ring attention is priced on a mesh: its steps depend on the mesh's shape")
        return sum(ring_step_flops(call, strategy, ways, mesh))
    if strategy.inputs and call.tensor_inputs and splits_causal_rows(
            call.target, call.args, call.kwargs, strategy.inputs[0], call.tensor_inputs[0].ndim):
        if mesh is None:  # no mesh, no zig-zag axes: contiguous chunks, the last rank's rectangle
            return attention_flops(call, causal=False) / ways
        q, k = call.tensor_inputs[0], call.tensor_inputs[1]
        dim, placements = q.ndim - 2, tuple(strategy.inputs[0])
        rows = math.prod(n for p, n in zip(placements, mesh.shape) if shard_dim(p) == dim)
        pairs = busiest_pairs(q.shape[-2], dim, placements, mesh.shape, mesh.zigzag_dims())
        return attention_flops(call, causal=False) * pairs / (q.shape[-2] * k.shape[-2]) / (ways // rows)
    return op_flops(call) / ways


def ring_of(call: OpCall, strategy: Strategy) -> int | None:
    """The mesh dim an attention call runs ring attention on under ``strategy``, else None."""
    if len(strategy.inputs) < 3 or len(call.tensor_inputs) < 3:
        return None
    return ring_dim(call.target, strategy.inputs[1], call.tensor_inputs[1].ndim)


def ring_step_flops(call: OpCall, strategy: Strategy, ways: int, mesh: Mesh) -> list[float]:
    """One rank's forward FLOPs at each step of ring attention (``runtime.ring``): the busiest
    rank's pieces at that step (``rules.ring.busiest_steps``: causal blocks after the rows
    skipped, the diagonal's masked half skipped by the kernel), its batch and heads split
    ``ways`` over the sequence's splits."""
    q, k = call.tensor_inputs[0], call.tensor_inputs[1]
    ring = ring_of(call, strategy)
    assert ring is not None
    dim, placements = q.ndim - 2, tuple(strategy.inputs[0])
    rows = math.prod(n for d, (p, n) in enumerate(zip(placements, mesh.shape)) if shard_dim(p) == dim or d == ring)
    per_pair = attention_flops(call, causal=False) / (q.shape[-2] * k.shape[-2]) / (ways // rows)
    return [per_pair * pairs for pairs, _ in _steps(call, strategy, mesh)]


def ring_launches(call: OpCall, strategy: Strategy, mesh: Mesh, backward: bool = False) -> int:
    """Ops ring attention launches on the busiest rank, forward: per piece of each step
    (``rules.ring.step_pieces``) the kernel and its merge (``runtime.ring.merge``); backward:
    per piece the kernel's backward and the three gradients' additions."""
    return sum(pieces for _, pieces in _steps(call, strategy, mesh)) * (1 + (3 if backward else MERGE_OPS))


MERGE_OPS = 12
"""Ops of one online-softmax merge as ``runtime.ring.merge`` runs it (logaddexp, isinf,
zeros_like, where, two subtractions and exps, the multiplies, the addition and the copy)."""


def _steps(call: OpCall, strategy: Strategy, mesh: Mesh) -> tuple[tuple[int, int], ...]:
    q = call.tensor_inputs[0]
    ring = ring_of(call, strategy)
    assert ring is not None
    return busiest_steps(q.shape[-2], q.ndim - 2, tuple(strategy.inputs[0]), tuple(strategy.inputs[1]), mesh.shape,
                         ring, bool(call.get("is_causal", False)), mesh.zigzag_dims())


def is_grouped_mm(target: object) -> bool:
    """``aten._grouped_mm`` or a library's grouped matmul its rule is registered for by name."""
    if target is aten._grouped_mm.default:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.name() == HF_GROUPED_MM


def conv_flops(call: OpCall) -> float:
    """2 * output elements * input channels per group * kernel elements (a multiply-add per
    weight tap). A transposed convolution is the adjoint of a plain one: 2 * input elements
    * output channels per group * kernel elements. Bias additions are not counted (as
    torch.utils.flop_counter does not)."""
    x, weight = call.tensor_inputs[0], call.tensor_inputs[1]
    out = call.outputs[0]
    assert out is not None
    kernel = math.prod(weight.shape[2:])
    if is_transposed(call):  # weight [C_in, C_out / groups, *kernel]
        return 2.0 * x.numel * weight.shape[1] * kernel
    return 2.0 * out.numel * weight.shape[1] * kernel  # weight [C_out, C_in / groups, *kernel]


IN_PLACE_WRITES = {aten.index_put_.default, aten.index_copy_.default}
"""Ops writing some positions of their destination in place (a KV cache's new rows): they touch
those positions only, not the whole destination."""


def _written_numel(target: object, inputs: list[TensorMeta]) -> int:
    """Elements an in-place write (``IN_PLACE_WRITES``) stores: the indexed positions (the index
    tensors broadcast together) times the dims no index reaches; ``index_copy_``'s source."""
    if target is aten.index_copy_.default:
        return inputs[2].numel
    dest, indices = inputs[0], inputs[1:-1]
    positions = math.prod(torch.broadcast_shapes(*(tuple(t.shape) for t in indices)))
    return positions * math.prod(dest.shape[len(indices):])


def op_bytes(target: object, inputs: list[TensorMeta], outputs: tuple[TensorMeta | None, ...],
             precision: Precision, local_numel: Callable[[TensorMeta, int], int] | None = None) -> float:
    """Bytes the op reads and writes: whole tensors, or with ``local_numel(meta, k)`` the
    elements one rank holds of tensor ``k`` (inputs, then outputs, in order)."""
    if target in VIEW_OPS:
        return 0.0
    tensors = [*inputs, *outputs]

    def size(k: int, numel: int | None = None) -> int:
        t = tensors[k]
        assert t is not None
        if numel is None and local_numel is not None:
            numel = local_numel(t, k)
        return precision.tensor_bytes(t, numel)

    skipped = SHAPE_ONLY_ARGS.get(target, ())
    read = [0 if k in skipped else size(k) for k in range(len(inputs))]
    if target in (aten.index.Tensor, aten.gather.default) and outputs and outputs[0] is not None:
        # A gather reads the picked elements of its source, not all of it (an embedding-sized
        # table indexed by a few positions).
        picked = outputs[0].numel if local_numel is None else local_numel(outputs[0], len(inputs))
        read[0] = min(read[0], size(0, picked))
    written = [size(k) for k in range(len(inputs), len(tensors)) if tensors[k] is not None]
    if target in INTERNAL_WRITES:
        written.append(size(INTERNAL_WRITES[target]))
    if target in IN_PLACE_WRITES and written and inputs[0].numel:
        # the destination's written positions, on a rank its share of them (split on dims no index reaches)
        share = (local_numel(inputs[0], 0) if local_numel is not None else inputs[0].numel) / inputs[0].numel
        touched = round(_written_numel(target, inputs) * share)
        read[0], written[0] = size(0, touched), size(len(inputs), touched)
    return float(sum(read) + sum(written))


def roofline_time(flops: float, nbytes: float, mesh: Mesh, precision: Precision,
                  efficiency: float | None = None) -> float:
    """Seconds for one device: bound by compute (at ``efficiency`` of peak, default the profile's
    ``compute_efficiency``; ``op_efficiency`` gives an op's) or by memory traffic, whichever is
    slower."""
    hw = mesh.hardware
    compute = flops / (hw.peak_flops(precision.name) * (hw.compute_efficiency if efficiency is None else efficiency))
    memory = nbytes / (hw.memory_bandwidth * hw.memory_efficiency)
    return max(compute, memory)


MATMUL_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
                        aten.linear.default, aten.einsum.default, aten.baddbmm.default})
"""Ops priced on the profile's matmul curve (with grouped matmuls and MoE experts)."""


def op_efficiency(call: OpCall, strategy: Strategy, flops: float, mesh: Mesh, precision: Precision) -> float:
    """Fraction of ``precision``'s peak the op's compute reaches on one device of ``mesh``: a
    matmul at its FLOPs per call (``flops``, the rank's) on the profile's matmul curve; fused
    attention (bf16) at its key length on the rank and head dim on the attention curve; other
    ops, and any the profile has no curve for, at ``compute_efficiency``."""
    hw = mesh.hardware
    target = call.target
    if target in ATTENTION_OPS and precision.name == "bf16" and len(call.tensor_inputs) >= 2:
        q, k = call.tensor_inputs[0], call.tensor_inputs[1]
        curve = hw.attention_curve(q.shape[-1], bool(call.get("is_causal", False)))
        if curve is not None:
            splits = [p for p in strategy.inputs[1]] if len(strategy.inputs) > 1 else []
            ways = math.prod(n for p, n in zip(splits, mesh.shape) if shard_dim(p) == k.ndim - 2)
            return curve(k.shape[-2] / ways)
    if target in MATMUL_OPS or is_grouped_mm(target) or is_moe(target):
        curve = hw.matmul_curve(precision.name)
        if curve is not None and flops > 0:
            return curve(flops)
    return hw.compute_efficiency


def with_fixed_cost(work: float, fixed: float, hw: HardwareProfile) -> float:
    """Seconds of an op doing ``work`` seconds of device work after ``fixed`` seconds of
    dispatch: their sum where the host runs the op itself (CPU), the longer of the two where
    it dispatches ahead of the device (``overlapped_dispatch``: a kernel shorter than its
    launch leaves the device waiting on the host, a longer one hides it)."""
    return max(work, fixed) if hw.overlapped_dispatch else work + fixed


BACKWARD_FACTOR = 2.0
"""Backward costs about twice the forward: gradients for inputs and for weights."""


def gradient_sums_time(call: OpCall, strategy: Strategy, mesh: Mesh, precision: Precision,
                       grad_sums: tuple[int, ...]) -> float:
    """Seconds of the additions autograd runs as the op's gradients for its inputs join those their
    earlier readers sent (``grad_sums`` per tensor input, ``problem.gradients.gradient_sums``): each
    an elementwise add at the input's local size, reading two gradients and writing one, after its
    own fixed cost (a kernel of its own: eager autograd adds a second gradient into the first)."""
    hw = mesh.hardware
    total = 0.0
    for n, meta, placements in zip(grad_sums, call.tensor_inputs, strategy.inputs):
        if n and meta is not None and placements is not None:
            elements = local_numel(meta, placements, mesh.shape)
            work = roofline_time(float(elements), 3.0 * precision.tensor_bytes(meta, elements), mesh, precision)
            total += n * with_fixed_cost(work, hw.backward_op_overhead, hw)
    return total
