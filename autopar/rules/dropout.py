"""dropout: elementwise, so any dim splits. Each rank draws its own mask, so with
p > 0 a sharded run is a different (equally valid) random draw than one device's."""

from __future__ import annotations

import torch

from autopar.rules.strategy import DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("dropout")


@TABLE.register(aten.dropout.default, aten.native_dropout.default)
def dropout_rule(call: OpCall) -> list[DimStrategy]:
    x = call.args[0]
    return [DimStrategy(tuple(S(d) if o is not None else None for o in call.outputs), (S(d),))
            for d in range(x.ndim)]
