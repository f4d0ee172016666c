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
from autopar.rules.strategy import OpCall

aten = torch.ops.aten

# Ops that only re-describe memory: no kernel, no bytes moved, nothing saved for backward.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.t.default,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.expand.default, aten.slice.Tensor, aten.select.int, aten.alias.default, aten.flatten.using_ints,
    aten.unflatten.int, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
    aten.detach.default,
    operator.getitem,  # picks one output of a multi-output op: Python, not even a dispatch
}


def op_flops(call: OpCall) -> float:
    """Forward FLOPs of the whole (unsplit) op."""
    target, inputs, outputs = call.target, call.tensor_inputs, call.outputs
    out = outputs[0] if outputs else None
    if target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default):
        a = inputs[1] if target is aten.addmm.default else inputs[0]
        return 2.0 * (out.numel if out else 0) * a.shape[-1]
    if target is aten.linear.default:
        return 2.0 * (out.numel if out else 0) * inputs[0].shape[-1]
    if target is aten.einsum.default:
        sizes: dict[str, int] = {}
        for labels, meta in zip(call.args[0].replace(" ", "").split("->")[0].split(","), inputs):
            sizes.update(zip(labels, meta.shape))
        return 2.0 * math.prod(sizes.values())
    if target in (aten.scaled_dot_product_attention.default,
                  aten._scaled_dot_product_flash_attention_for_cpu.default):
        q, k = inputs[0], inputs[1]
        b_h = math.prod(q.shape[:-2])
        causal = bool(call.get("is_causal", False))
        full = 4.0 * b_h * q.shape[-2] * k.shape[-2] * q.shape[-1]  # QK^T and PV
        return full / 2 if causal else full
    if target in VIEW_OPS:
        return 0.0
    return float(sum(o.numel for o in outputs if o is not None))  # about one op per element


def op_bytes(target: object, inputs: list[TensorMeta], outputs: tuple[TensorMeta | None, ...],
             precision: Precision, local_numel: Callable[[TensorMeta, int], int] | None = None) -> float:
    """Bytes the op reads and writes: whole tensors, or with ``local_numel(meta, k)`` the
    elements one rank holds of tensor ``k`` (inputs, then outputs, in order)."""
    if target in VIEW_OPS:
        return 0.0
    tensors = [*inputs, *outputs]
    return float(sum(precision.tensor_bytes(t, None if local_numel is None else local_numel(t, k))
                     for k, t in enumerate(tensors) if t is not None))


def roofline_time(flops: float, nbytes: float, mesh: Mesh, precision: Precision) -> float:
    """Seconds for one device: bound by compute or by memory traffic, whichever is slower."""
    hw = mesh.hardware
    compute = flops / (hw.peak_flops(precision.name) * hw.compute_efficiency)
    memory = nbytes / (hw.memory_bandwidth * hw.memory_efficiency)
    return max(compute, memory)


def with_fixed_cost(work: float, fixed: float, hw: HardwareProfile) -> float:
    """Seconds of an op doing ``work`` seconds of device work after ``fixed`` seconds of
    dispatch: their sum where the host runs the op itself (CPU), the longer of the two where
    it dispatches ahead of the device (``overlapped_dispatch``: a kernel shorter than its
    launch leaves the device waiting on the host, a longer one hides it)."""
    return max(work, fixed) if hw.overlapped_dispatch else work + fixed


BACKWARD_FACTOR = 2.0
"""Backward costs about twice the forward: gradients for inputs and for weights."""
