"""Views and data movement: view/reshape/flatten/unflatten/expand/transpose/permute/
(un)squeeze, slice/select, pad, cat/stack, split/chunk, getitem.

Dimension mapping comes from DTensor's own view analysis (``_view_ops``): for each
output dim it says which input dim(s) it came from. A split can follow a dim that
maps straight through, the first (outermost) dim of a flatten, or the first piece
of an unflatten (its size must divide: the expansion checks that on the output).
Every view is linear, so Partial passes through unchanged.

Strided shards (``strided(d, k)``: k blocks, each split across the ranks) end here:
splitting dim d into k equal pieces gives every piece plain ``Shard(d)``, and
unflattening dim d into ``(k, m, ...)`` gives ``Shard`` on the ``m`` dim (the ranks'
pieces of each block are slices of ``m``). The solver makes a strided shard only
where such a consumer asks for it.
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Placement
from torch.distributed.tensor._ops import _view_ops as dt_views

from autopar.rules.pointwise import broadcast_strategies
from autopar.rules.strategy import P, R, DimStrategy, OpCall, S, normalize_dim, strided
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("view")


def _dim_map(call: OpCall) -> tuple:
    x = call.args[0]
    t = call.target
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        if not call.outputs[0].shape:  # to a scalar: nothing to map
            return ()
        return dt_views.view_groups(x.shape, call.outputs[0].shape)
    if t is aten.flatten.using_ints:
        return dt_views.dim_flatten(x.ndim, call.get("start_dim", 0), call.get("end_dim", -1))
    if t is aten.unflatten.int:
        return dt_views.view_groups(x.shape, call.outputs[0].shape)
    if t is aten.expand.default:
        return dt_views.expand(x.shape, call.outputs[0].shape)
    if t is aten.transpose.int:  # a 0-d tensor (dims 0 or -1) is returned as it is
        return dt_views.dim_transpose(x.ndim, call.args[1], call.args[2]) if x.ndim else ()
    if t is aten.t.default:  # a 0-d or 1-d tensor is returned as it is
        return dt_views.dim_transpose(x.ndim, 0, -1) if x.ndim == 2 else tuple(map(dt_views.InputDim, range(x.ndim)))
    if t is aten.permute.default:
        return tuple(dt_views.InputDim(normalize_dim(d, x.ndim)) for d in call.args[1])
    if t is aten.unsqueeze.default:
        return dt_views.dim_unsqueeze(x.ndim, call.args[1])
    if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        return dt_views.dim_squeeze(x.shape, call.get("dim"))
    raise KeyError(t)


def _source_dim(spec: object, shape: tuple[int, ...]) -> int | None:
    """The input dim whose split this output dim inherits, if any. A flatten's leading
    size-1 dims hold no blocks (``flatten(0, 1)`` of a ``(1, s, v)`` sequence split on s is
    split on s), as DTensor's ``view_groups`` drops them; its ``dim_flatten`` keeps them."""
    if isinstance(spec, dt_views.InputDim):
        return spec.input_dim
    if isinstance(spec, dt_views.Flatten):
        for piece in spec.input_dims:
            if not isinstance(piece, dt_views.InputDim):
                return None
            if shape[piece.input_dim] != 1:
                return piece.input_dim
        return None
    if isinstance(spec, dt_views.Split) and spec.split_id == 0:
        return _source_dim(spec.input_dim, shape)
    return None


def _strided_blocks(spec: object) -> tuple[int, int] | None:
    """(input dim, k) when this output dim is the second piece of unflattening an input
    dim into ``(k, ...)`` with k > 1: a ``strided(dim, k)`` input is then sharded here."""
    if (isinstance(spec, dt_views.Split) and spec.split_id == 1 and isinstance(spec.input_dim, dt_views.InputDim)
            and spec.group_shape[0] > 1):
        return spec.input_dim.input_dim, int(spec.group_shape[0])
    return None


def view_rule(call: OpCall) -> list[DimStrategy]:
    if call.args[0].numel == 0:  # nothing to split; DTensor's view_groups loops forever on size-0 dims
        return [DimStrategy((P,), (P,))]
    strategies = []
    for out_dim, spec in enumerate(_dim_map(call)):
        src = _source_dim(spec, tuple(call.args[0].shape))
        if src is not None and call.args[0].shape[src] > 1:
            strategies.append(DimStrategy((S(out_dim),), (S(src),)))
        blocks = _strided_blocks(spec)
        if blocks is not None:
            strategies.append(DimStrategy((S(out_dim),), (strided(blocks[0], blocks[1]),)))
    strategies.append(DimStrategy((P,), (P,)))
    return strategies


TABLE.add([aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
           aten.unflatten.int, aten.expand.default, aten.transpose.int, aten.t.default,
           aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
           aten.squeeze.default], view_rule)


@TABLE.register(aten.slice.Tensor)
def slice_rule(call: OpCall) -> list[DimStrategy]:
    """Slicing along ``dim`` needs it whole; every other dim splits."""
    x = call.args[0]
    dim = normalize_dim(call.get("dim", 0), x.ndim)
    out = call.outputs[0]
    full = out is not None and out.shape == x.shape  # a no-op slice keeps every split
    strategies = [DimStrategy((S(d),), (S(d),)) for d in range(x.ndim) if d != dim or full]
    return [*strategies, DimStrategy((P,), (P,))]


@TABLE.register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(call: OpCall) -> list[DimStrategy]:
    """Padding (or cropping) a dim needs it whole; the dims it leaves alone split. A zero
    constant pad is linear, so Partial passes (reflect/replicate/circular copy values)."""
    x = call.get("self")
    pad = call.get("pad")
    touched = {x.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    strategies = [DimStrategy((S(d),), (S(d),)) for d in range(x.ndim) if d not in touched]
    constant = call.get("mode", "constant") == "constant"
    if constant and not call.get("value") and x.dtype != torch.bool:
        strategies.append(DimStrategy((P,), (P,)))
    return strategies


@TABLE.register(aten.select.int)
def select_rule(call: OpCall) -> list[DimStrategy]:
    x = call.args[0]
    dim = normalize_dim(call.args[1], x.ndim)
    strategies = [DimStrategy((S(d if d < dim else d - 1),), (S(d),)) for d in range(x.ndim) if d != dim]
    return [*strategies, DimStrategy((P,), (P,))]


@TABLE.register(aten.cat.default)
def cat_rule(call: OpCall) -> list[DimStrategy]:
    """All inputs split alike on a dim other than the one joined. torch.cat skips a legacy
    empty tensor (shape (0,), T5's empty KV cache) whatever the others' rank: there is
    nothing of it to split, so every rank takes it whole."""
    tensors = call.tensor_inputs
    out = call.outputs[0]
    dim = normalize_dim(call.get("dim", 0), out.ndim)
    skipped = [t.ndim != out.ndim for t in tensors]  # only a (0,) tensor may differ in rank

    def each(p: Placement) -> tuple[Placement, ...]:
        return tuple(R if skip else p for skip in skipped)

    strategies = [DimStrategy((S(d),), each(S(d))) for d in range(out.ndim) if d != dim]
    return [*strategies, DimStrategy((P,), each(P))]


@TABLE.register(aten.stack.default)
def stack_rule(call: OpCall) -> list[DimStrategy]:
    tensors = call.tensor_inputs
    out = call.outputs[0]
    dim = normalize_dim(call.get("dim", 0), out.ndim)
    strategies = [DimStrategy((S(d if d < dim else d + 1),), tuple(S(d) for _ in tensors))
                  for d in range(out.ndim - 1)]
    return [*strategies, DimStrategy((P,), tuple(P for _ in tensors))]


@TABLE.register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                aten.unbind.int)
def split_rule(call: OpCall) -> list[DimStrategy]:
    """Pieces along ``dim`` (removed, for unbind): every other dim splits, all pieces alike."""
    x = call.args[0]
    dim = normalize_dim(call.get("dim", 0), x.ndim)
    n_out = len(call.outputs)
    removed = call.target is aten.unbind.int
    strategies = [
        DimStrategy((S(d if not removed or d < dim else d - 1),) * n_out, (S(d),))
        for d in range(x.ndim) if d != dim
    ]
    sizes = set() if removed else {o.shape[dim] for o in call.outputs if o is not None}
    if n_out > 1 and len(sizes) == 1:  # k equal pieces: a strided(dim, k) input splits locally
        strategies.append(DimStrategy((S(dim),) * n_out, (strided(dim, n_out),)))
    return [*strategies, DimStrategy((P,) * n_out, (P,))]


@TABLE.register(operator.getitem)
def getitem_rule(call: OpCall) -> list[DimStrategy]:
    """Picking one output of a multi-output op: the piece keeps its placement."""
    x = call.outputs[0]
    if x is None:
        return []
    return [*(DimStrategy((S(d),), (S(d),)) for d in range(x.ndim)), DimStrategy((P,), (P,))]


@TABLE.register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(call: OpCall) -> list[DimStrategy]:
    """Each output is input i expanded to the common shape (F.mse_loss broadcasts its input
    and target so): an output dim splits where every input holding it at full size splits
    too (as elementwise ops broadcast), and expanding is linear in each input, so a Partial
    input gives its own output Partial with the others replicated."""
    strategies = broadcast_strategies(call)
    n = len(call.tensor_inputs)
    for i in range(n):
        strategies.append(DimStrategy(tuple(P if j == i else R for j in range(n)),
                                      tuple(P if j == i else R for j in range(n))))
    return strategies
