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
of a contiguous split all of them.
"""

from __future__ import annotations

import functools
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
                    coordinate: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """The global positions of this rank's ``local_rows`` rows of a tensor split on ``dim`` by
    ``placements`` (mesh dim 0 outermost, as DTensor cuts; a strided shard holds its piece of
    every block), in the order the rank holds them."""
    ways = [n for p, n in zip(placements, mesh_shape) if shard_dim(p) == dim]
    positions = torch.arange(local_rows * (functools.reduce(int.__mul__, ways, 1)), device=device)
    for p, n, i in zip(placements, mesh_shape, coordinate):
        if shard_dim(p) != dim:
            continue
        factor = split_factor(p)
        positions = strided_take(positions, 0, factor, n, i) if factor > 1 else positions.chunk(n)[i]
    return positions


def causal_on_rows(target: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                   positions: torch.Tensor) -> Any:
    """``target(*args, **kwargs)`` (a causal attention call) for query rows at global
    ``positions``, against every key from position 0."""
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
    allowed = torch.arange(end, device=q.device)[None, :] <= positions.to(q.device)[:, None]  # [L_rows, end]
    bound.update(key=k, value=v, is_causal=False, attn_mask=_combined(allowed, mask, q.dtype, target))
    return target(**bound)


def _combined(allowed: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype,
              target: torch._ops.OpOverload) -> torch.Tensor:
    """The call's mask restricted to ``allowed``: a boolean mask and-ed, a float (additive)
    one set to -inf where not allowed. Without a mask, a boolean one, except for the CPU
    flash kernel, which takes masks of the query's dtype only."""
    if mask is None:
        if target is aten.scaled_dot_product_attention.default:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


class ContextAttention(nn.Module):
    """``self.context_attention(op, q_placements, *args, **kwargs)``: the causal attention
    ``op`` on this rank's query rows, q placed as ``q_placements`` (as printed in plans)."""

    def __init__(self, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        super().__init__()
        self.mesh_shape = tuple(mesh_shape)
        self.coordinate = tuple(coordinate)

    def forward(self, op: str, q_placements: str, *args: Any, **kwargs: Any) -> Any:
        target = _resolve(op)
        q = args[0] if args else kwargs["query"]
        positions = query_positions(q.shape[-2], q.ndim - 2, parse_placements(q_placements), self.mesh_shape,
                                    self.coordinate, q.device)
        return causal_on_rows(target, args, kwargs, positions)
