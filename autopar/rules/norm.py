"""layer_norm / rms_norm: statistics over the trailing normalized dims, which stay whole.

Leading (token) dims split freely with replicated weight and bias: this is what
Megatron's sequence parallelism runs (norm on sequence-sharded activations).
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("norm")


@TABLE.register(aten.layer_norm.default, aten.rms_norm.default, aten.native_layer_norm.default)
def norm_rule(call: OpCall) -> list[DimStrategy]:
    x = call.args[0]
    normalized = len(call.args[1])
    n_params = len(call.tensor_inputs) - 1
    return [
        DimStrategy(tuple(S(d) if o is not None else None for o in call.outputs), (S(d), *([R] * n_params)))
        for d in range(x.ndim - normalized)
    ]
