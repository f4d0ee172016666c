"""scaled_dot_product_attention(q [..., L, E], k [..., S, E], v [..., S, Ev], mask?).

Attention mixes positions only along the last two dims (queries L against keys S);
every leading dim (batch, heads, or any other batch-like dim: a 3-D ``(batch, seq,
dim)`` call has one, the usual 4-D ``(batch, heads, seq, head_dim)`` call two) is
independent, so any of them can split, with q, k, v, the mask and the outputs split on
it together. The leading dims are counted from the call's ranks, never assumed.

Operands line up with the output by right-aligned broadcasting: an operand holding
the dim at full size is split on it, one that broadcasts there (size 1, or missing)
is replicated. The mask broadcasts against ``(..., L, S)``. With grouped-query
attention (``enable_gqa``) k and v have fewer heads (dim -3): query head j reads kv
head j // (h / hkv), so contiguous blocks of query heads line up with contiguous
blocks of kv heads when the split divides hkv (the expansion checks that).

Context parallelism, all-gather K/V (as Llama-3 trained): the queries split on L, k, v and
the outputs' L dim with them, keys and values whole on every rank (their all-gather is
the reshard into this strategy; its backward reduce-scatters dK and dV). The mask splits
on its L dim (replicated where it broadcasts there). A non-causal call then runs as it is
on each rank's query rows. A causal one is top-left aligned on the global positions, so a
rank's rows need the causal mask of their own positions: ``passes.localize_attention``
rewrites it (``runtime.attention``); with dropout it is not offered (the draw and that
rewrite do not compose). Splitting S (ring attention) is not offered here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Placement

from autopar.capture.graph import TensorMeta
from autopar.rules.dropout import draws_random
from autopar.rules.strategy import R, DimStrategy, OpCall, Placements, S, schema_arg, shard_dim
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("attention")
ATTENTION_OPS = frozenset({aten.scaled_dot_product_attention.default,
                           aten._scaled_dot_product_flash_attention_for_cpu.default})


def _aligned(t: TensorMeta, out_dim: int, out_ndim: int, size: int, grouped: bool = False) -> Placement:
    """How operand ``t`` follows a split of output dim ``out_dim`` (right-aligned)."""
    from_right = out_ndim - out_dim
    if t.ndim < from_right:
        return R  # broadcast: every rank needs all of it
    own = t.shape[t.ndim - from_right]
    if own == size or (grouped and own > 1):
        return S(t.ndim - from_right)
    return R  # size 1, broadcast


def _attention_strategies(call: OpCall, q: TensorMeta, k: TensorMeta, v: TensorMeta) -> list[DimStrategy]:
    out = call.outputs[0]
    assert out is not None
    mask = call.get("attn_mask")
    gqa = bool(call.get("enable_gqa", False)) and k.shape[-3:-2] != q.shape[-3:-2]
    strategies = []
    for d in range(out.ndim - 2):  # the leading (batch-like) dims
        size = out.shape[d]
        if size == 1:
            continue
        heads = gqa and d == out.ndim - 3
        inputs = [_aligned(q, d, out.ndim, size), _aligned(k, d, out.ndim, size, heads),
                  _aligned(v, d, out.ndim, size, heads)]
        if isinstance(mask, TensorMeta):  # broadcast against (..., L, S): the same leading dims
            inputs.append(_aligned(mask, d, out.ndim, size))
        # Every output (the CPU kernel's logsumexp [..., L] too) starts with the leading dims.
        outputs = tuple(None if o is None else S(d) for o in call.outputs)
        strategies.append(DimStrategy(outputs, tuple(inputs)))
    sequence = _query_sequence_strategy(call, q, k, v)
    return strategies if sequence is None else [*strategies, sequence]


def is_causal(call: OpCall) -> bool:
    return bool(call.get("is_causal", False))


def splits_causal_rows(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], q_placements: Placements,
                       q_ndim: int) -> bool:
    """A causal attention call whose queries are split on L: it must run with its rows'
    global positions (``passes.localize_attention``), not as captured."""
    return (target in ATTENTION_OPS and bool(schema_arg(target, args, kwargs, "is_causal", False))
            and any(shard_dim(p) == q_ndim - 2 for p in q_placements))


def _query_sequence_strategy(call: OpCall, q: TensorMeta, k: TensorMeta, v: TensorMeta) -> DimStrategy | None:
    """Context parallelism by all-gathered K/V: q and every output split on L, k and v whole.
    None where L is 1, or a causal call draws dropout (see the module docstring)."""
    out = call.outputs[0]
    assert out is not None
    length = out.shape[-2]
    if length == 1 or (is_causal(call) and draws_random(call.target, call.args, call.kwargs)):
        return None
    inputs = [S(q.ndim - 2), R, R]
    mask = call.get("attn_mask")
    if isinstance(mask, TensorMeta):  # broadcast against (..., L, S): its dim -2 lines up with L
        inputs.append(S(mask.ndim - 2) if mask.ndim >= 2 and mask.shape[-2] == length else R)
    # out [..., L, Ev]; the CPU kernel's logsumexp [..., L]
    outputs = tuple(None if o is None else S(o.ndim - 2 if o.ndim == out.ndim else o.ndim - 1) for o in call.outputs)
    return DimStrategy(outputs, tuple(inputs))


@TABLE.register(aten.scaled_dot_product_attention.default)
def sdpa_rule(call: OpCall) -> list[DimStrategy]:
    return _attention_strategies(call, call.get("query"), call.get("key"), call.get("value"))


@TABLE.register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_cpu_rule(call: OpCall) -> list[DimStrategy]:
    """The CPU kernel returns (out, logsumexp [..., L]); attn_mask is keyword-only."""
    return _attention_strategies(call, call.get("query"), call.get("key"), call.get("value"))
