"""scaled_dot_product_attention(q [b, h, s, d], k, v [b, hkv, s, d], mask?).

Attention is independent per batch row and per head, so split batch (everything
on dim 0) or heads (q, k, v on dim 1: with grouped-query attention query head j
reads kv head j // (h / hkv), so contiguous head blocks line up when hkv divides).
A mask follows a dim it has at full size and is replicated where it broadcasts.
Splitting the sequence is context parallelism (needs ring attention): not here.
"""

from __future__ import annotations

import torch

from autopar.capture.graph import TensorMeta
from torch.distributed.tensor import Placement

from autopar.rules.strategy import R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("attention")


def _mask_placement(mask: TensorMeta, dim: int, size: int) -> Placement:
    from_right = 4 - dim
    if mask.ndim >= from_right and mask.shape[mask.ndim - from_right] == size and size > 1:
        return S(mask.ndim - from_right)
    return R


@TABLE.register(aten.scaled_dot_product_attention.default)
def sdpa_rule(call: OpCall) -> list[DimStrategy]:
    q = call.args[0]
    mask = call.get("attn_mask")
    n_out = len(call.outputs)
    strategies = []
    for dim in (0, 1):
        inputs = [S(dim), S(dim), S(dim)]
        if isinstance(mask, TensorMeta):
            inputs.append(_mask_placement(mask, dim, q.shape[dim]))
        strategies.append(DimStrategy((S(dim),) * n_out, tuple(inputs)))
    return strategies


@TABLE.register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_cpu_rule(call: OpCall) -> list[DimStrategy]:
    """The CPU kernel returns (out, logsumexp[b, h, s]): both split like q."""
    mask = call.get("attn_mask")
    strategies = []
    for dim in (0, 1):
        inputs = [S(dim), S(dim), S(dim)]
        if isinstance(mask, TensorMeta):
            inputs.append(_mask_placement(mask, dim, call.args[0].shape[dim]))
        outputs = tuple(S(dim) if o is not None else None for o in call.outputs)
        strategies.append(DimStrategy(outputs, tuple(inputs)))
    return strategies
