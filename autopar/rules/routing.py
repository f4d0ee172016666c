"""Mixture-of-experts routing and dispatch: top-k, sorts, gather / scatter along one dim,
``index_add``, ``index_copy``, ``slice_scatter``, ``index_put``, ``repeat_interleave``, histograms, and grouped
matmuls (``_grouped_mm`` and HF's opaque ``transformers::grouped_mm_fallback``).

Every op here works along one dim (the experts of ``topk``, the sorted dim, the dim indices
point into) and is independent across the others, so any other dim splits when every operand
holding it is split alike and has the same size there (a gather's index no shorter than its
source along that dim, or ranks would hold rows of different lengths). Gathers and scatters
move values without combining them, so they are linear in the values they move: Partial
values with replicated indices give a Partial result. A histogram counts elements, so any
split of its input gives Partial counts.

A grouped matmul multiplies row groups of ``input (tokens, in)`` by ``weight[e] (in, out)``,
the groups ending at ``offs``: the token rows must stay whole (the offsets count them globally),
but ``out`` splits as a column-parallel linear and ``in`` as a row-parallel one (Partial).
Splitting the experts (expert parallelism) needs an all-to-all of the tokens: see
notes/moe-design.md.
"""

from __future__ import annotations

import torch

from autopar.capture.graph import TensorMeta
from autopar.capture.moe import MOE_EXPERTS
from autopar.rules.strategy import P, R, DimStrategy, OpCall, S, normalize_dim, strided
from autopar.rules.table import RuleTable, Unhandled

aten = torch.ops.aten
TABLE = RuleTable("routing")

HF_GROUPED_MM = "transformers::grouped_mm_fallback"
"""Transformers' opaque grouped matmul (its ``experts_implementation="grouped_mm"`` under torch.export,
where ``torch._grouped_mm`` has no fp32 meta kernel); keyed by name: the op exists once transformers
registers it."""
GROUPED_MM = (aten._grouped_mm.default, HF_GROUPED_MM)


def _along(call: OpCall) -> int:
    x: TensorMeta = call.tensor_inputs[0]
    return normalize_dim(call.get("dim", -1), max(x.ndim, 1))


@TABLE.register(aten.topk.default, aten.sort.default, aten.sort.stable, aten.argsort.default,
                aten.argsort.stable)
def select_rule(call: OpCall) -> list[DimStrategy]:
    """Top-k and sorts need their dim whole; every other dim splits (values and indices alike)."""
    x: TensorMeta = call.tensor_inputs[0]
    along = _along(call)
    return [DimStrategy(tuple(S(d) for _ in call.outputs), (S(d),)) for d in range(x.ndim) if d != along]


def _same_size_dims(along: int, *tensors: TensorMeta) -> list[int]:
    """Dims other than ``along`` every tensor has at one size (so equal chunks line up)."""
    ndim = tensors[0].ndim
    return [d for d in range(ndim) if d != along and all(t.ndim == ndim and t.shape[d] == tensors[0].shape[d]
                                                          for t in tensors)]


@TABLE.register(aten.gather.default)
def gather_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """``out[..., i, ...] = self[..., index[..., i, ...], ...]`` along ``dim``."""
    x, index = call.tensor_inputs
    if x.ndim == 0:
        return Unhandled("a 0-d source")
    along = normalize_dim(call.get("dim"), x.ndim)
    strategies = [DimStrategy((S(d),), (S(d), S(d))) for d in _same_size_dims(along, x, index)]
    return [*strategies, DimStrategy((P,), (P, R))]


@TABLE.register(aten.scatter.src, aten.scatter_add.default, aten.scatter.value)
def scatter_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """``self`` with ``src`` (or a scalar) written (or added) at ``index`` along ``dim``."""
    tensors = call.tensor_inputs
    x = tensors[0]
    if x.ndim == 0:
        return Unhandled("a 0-d destination")
    along = normalize_dim(call.get("dim"), x.ndim)
    strategies = [DimStrategy((S(d),), (S(d),) * len(tensors)) for d in _same_size_dims(along, *tensors)]
    if call.target is not aten.scatter.value:  # a scalar written on every rank is not a sum of parts
        strategies.append(DimStrategy((P,), (P, R, P)))
    return strategies


@TABLE.register(aten.index_add.default, aten.index_add_.default, aten.index_copy.default,
                aten.index_copy_.default)
def index_add_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """``self`` plus ``alpha * source`` added at rows ``index`` (1-D) of ``dim``, or ``source``
    written there (``index_copy``: a KV cache's write at the step's positions, split by heads)."""
    x, index, source = call.tensor_inputs
    if x.ndim == 0:
        return Unhandled("a 0-d destination")
    along = normalize_dim(call.get("dim"), x.ndim)
    strategies = [DimStrategy((S(d),), (S(d), R, S(d))) for d in _same_size_dims(along, x, source)]
    return [*strategies, DimStrategy((P,), (P, R, P))]


@TABLE.register(aten.one_hot.default)
def one_hot_rule(call: OpCall) -> list[DimStrategy]:
    """Each index becomes a row of classes (transformers 4's expert mask): the index dims split alike;
    the new class dim stays whole (a rank's classes would need the offset of its share). Without
    ``num_classes`` the class count is the data's largest index plus one, which a rank's share of the
    indices need not reach: then it runs replicated (the whole answer, not a fallback)."""
    x: TensorMeta = call.tensor_inputs[0]
    if call.get("num_classes", -1) < 0:
        return []
    return [DimStrategy((S(d),), (S(d),)) for d in range(x.ndim)]


@TABLE.register(aten.where.default, aten.nonzero.default)
def nonzero_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """The positions of a mask's true elements (``token, slot = torch.where(chosen == e)``): they are
    global positions and their count is data (an unbacked size, ``capture.unbacked``), so the mask is
    read whole and the positions are replicated: no split of its rows gives a rank its share of them.
    Replication is the whole answer here, not a fallback."""
    return []


@TABLE.register(aten.slice_scatter.default)
def slice_scatter_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """``self`` with ``src`` written over ``self[start:end:step]`` along ``dim`` (a cache write at a
    range of positions): every other dim splits with ``src`` split alike; a copy is linear."""
    x, src = call.tensor_inputs
    if x.ndim == 0:
        return Unhandled("a 0-d destination")
    along = normalize_dim(call.get("dim"), x.ndim)
    strategies = [DimStrategy((S(d),), (S(d), S(d))) for d in _same_size_dims(along, x, src)]
    return [*strategies, DimStrategy((P,), (P, P))]


@TABLE.register(aten.index_put.default, aten.index_put_.default)
def index_put_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """``self[i0, ..., ik-1] = values`` (or ``+=`` with ``accumulate``) on the leading ``k`` dims:
    the trailing dims no index touches split, ``values`` split alike where it holds them (replicated
    where it broadcasts). With every dim indexed (HF's ``inv_perm[perm] = arange(n)``) nothing splits:
    the written positions are data, so replication is the whole answer, not a fallback."""
    x: TensorMeta = call.get("self")
    indices = list(call.get("indices"))
    values: TensorMeta = call.get("values")
    if any(t is None for t in indices):
        return Unhandled("an index list with a sliced (None) dim")
    if any(t.dtype in (torch.bool, torch.uint8) for t in indices):
        return Unhandled("a boolean mask index (data-dependent positions)")
    skip = (R,) * len(indices)
    strategies = []
    for d in range(len(indices), x.ndim):
        at = values.ndim - (x.ndim - d)  # values broadcast against self's trailing dims
        held = at >= 0 and values.shape[at] == x.shape[d]
        strategies.append(DimStrategy((S(d),), (S(d), *skip, S(at) if held else R)))
    if call.get("accumulate", False) and x.dtype.is_floating_point:  # self + sum of writes: linear in both
        strategies.append(DimStrategy((P,), (P, *skip, P)))
    return strategies


@TABLE.register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """Each row of ``dim`` repeated ``repeats`` times in place (HF's one copy of a token per choice):
    a rank's block of rows gives exactly its block of the output, so every dim splits; a copy is linear."""
    x: TensorMeta = call.get("self")
    if call.get("dim") is None and x.ndim != 1:
        return Unhandled("no dim: the input is flattened first")
    return [*(DimStrategy((S(d),), (S(d),)) for d in range(x.ndim)), DimStrategy((P,), (P,))]


@TABLE.register(aten.histc.default)
def histc_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """Counts per bin over all elements: each rank's counts of its elements sum to the total,
    provided the bins are fixed (``min < max``): with ``min == max`` histc spans the data's own
    range, which differs between ranks' parts."""
    x: TensorMeta = call.tensor_inputs[0]
    if call.get("min", 0) >= call.get("max", 0):
        return Unhandled("bins spanning the data's own range (min >= max)")
    return [DimStrategy((P,), (S(d),)) for d in range(x.ndim)]


@TABLE.register(*GROUPED_MM)
def grouped_mm_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """``input (tokens, in)`` x ``weight (experts, in, out)`` in groups of rows ending at ``offs``."""
    tensors = call.tensor_inputs
    if len(tensors) != 3 or tensors[0].ndim != 2 or tensors[1].ndim != 3:
        return Unhandled("only 2-d input x 3-d weight with offsets (bias, other forms)")
    if call.get("out_dtype") is not None:
        return Unhandled("an out_dtype (its Partial parts would be rounded apart)")
    return [DimStrategy((S(1),), (R, S(2), R)),  # column-parallel
            DimStrategy((P,), (S(1), S(1), R)),  # row-parallel: each rank sums its slice of ``in``
            DimStrategy((P,), (P, R, R)), DimStrategy((P,), (R, P, R))]


@TABLE.register(MOE_EXPERTS)
def moe_experts_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """A whole dropless expert layer (``capture.moe``): ``x (T, H)``, ``ids``, ``weights (T, k)``,
    ``gate_up (E, 2F, H)``, ``down (E, H, F)`` -> ``(T, H)``. Each token's output depends on its own
    rows alone, so the tokens split (each rank sorts its own pairs), with every expert on every
    rank, or with the experts split alike (expert parallelism: pairs travel to their expert's
    rank and back by variable-split all-to-alls, ``runtime.moe``, on one mesh dim at most:
    ``exclusive``). Inside the experts, ``F`` splits as a column-parallel then row-parallel
    pair, Partial: gate and up are stacked along ``2F``, so ``gate_up`` splits strided (each
    rank its slice of gate and of up, ``chunk(2)`` local)."""
    x, ids, weights, gate_up, down = call.tensor_inputs
    if x.ndim != 2 or ids.shape != weights.shape or gate_up.ndim != 3 or down.ndim != 3:
        return Unhandled("not the (T, H) tokens and (T, k) routing of capture.moe_region")
    return [DimStrategy((S(0),), (S(0), S(0), S(0), R, R)),
            DimStrategy((S(0),), (S(0),) * 5, exclusive=True),
            DimStrategy((P,), (R, R, R, strided(1, 2), S(2)))]
