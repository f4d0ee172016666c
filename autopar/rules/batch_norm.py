"""batch_norm: x [N, C, *spatial] normalized per channel C (dim 1).

In training mode the statistics run over the batch and spatial dims, so only the
channel dim splits: weight, bias and the running statistics split with it on dim 0,
and each rank updates its own channels' running statistics in place (the planner keeps
them as produced there: ``capture.aliasing.written_arg_names``). In eval mode
(running statistics given) it is an elementwise affine map per channel, so the batch
and spatial dims split too, everything per-channel replicated.
Normalization is not linear: no Partial.
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("batch_norm")
CHANNEL = 1


def uses_batch_statistics(call: OpCall) -> bool:
    """Training mode, or no running statistics to normalize with."""
    return bool(call.get("training")) or call.get("running_mean") is None


@TABLE.register(aten.batch_norm.default)
def batch_norm_rule(call: OpCall) -> list[DimStrategy]:
    x = call.tensor_inputs[0]
    per_channel = len(call.tensor_inputs) - 1
    strategies = [DimStrategy((S(CHANNEL),), (S(CHANNEL), *[S(0)] * per_channel))]
    if not uses_batch_statistics(call):
        strategies += [DimStrategy((S(d),), (S(d), *[R] * per_channel)) for d in range(x.ndim) if d != CHANNEL]
    return strategies
