"""Convolutions: conv1d/2d/3d, their transposes, and aten.convolution.

x [N, C_in, *spatial] (or unbatched [C_in, *spatial]); weight [C_out, C_in/g, *kernel],
transposed [C_in, C_out/g, *kernel]; bias [C_out]; output [N, C_out, *spatial'].
On one mesh dim a convolution can split:
- the batch: x on N, weight and bias replicated;
- the output channels (g == 1): x replicated, weight and bias on C_out;
- the input channels (g == 1): a contraction, x on C_in and the weight on its C_in dim,
  output Partial; the bias is Partial too, so the sum adds it once (as linear does);
- the groups (g > 1): x on C_in, weight on dim 0, bias and output on C_out, so each rank
  runs whole groups as a convolution with g / ways groups (``local_groups``; the mesh
  dims splitting them must divide g, ``DimStrategy.sizes``). For g > 1 a plain channel
  split would cut across groups, so only this one is offered;
- Partial x with the weight replicated, or Partial weight with x replicated: a
  convolution is linear in each, output and bias Partial.
Spatial dims stay whole: a split would need halo exchange, not implemented.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Placement

from autopar.rules.strategy import P, R, DimStrategy, OpCall, S, shard_dim
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("conv")

PLAIN = (aten.conv1d.default, aten.conv1d.padding, aten.conv2d.default, aten.conv2d.padding,
         aten.conv3d.default, aten.conv3d.padding)
TRANSPOSED = (aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
CONV_OPS = frozenset({*PLAIN, *TRANSPOSED, aten.convolution.default})
"""Every convolution overload this family places (each has a ``groups`` argument)."""


def is_transposed(call: OpCall) -> bool:
    return call.target in TRANSPOSED or (call.target is aten.convolution.default and bool(call.get("transposed")))


@TABLE.register(*CONV_OPS)
def conv_rule(call: OpCall) -> list[DimStrategy]:
    x, weight = call.tensor_inputs[0], call.tensor_inputs[1]
    has_bias = call.get("bias") is not None
    groups = int(call.get("groups", 1))
    channel = x.ndim - (weight.ndim - 1)  # 1 batched, 0 unbatched: spatial dims = weight's kernel dims
    out_w, in_w = (1, 0) if is_transposed(call) else (0, 1)  # weight dims of C_out and C_in

    def strategy(out: Placement, xp: Placement, wp: Placement, bias: Placement,
                 sizes: tuple[int, ...] = ()) -> DimStrategy:
        return DimStrategy((out,), (xp, wp, *([bias] if has_bias else [])), sizes)

    strategies = []
    if channel == 1:
        strategies.append(strategy(S(0), S(0), R, R))
    if groups == 1:
        strategies.append(strategy(S(channel), R, S(out_w), S(0)))
        strategies.append(strategy(P, S(channel), S(in_w), P))
    else:
        strategies.append(strategy(S(channel), S(channel), S(0), S(0), (groups,)))
    strategies.append(strategy(P, P, R, P))
    strategies.append(strategy(P, R, P, P))
    return strategies


def local_groups(call: OpCall, weight: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> int:
    """``groups`` for one rank's convolution when the weight is placed ``weight``: a grouped
    convolution's weight is split on dim 0 only by the group split, whose ranks each hold
    ``groups / ways`` whole groups."""
    groups = int(call.get("groups", 1))
    if groups == 1:
        return 1
    ways = math.prod(n for p, n in zip(weight, mesh_shape) if shard_dim(p) == 0)
    return groups // ways
