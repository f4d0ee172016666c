"""Advanced indexing: ``x[i0, :, i2]`` (``aten.index.Tensor``), as HF builds its masks.

The index tensors broadcast together to a shape B, and out[..., b, ...] = x[i0[b], ..., ik[b]]
(B replaces the indexed dims where they are adjacent, else it comes first). So the op
is elementwise over B given a whole x: a dim of B splits like a pointwise op over the
index tensors (each split where it holds that dim, replicated where it broadcasts),
with x replicated (its indexed dims must be whole: a rank's indices point anywhere).
A dim of x that no index touches splits by itself (out keeps it), indices replicated.
Gathering is linear in x: a Partial x gives a Partial output. Boolean-mask indices
give data-dependent shapes: not handled.
"""

from __future__ import annotations

import torch

from autopar.capture.graph import TensorMeta
from autopar.rules.strategy import P, R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable, Unhandled

aten = torch.ops.aten
TABLE = RuleTable("indexing")


def _broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*shapes))


@TABLE.register(aten.index.Tensor)
def index_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    x: TensorMeta = call.get("self")
    indices = list(call.get("indices"))
    tensors = [t for t in indices if t is not None]
    if not tensors:
        return Unhandled("no index tensor")
    if any(t.dtype in (torch.bool, torch.uint8) for t in tensors):
        return Unhandled("a boolean mask index (data-dependent shape)")
    indexed = [i for i, t in enumerate(indices) if t is not None]
    free = [j for j in range(x.ndim) if j not in indexed]
    b_shape = _broadcast_shape([t.shape for t in tensors])
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    at = indexed[0] if adjacent else 0  # where B sits in the output
    free_at = {j: (j if j < at else j - len(indexed) + len(b_shape)) if adjacent else len(b_shape) + k
               for k, j in enumerate(free)}
    strategies = []
    for b, size in enumerate(b_shape):  # elementwise over the broadcast index shape
        from_right = len(b_shape) - b
        inputs = [S(t.ndim - from_right) if t.ndim >= from_right and t.shape[t.ndim - from_right] == size
                  else R for t in tensors]
        strategies.append(DimStrategy((S(at + b),), (R, *inputs)))
    for j, out_dim in free_at.items():  # a dim no index touches
        strategies.append(DimStrategy((S(out_dim),), (S(j), *(R for _ in tensors))))
    if x.dtype != torch.bool:
        strategies.append(DimStrategy((P,), (P, *(R for _ in tensors))))
    return strategies
