"""Causal attention on a rank's query rows: what ``self.context_attention(...)`` calls in
per-rank programs run (``passes.localize_attention`` writes them).

A causal SDPA is top-left aligned on the whole sequence: query i sees keys 0..i. Split on
L (context parallelism with all-gathered keys and values, ``rules.attention``), a rank
holds query rows at global positions ``p`` (a contiguous run for a plain shard; two mirrored
runs on a zig-zag axis, ``Mesh.zigzag``) and every key, in global order (a zig-zag all-gather
puts the pieces back in order), so ``is_causal=True`` on its rows would align them with keys
0.. as if they started the sequence. Here each run of consecutive positions is one call with
``is_causal=False`` and an explicit mask of its own positions, ``key <= p``, combined with the
call's mask if it has one. Keys past the run's last position are never seen, so keys, values
and the mask are cut there first: a run computes (and keeps for backward) only the keys it
attends to, the last rank of a contiguous split all of them; on a zig-zag axis rank i's runs
end at chunks i and 2n-1-i of 2n, so every rank reads 2n+1 chunks of keys (``cost.compute``).
Keys are put back in order rather than masked where they lie: a cut needs the prefix of
each run contiguous, and the reorder is one copy of K and V per layer (priced with the
gather, ``cost.collectives.zigzag_reorder_time``) against a rectangle of rows x keys of
attention work; masked where they lie, every rank would compute all of its rows x keys. The
causal mask (rows x keys) is made once per rank and shared by every layer's call; the plan's memory does not count it (a boolean per row and
key: a 128k sequence on cp=8 holds 16k x 128k = 2 GiB of it; ring attention, which never
holds all keys at once, would not need it).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from autopar.capture.schema import positional_args
from autopar.rules.attention import ATTENTION_OPS, held_chunks, query_positions, runs
from autopar.rules.strategy import parse_placements

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _resolve(op: str) -> torch._ops.OpOverload:
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def causal_on_rows(target: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any],
                   positions: torch.Tensor, masks: dict[tuple[Any, ...], torch.Tensor] | None = None,
                   rows: Hashable = None, chunks: int = 1) -> Any:
    """``target(*args, **kwargs)`` (a causal attention call) for query rows at global
    ``positions``, against every key from position 0 (keys in their global order). Each run
    of consecutive positions in each of the ``chunks`` the rank holds (``runs``) is one call,
    against the keys up to its last position: a zig-zag rank's early chunk reads few keys,
    its late chunk many. ``masks`` keeps the causal masks made, by ``rows`` (what determines
    ``positions``), for the next call on the same rows (every layer's): autograd then saves
    one mask for all of them."""
    if target not in ATTENTION_OPS:
        raise ValueError(f"causal_on_rows runs {sorted(map(str, ATTENTION_OPS))}, not {target}")
    names = [a.name for a in target._schema.arguments]
    bound = dict(zip(names, positional_args(target, args, kwargs)))
    q = bound["query"]
    if not bound["is_causal"]:
        raise ValueError(f"causal_on_rows: {target} is not called with is_causal=True")
    if positions.numel() != q.shape[-2]:
        raise ValueError(f"{positions.numel()} query positions for {q.shape[-2]} query rows")
    outs = [_causal_run(target, bound, positions, first, count, masks, rows) for first, count in
            runs(positions, q.shape[-2] // chunks)]
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=-2)
    # the CPU kernel's (out [..., L, Ev], logsumexp [..., L]): each along its L
    return tuple(torch.cat(parts, dim=-2 if parts[0].ndim == q.ndim else -1) for parts in zip(*outs))


def _causal_run(target: torch._ops.OpOverload, bound: dict[str, Any], positions: torch.Tensor, first: int,
                count: int, masks: dict[tuple[Any, ...], torch.Tensor] | None, rows: Hashable) -> Any:
    """The call on rows ``first .. first + count`` (consecutive positions) against keys
    0..their last position; keys after it are masked for every row, so they are cut."""
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    mine = positions[first:first + count]
    end = int(mine[-1]) + 1
    q, k, v = q.narrow(-2, first, count), k.narrow(-2, 0, end), v.narrow(-2, 0, end)
    if mask is not None:
        if mask.ndim >= 2 and mask.shape[-2] > 1:
            mask = mask.narrow(-2, first, count)
        if mask.shape[-1] > 1:
            mask = mask.narrow(-1, 0, end)
    # a mask of the call's own when it has one; else boolean, except for the CPU flash
    # kernel, which takes masks of the query's dtype only
    dtype = None if mask is None and target is aten.scaled_dot_product_attention.default else q.dtype
    key = (rows, first, end, dtype, q.device)
    causal = masks.get(key) if masks is not None and rows is not None else None
    if causal is None:
        allowed = torch.arange(end, device=q.device)[None, :] <= mine.to(q.device)[:, None]  # [rows, end]
        causal = allowed if dtype is None else _additive(allowed, dtype)
        if masks is not None and rows is not None:
            masks[key] = causal
    run = dict(bound, query=q, key=k, value=v, is_causal=False,
               attn_mask=causal if mask is None else _combined(causal, mask))
    return target(**run)


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

    def __init__(self, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                 zigzag: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.mesh_shape = tuple(mesh_shape)
        self.coordinate = tuple(coordinate)
        self.zigzag = frozenset(zigzag)
        self.masks: dict[tuple[Any, ...], torch.Tensor] = {}

    def forward(self, op: str, q_placements: str, *args: Any, **kwargs: Any) -> Any:
        target = _resolve(op)
        q = args[0] if args else kwargs["query"]
        placements = parse_placements(q_placements)
        positions = query_positions(q.shape[-2], q.ndim - 2, placements, self.mesh_shape, self.coordinate, self.zigzag)
        return causal_on_rows(target, args, kwargs, positions, self.masks, (q_placements, q.shape[-2], q.ndim),
                              held_chunks(q.ndim - 2, placements, self.zigzag))
