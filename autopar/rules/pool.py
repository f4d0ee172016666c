"""Pooling: max, average and adaptive pools over the trailing 1, 2 or 3 spatial dims.

Each (batch, channel) plane is pooled by itself, so the leading dims split freely and
the pooled spatial dims stay whole (a split would need halos). The indices a max pool
returns count positions inside one plane, so they stay right on every rank's planes.
Average pools are linear: a Partial input gives a Partial output.
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import P, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("pool")

SPATIAL_DIMS = {
    aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3,
    aten.max_pool1d_with_indices.default: 1, aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
    aten.adaptive_max_pool1d.default: 1, aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3,
    aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
    aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2, aten.adaptive_avg_pool3d.default: 3,
    aten._adaptive_avg_pool2d.default: 2,
}
"""Pooling op -> how many trailing dims it pools."""

AVERAGES = frozenset({aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
                      aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default,
                      aten.adaptive_avg_pool3d.default, aten._adaptive_avg_pool2d.default})


@TABLE.register(*SPATIAL_DIMS)
def pool_rule(call: OpCall) -> list[DimStrategy]:
    x = call.tensor_inputs[0]
    leading = x.ndim - SPATIAL_DIMS[call.target]
    strategies = [DimStrategy(tuple(None if o is None else S(d) for o in call.outputs), (S(d),))
                  for d in range(leading)]
    if call.target in AVERAGES:
        strategies.append(DimStrategy((P,), (P,)))
    return strategies
