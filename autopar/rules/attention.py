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
rewrite do not compose).

Context parallelism, ring attention: q, k, v and the outputs all split on their sequence dim on
one mesh dim (``exclusive``: the ring runs on one process group), the mask on its L dim as above
(its key dim whole: each step reads the columns of the keys it holds). Keys and values are
never gathered: ``passes.localize_attention`` runs the call as ``runtime.ring``, which passes
the K/V blocks around the ring and merges the blocks' outputs by their log-sum-exp. The
placement tells the two apart: k split on its sequence dim is the ring (``ring_dim``). Offered
for self-attention (as many keys as queries) without dropout, with a boolean mask or none.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
from torch.distributed.tensor import Placement

from autopar.capture.graph import TensorMeta
from autopar.rules.dropout import draws_random
from autopar.rules.redistribute import strided_take, zigzag_take
from autopar.rules.strategy import R, DimStrategy, OpCall, Placements, S, schema_arg, shard_dim, split_factor
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
    sequence = [s for s in (_query_sequence_strategy(call, q, k, v), _ring_strategy(call, q, k, v)) if s is not None]
    return [*strategies, *sequence]


def is_causal(call: OpCall) -> bool:
    return bool(call.get("is_causal", False))


def splits_causal_rows(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], q_placements: Placements,
                       q_ndim: int) -> bool:
    """A causal attention call whose queries are split on L against gathered keys: it must run
    with its rows' global positions (``passes.localize_attention``), not as captured (a ring
    attention call, ``ring_dim``, knows its positions by itself)."""
    return (target in ATTENTION_OPS and bool(schema_arg(target, args, kwargs, "is_causal", False))
            and any(shard_dim(p) == q_ndim - 2 for p in q_placements))


def query_positions(local_rows: int, dim: int, placements: Placements, mesh_shape: tuple[int, ...],
                    coordinate: tuple[int, ...], zigzag: frozenset[int] = frozenset()) -> torch.Tensor:
    """The global positions of this rank's ``local_rows`` rows of a tensor split on ``dim`` by
    ``placements`` (mesh dim 0 outermost, as DTensor cuts; a strided shard holds its piece of
    every block, a zig-zag one, on the mesh dims in ``zigzag``, two mirrored chunks), in the
    order the rank holds them."""
    ways = [n for p, n in zip(placements, mesh_shape) if shard_dim(p) == dim]
    positions = torch.arange(local_rows * math.prod(ways))
    for d, (p, n, i) in enumerate(zip(placements, mesh_shape, coordinate)):
        if shard_dim(p) != dim:
            continue
        factor = split_factor(p)
        if d in zigzag and n > 1:
            positions = zigzag_take(positions, 0, factor, n, i)
        else:
            positions = strided_take(positions, 0, factor, n, i) if factor > 1 else positions.chunk(n)[i]
    return positions


def held_chunks(dim: int, placements: Placements, zigzag: frozenset[int]) -> int:
    """Chunks of dim ``dim`` a rank holds: one per block of a strided shard, two per zig-zag
    mesh dim splitting it (``rules.redistribute.zigzag_view``)."""
    held = 1
    for d, p in enumerate(placements):
        if shard_dim(p) == dim:
            held *= split_factor(p) * (2 if d in zigzag else 1)
    return held


def runs(positions: torch.Tensor, chunk: int) -> list[tuple[int, int]]:
    """(first row, rows) of each run of consecutive positions within one held chunk of
    ``chunk`` rows, in row order: one for a plain shard, two for a zig-zag one (the middle
    rank's two chunks are adjacent, yet each is cut at its own last key)."""
    steps = ((positions[1:] - positions[:-1]) != 1).nonzero().flatten().add(1).tolist()
    breaks = sorted({0, *steps, *range(chunk, positions.numel(), chunk), positions.numel()})
    return [(a, b - a) for a, b in zip(breaks[:-1], breaks[1:])]


@functools.lru_cache(maxsize=4096)
def busiest_pairs(length: int, dim: int, placements: Placements, mesh_shape: tuple[int, ...],
                  zigzag: frozenset[int]) -> int:
    """(query row, key) pairs the busiest rank computes for a causal attention of ``length``
    queries split on ``dim`` by ``placements``, as ``runtime.attention`` runs it: each run of
    consecutive positions against every key up to its last one, masked (no kernel skips the
    masked half). Contiguous on n ranks the last rank's L/n rows read all L keys, L^2/n pairs,
    twice a balanced share of the causal L^2/2; zig-zag (2n chunks of c = L/2n, rank i holding
    chunks i and 2n-1-i, as Megatron-LM's and TransformerEngine's context parallelism and
    torch's ``_HeadTailLoadBalancer`` cut) every rank's runs end at chunks i+1 and 2n-i,
    c * (i+1) c + c * (2n-i) c = (2n+1) c^2 pairs: (2n+1)/2n of the balanced share."""
    ways = [n for p, n in zip(placements, mesh_shape) if shard_dim(p) == dim]
    splitting = [d for d, p in enumerate(placements) if shard_dim(p) == dim]
    busiest = 0
    for coordinate in itertools.product(*(range(n) for n in ways)):
        full = [0] * len(mesh_shape)
        for d, i in zip(splitting, coordinate):
            full[d] = i
        local = length // math.prod(ways)
        positions = query_positions(local, dim, placements, mesh_shape, tuple(full), zigzag)
        chunk = local // held_chunks(dim, placements, zigzag)
        busiest = max(busiest, sum(count * (int(positions[first + count - 1]) + 1)
                                   for first, count in runs(positions, chunk)))
    return busiest


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


def _ring_strategy(call: OpCall, q: TensorMeta, k: TensorMeta, v: TensorMeta) -> DimStrategy | None:
    """Ring attention: q, k, v and every output split on their sequence dim (module docstring).
    None where L is 1, the keys are not the queries' positions (L != S), dropout is drawn (each
    block would draw its own), the shapes are not the kernel's (``_kernel_shapes``), or its mask is a float bias
    (which may want a gradient, the scores' gradient, which the kernel's backward does not give)."""
    gathered = _query_sequence_strategy(call, q, k, v)
    if (gathered is None or k.shape[-2] != q.shape[-2] or float(call.get("dropout_p", 0.0) or 0.0) > 0.0
            or not _kernel_shapes(q, k, v) or (isinstance(mask := call.get("attn_mask"), TensorMeta)
                                                and mask.dtype != torch.bool)):
        return None
    inputs = (gathered.inputs[0], S(k.ndim - 2), S(v.ndim - 2), *gathered.inputs[3:])
    return DimStrategy(gathered.outputs, inputs, exclusive=True)


def _kernel_shapes(q: TensorMeta, k: TensorMeta, v: TensorMeta) -> bool:
    """Shapes the kernel ``runtime.ring`` runs takes: (batch, heads, seq, dim), a 3-D call with
    one head, q, k and v of one batch (no broadcast: each gets its own gradient) and grouped
    keys and values heads dividing the queries'."""
    batch = q.ndim - 2 if q.ndim == 3 else q.ndim - 3  # the dims before heads (before seq when 3-D)
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim or \
            not q.shape[:batch] == k.shape[:batch] == v.shape[:batch]:
        return False
    return q.ndim == 3 or (k.shape[-3] == v.shape[-3] and q.shape[-3] % k.shape[-3] == 0)


def ring_dim(target: Any, kv_placements: Placements, kv_ndim: int) -> int | None:
    """The mesh dim an attention call runs ring attention on: where its keys are split on their
    sequence dim (``_ring_strategy``); None for every other strategy."""
    if target not in ATTENTION_OPS:
        return None
    return next((d for d, p in enumerate(kv_placements) if shard_dim(p) == kv_ndim - 2), None)


@TABLE.register(aten.scaled_dot_product_attention.default)
def sdpa_rule(call: OpCall) -> list[DimStrategy]:
    return _attention_strategies(call, call.get("query"), call.get("key"), call.get("value"))


@TABLE.register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_cpu_rule(call: OpCall) -> list[DimStrategy]:
    """The CPU kernel returns (out, logsumexp [..., L]); attn_mask is keyword-only."""
    return _attention_strategies(call, call.get("query"), call.get("key"), call.get("value"))
