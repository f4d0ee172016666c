"""Tensor factories (arange, zeros, ones, full, ...): no inputs to follow; built replicated."""

from __future__ import annotations

import torch

from autopar.rules.strategy import DimStrategy, OpCall
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("factory")


@TABLE.register(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
                aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
                aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
                aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                aten.empty_like.default)
def factory_rule(call: OpCall) -> list[DimStrategy]:
    return []  # the all-Replicate strategy is always added
