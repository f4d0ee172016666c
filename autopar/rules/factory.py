"""Tensor factories (arange, zeros, ones, full, ...): built from shapes and values, not data.

Without a tensor input a factory is built replicated. ``new_*`` take an explicit size and
read only the dtype and device of their input, so that input may be placed any way and the
output is still replicated (no gather just to read a shape). ``*_like`` build a tensor of
their input's shape: a sharded input gives each rank its block (a shard of the output);
a Partial input still gives the same tensor on every rank (the values are not read).
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import P, R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("factory")

SIZED = (aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)
LIKE = (aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default)


@TABLE.register(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
                aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default)
def factory_rule(call: OpCall) -> list[DimStrategy]:
    return []  # the all-Replicate strategy is always added


@TABLE.register(*SIZED)
def sized_factory_rule(call: OpCall) -> list[DimStrategy]:
    x = call.tensor_inputs[0]
    return [*(DimStrategy((R,), (S(d),)) for d in range(x.ndim)), DimStrategy((R,), (P,))]


@TABLE.register(*LIKE)
def like_factory_rule(call: OpCall) -> list[DimStrategy]:
    x = call.tensor_inputs[0]
    return [*(DimStrategy((S(d),), (S(d),)) for d in range(x.ndim)), DimStrategy((R,), (P,))]
