"""What a random op's draw costs one rank, as ``autopar.runtime.random`` runs it.

The counter stream (the default) computes the rank's own elements only (``philox_spec``): their
region (rank 0's, ``LANES`` elements per counter where every rank's runs are whole counters,
else one counter per element) and the generator that runs on the device:

- a fused kernel (``hardware.draw_kernel``, CUDA: ``runtime.philox_triton``): one launch that
  writes the finish once (a mask's byte, a uniform's 4, a word's 8 per element), bound by that
  write or by its instructions (``KERNEL_OPS_*``, counted in its SASS) at ``int_op_rate``,
  whichever is slower. Priced from those figures: not measured (no GPU has run it yet).
- eager torch ops (CPU: ``runtime.philox_eager``): the ops it dispatches over chunks of ``CHUNK``
  counters (``philox_spec.eager_draw_ops``), each a fixed cost (``int_op_overhead``), and their
  element-ops at ``int_op_rate`` (the cpu profile's, measured: ``benchmarks/random.py --calibrate``).

Then what the sampler does with the generator's output beyond the op's own pass, which
``cost.model`` prices already (``SAMPLER_PASSES``): dropout scales (and reads the mask) in a
pass of its own; attention dropout runs entirely here, the attention op's price knowing nothing
of it; ``bernoulli_`` gets its 0/1 written in place by the draw. A normal draws twice. The
torch stream (``random_stream='torch'``) draws the global tensor on every rank: one op per
global element, written and read back for the rank's slice. Forward only (backward reuses the
mask); recomputation prices its draws again where it prices the block's forward again.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Placement

from autopar.cost.compute import roofline_time, with_fixed_cost
from autopar.cost.precision import Precision
from autopar.hardware import HardwareProfile
from autopar.mesh import Mesh
from autopar.philox_spec import (
    FINISH_BYTES,
    KERNEL_OPS_PER_COUNTER,
    KERNEL_OPS_PER_ELEMENT,
    LANES,
    Finish,
    eager_draw_ops,
    grouped_on_every_rank,
    rank_region,
)
from autopar.rules.dropout import ATTENTION_DROPOUT, DROPOUTS, FEATURE_DROPOUTS, drawn_numel
from autopar.rules.strategy import OpCall, Strategy, local_numel

aten = torch.ops.aten
BELOW = frozenset({*DROPOUTS, *FEATURE_DROPOUTS, *ATTENTION_DROPOUT, aten._fused_dropout.default,
                   aten.bernoulli.p, aten.bernoulli_.float})
"""Draws whose generator writes a mask (``word < threshold``): dropout in every form, a scalar Bernoulli."""
WORDS = frozenset({aten.randint.default, aten.randint.low, aten.randint_like.default, aten.randint_like.low_dtype,
                   aten.randperm.default})
NORMALS = frozenset({aten.normal_.default, aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
                     aten.normal.float_float, aten.randn.default, aten.randn_like.default, aten.log_normal.default,
                     aten.log_normal_.default})
"""Box-Muller: two uniforms an element, then about six passes of arithmetic."""
SAMPLER_PASSES: dict[object, int] = {
    **{t: 1 for t in (*DROPOUTS, *FEATURE_DROPOUTS, aten._fused_dropout.default, aten.bernoulli.p)},
    **{t: 2 for t in ATTENTION_DROPOUT},
    aten.bernoulli_.float: 0,
    **{t: 6 for t in NORMALS},
}
"""Elementwise passes (read and write one element each, and read the generator's output once)
the sampler runs past what ``cost.model`` prices for the op: dropout's scale (``x * keep *
scale``: two passes where the op is priced as one); the two passes of attention dropout, whose
op is priced without them; none for ``bernoulli_``; one for the rest (a cast, an affine map)."""


def draw_time(call: OpCall, strategy: Strategy, mesh: Mesh, precision: Precision, global_draws: bool = False) -> float:
    """Seconds one rank spends drawing ``call``'s random numbers (module docstring); 0 for
    a call that draws nothing."""
    n = drawn_numel(call)
    if n == 0:
        return 0.0
    out = call.outputs[0] if call.outputs and call.outputs[0] is not None else None
    width = precision.tensor_bytes(out, 1) if out is not None else precision.activation_bytes
    if global_draws:
        return roofline_time(float(n), 2.0 * n * width, mesh, precision)
    placements = strategy.outputs[0] if strategy.outputs and strategy.outputs[0] is not None else ()
    local = n * (local_numel(out, placements, mesh.shape) / out.numel) if out is not None and out.numel else n
    shape = drawn_shape(call)
    finish = _finish(call.target)
    hw = mesh.hardware
    if hw.draw_kernel:
        generator = kernel_time(local, finish, _grouped(shape, tuple(placements), mesh), hw)
    else:
        generator = eager_time(shape, tuple(placements), mesh, finish)
    draws = 2 if call.target in NORMALS else 1
    passes = SAMPLER_PASSES.get(call.target, 1)
    written = width if call.target == aten.bernoulli_.float else FINISH_BYTES[finish]  # in place: the tensor's dtype
    sampler = 0.0
    if passes:
        arithmetic = roofline_time(passes * local, local * (passes * 2 * width + written), mesh, precision)
        sampler = with_fixed_cost(arithmetic, hw.op_overhead * passes, hw)
    return draws * generator + sampler


def drawn_shape(call: OpCall) -> tuple[int, ...]:
    """The single-device shape of the tensor ``call`` draws (attention: its probabilities;
    feature dropout: one value per (batch, channel))."""
    if call.target in ATTENTION_DROPOUT:
        q, k = call.args[0], call.args[1]
        return (*q.shape[:-1], k.shape[-2])
    if call.target in FEATURE_DROPOUTS:
        x = call.args[0]
        return (*x.shape[:2], *(1,) * (x.ndim - 2))
    out = call.outputs[0]
    return tuple(out.shape) if out is not None else (drawn_numel(call),)


def kernel_time(local: float, finish: Finish, grouped: bool, hw: HardwareProfile) -> float:
    """The fused kernel's seconds for ``local`` elements: its integer instructions or its write,
    the slower, after its launch."""
    counters = local / (LANES if grouped else 1)
    ops = counters * KERNEL_OPS_PER_COUNTER + local * KERNEL_OPS_PER_ELEMENT
    compute = ops / (_int_rate(hw) * hw.compute_efficiency)
    memory = local * FINISH_BYTES[finish] / (hw.memory_bandwidth * hw.memory_efficiency)
    return with_fixed_cost(max(compute, memory), hw.op_overhead, hw)


def eager_time(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: Mesh, finish: Finish) -> float:
    """The eager draw's seconds on rank 0's region: its ops' fixed costs and element-ops."""
    hw = mesh.hardware
    region = rank_region(shape, placements, mesh.shape, (0,) * len(mesh.shape), mesh.zigzag_dims())
    ops, element_ops = eager_draw_ops(region, finish)
    return ops * (hw.int_op_overhead or hw.op_overhead) + element_ops / _int_rate(hw)


def _grouped(shape: tuple[int, ...], placements: tuple[Placement, ...], mesh: Mesh) -> bool:
    return grouped_on_every_rank(shape, placements, tuple(mesh.shape), mesh.zigzag_dims())


def _int_rate(hw: HardwareProfile) -> float:
    return hw.int_op_rate or hw.peak_flops_fp32 / 4


def _finish(target: object) -> Finish:
    if target in BELOW:
        return "below"
    return "words" if target in WORDS else "uniform"

