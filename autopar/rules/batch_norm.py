"""batch_norm: x [N, C, *spatial] normalized per channel C (dim 1).

In training mode the statistics run over the batch and spatial dims, so only the
channel dim splits: weight, bias and the running statistics split with it on dim 0,
and each rank updates its own channels' running statistics in place. In eval mode
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


def updated_running_stats(call: OpCall) -> tuple[str, ...]:
    """Schema names of the running statistics this call updates in place (the schema does
    not mark them written: native_batch_norm updates them inside the composite op)."""
    if not call.get("training"):
        return ()
    return tuple(name for name in ("running_mean", "running_var") if call.get(name) is not None)


@TABLE.register(aten.batch_norm.default)
def batch_norm_rule(call: OpCall) -> list[DimStrategy]:
    x = call.tensor_inputs[0]
    per_channel = len(call.tensor_inputs) - 1
    strategies = [DimStrategy((S(CHANNEL),), (S(CHANNEL), *[S(0)] * per_channel))]
    if not uses_batch_statistics(call):
        strategies += [DimStrategy((S(d),), (S(d), *[R] * per_channel)) for d in range(x.ndim) if d != CHANNEL]
    return strategies
