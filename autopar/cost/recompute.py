"""Which ops selective activation checkpointing keeps; every other op of a checkpointed block is
recomputed in backward. Two policies keep some:
- 'selective': every matmul and attention output (the expensive ones to recompute);
- 'selective_op': torchtitan's op-level policy (``selective_ac_option="op"``): attention outputs,
  and of each block's linear-layer matmuls (``mm``, and ``addmm`` for a biased one, counted in
  the order the block runs them) the first, third, fifth...; the others are recomputed.

One list, two levels, so the runtime's policy and the cost model cannot drift apart ('selective_op'
counts graph nodes that each run one counted kernel, and the runtime checks the count):
- ``SAVED_GRAPH_OPS``: the ops as captured in the FX graph the planner prices
  (``aten.linear``, ``aten.scaled_dot_product_attention``, ...);
- ``SAVED_DISPATCH_OPS``: the ops torch's selective-checkpoint policy sees at the
  dispatcher, after the composite ones above decompose (``linear`` -> ``addmm``/``mm``,
  ``scaled_dot_product_attention`` -> the backend's kernel, or ``bmm`` on the math path).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

_ATTENTION_KERNELS = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_fused_attention_overrideable.default,
    aten._flash_attention_forward.default,
    aten._efficient_attention_forward.default,
})
"""SDPA backends' kernels: they run at the dispatcher and may also be captured as they are."""

_MATMUL_KERNELS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._int_mm.default, aten._scaled_mm.default, aten._grouped_mm.default,
})

SAVED_DISPATCH_OPS: frozenset[torch._ops.OpOverload] = _MATMUL_KERNELS | _ATTENTION_KERNELS
"""Ops whose outputs the selective policy saves (``CheckpointPolicy.MUST_SAVE``). The math
attention path (taken when attention draws dropout) decomposes into ``bmm``s, so its
scores and output are saved as the matmuls they are."""

SAVED_GRAPH_OPS: frozenset[torch._ops.OpOverload] = SAVED_DISPATCH_OPS | frozenset({
    aten.linear.default, aten.matmul.default, aten.einsum.default,
    aten.scaled_dot_product_attention.default,
})
"""The same ops as captured in an FX graph: a node with one of these targets keeps its
output under the selective policy; every other node of the block is recomputed."""


OP_COUNTED_DISPATCH_OPS: frozenset[torch._ops.OpOverload] = frozenset({aten.mm.default, aten.addmm.default})
"""The matmuls 'selective_op' counts at the dispatcher (a linear layer's: torchtitan counts ``mm``)."""

OP_COUNTED_GRAPH_OPS: frozenset[torch._ops.OpOverload] = frozenset({aten.linear.default, aten.mm.default,
                                                                     aten.addmm.default})
"""The graph ops that each run one of ``OP_COUNTED_DISPATCH_OPS``: the planner counts these (the
runtime checks that a region ran as many as it was planned with)."""

OP_UNSURE_GRAPH_OPS: frozenset[torch._ops.OpOverload] = frozenset({aten.matmul.default, aten.einsum.default})
"""Graph ops that run an ``mm`` or not by their operands' layout at run time (a 1-D or 2-D operand
folds into one): a 'selective_op' block holding one with such an operand cannot be counted ahead."""

OP_SAVED_DISPATCH_OPS: frozenset[torch._ops.OpOverload] = _ATTENTION_KERNELS
"""The ops whose outputs 'selective_op' always keeps (torchtitan's list, its float8 and tensor-parallel
entries aside): the attention kernels."""

_ATTENTION_GRAPH_OPS = _ATTENTION_KERNELS | frozenset({aten.scaled_dot_product_attention.default})


def counted_by_op_policy(target: object) -> bool:
    """Whether a graph node with this target is a matmul 'selective_op' counts."""
    return target in OP_COUNTED_GRAPH_OPS


def saved_by_selective(target: object) -> bool:
    """Whether the selective policy keeps the output of a graph node with this target."""
    return target in SAVED_GRAPH_OPS


def kept_by_policy(policy: str, target: object, matmul_index: int = 0, draws: bool = False) -> bool:
    """True when ``policy`` keeps the output of a graph node with this target inside a
    checkpointed block; ``matmul_index``: for a counted matmul, how many its block ran before it;
    ``draws``: the node draws random numbers (an attention with dropout runs torch's math path,
    ``bmm`` and softmax, no attention kernel: 'selective_op' keeps none of it)."""
    if policy == "selective":
        return saved_by_selective(target)
    if policy == "selective_op":
        if counted_by_op_policy(target):
            return matmul_index % 2 == 0
        return target in _ATTENTION_GRAPH_OPS and not draws
    return False
