"""Which ops selective activation checkpointing keeps: matmul and attention outputs (the
expensive ones to recompute, torchtitan's "op" policy); every other op of a checkpointed
block is recomputed in backward.

One list, two levels, so the runtime's policy and the cost model cannot drift apart:
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


def saved_by_selective(target: object) -> bool:
    """Whether the selective policy keeps the output of a graph node with this target."""
    return target in SAVED_GRAPH_OPS


def kept_by_policy(policy: str, target: object) -> bool:
    """True when ``policy`` keeps the output of a graph node with this target inside a
    checkpointed block (only "selective" keeps any)."""
    return policy == "selective" and saved_by_selective(target)
