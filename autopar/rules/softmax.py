"""softmax / log_softmax: normalized along one dim, which must stay whole; others split."""

from __future__ import annotations

import torch

from autopar.rules.strategy import DimStrategy, OpCall, S, normalize_dim
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("softmax")


@TABLE.register(aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
                aten.log_softmax.int)
def softmax_rule(call: OpCall) -> list[DimStrategy]:
    x = call.args[0]
    dim = normalize_dim(call.args[1], x.ndim)
    return [DimStrategy((S(d),), (S(d),)) for d in range(x.ndim) if d != dim]
