"""Causal attention on a rank's query rows: what ``self.context_attention(...)`` calls in
per-rank programs run (``passes.localize_attention`` writes them).

A causal SDPA is top-left aligned on the whole sequence: query i sees keys 0..i. Split on
L (context parallelism with all-gathered keys and values, ``rules.attention``), a rank
holds query rows at global positions ``p`` (a contiguous run for a plain shard) and every
key, so ``is_causal=True`` on its rows would align them with keys 0.. as if they started
the sequence. Here the call runs with ``is_causal=False`` and an explicit mask of the
rank's own positions, ``key <= p``, combined with the call's mask if it has one. Keys past
the rank's last query position are never seen, so keys, values and the mask are cut there
first: a rank computes (and keeps for backward) only the keys it attends to, the last rank
of a contiguous split all of them. The causal mask (rows x keys) is made once per rank and
shared by every layer's call; the plan's memory does not count it (a boolean per row and
key: a 128k sequence on cp=8 holds 16k x 128k = 2 GiB of it; ring attention, which never
holds all keys at once, would not need it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from autopar.capture.schema import positional_args
from autopar.rules.attention import ATTENTION_OPS
from autopar.rules.redistribute import strided_take
from autopar.rules.strategy import Placements, parse_placements, shard_dim, split_factor

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _resolve(op: str) -> torch._ops.OpOverload:
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def query_positions(local_rows: int, dim: int, placements: Placements, mesh_shape: tuple[int, ...],
                    coordinate: tuple[int, ...]) -> torch.Tensor:
    """The global positions of this rank's ``local_rows`` rows of a tensor split on ``dim`` by
    ``placements`` (mesh dim 0 outermost, as DTensor cuts; a strided shard holds its piece of
    every block), in the order the rank holds them."""
    ways = [n for p, n in zip(placements, mesh_shape) if shard_dim(p) == dim]
    positions = torch.arange(local_rows * math.prod(ways))
    for p, n, i in zip(placements, mesh_shape, coordinate):
        if shard_dim(p) != dim:
            continue
        factor = split_factor(p)
        positions = strided_take(positions, 0, factor, n, i) if factor > 1 else positions.chunk(n)[i]
    return positions


def causal_on_rows(target: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                   positions: torch.Tensor, masks: dict[tuple[Any, ...], torch.Tensor] | None = None,
                   rows: Hashable = None) -> Any:
    """``target(*args, **kwargs)`` (a causal attention call) for query rows at global
    ``positions``, against every key from position 0. ``masks`` keeps the causal masks made,
    by ``rows`` (what determines ``positions``), for the next call on the same rows (every
    layer's): autograd then saves one mask for all of them, not one per layer."""
    if target not in ATTENTION_OPS:
        raise ValueError(f"causal_on_rows runs {sorted(map(str, ATTENTION_OPS))}, not {target}")
    names = [a.name for a in target._schema.arguments]
    bound = dict(zip(names, positional_args(target, args, kwargs)))
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    if not bound["is_causal"]:
        raise ValueError(f"causal_on_rows: {target} is not called with is_causal=True")
    if positions.numel() != q.shape[-2]:
        raise ValueError(f"{positions.numel()} query positions for {q.shape[-2]} query rows")
    end = int(positions.max()) + 1  # keys after the last query row are masked for every row
    k, v = k.narrow(-2, 0, end), v.narrow(-2, 0, end)
    if mask is not None and mask.shape[-1] > 1:
        mask = mask.narrow(-1, 0, end)
    # a mask of the call's own when it has one; else boolean, except for the CPU flash
    # kernel, which takes masks of the query's dtype only
    dtype = None if mask is None and target is aten.scaled_dot_product_attention.default else q.dtype
    key = (rows, end, dtype, q.device)
    causal = masks.get(key) if masks is not None and rows is not None else None
    if causal is None:
        allowed = torch.arange(end, device=q.device)[None, :] <= positions.to(q.device)[:, None]  # [rows, end]
        causal = allowed if dtype is None else _additive(allowed, dtype)
        if masks is not None and rows is not None:
            masks[key] = causal
    bound.update(key=k, value=v, is_causal=False, attn_mask=causal if mask is None else _combined(causal, mask))
    return target(**bound)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float mask: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _combined(causal: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The call's own mask restricted to the causal one (additive, of the mask's dtype): a
    boolean mask and-ed, a float one set to -inf where the causal mask forbids."""
    forbidden = ~causal if causal.dtype == torch.bool else causal.isinf()
    if mask.dtype == torch.bool:
        return mask & ~forbidden
    return mask.masked_fill(forbidden, float("-inf"))


class ContextAttention(nn.Module):
    """``self.context_attention(op, q_placements, *args, **kwargs)``: the causal attention
    ``op`` on this rank's query rows, q placed as ``q_placements`` (as printed in plans).
    It keeps the causal masks it makes (one per distinct rows and dtype: every layer of a
    model shares one)."""

    def __init__(self, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        super().__init__()
        self.mesh_shape = tuple(mesh_shape)
        self.coordinate = tuple(coordinate)
        self.masks: dict[tuple[Any, ...], torch.Tensor] = {}

    def forward(self, op: str, q_placements: str, *args: Any, **kwargs: Any) -> Any:
        target = _resolve(op)
        q = args[0] if args else kwargs["query"]
        positions = query_positions(q.shape[-2], q.ndim - 2, parse_placements(q_placements), self.mesh_shape,
                                    self.coordinate)
        return causal_on_rows(target, args, kwargs, positions, self.masks, (q_placements, q.shape[-2], q.ndim))
