"""embedding(weight [V, h], indices [...]) -> [..., h].

Split the indices (batch/sequence) with the table replicated, or split the table's
feature dim h with the indices replicated: both are plain gathers per rank.
(Vocabulary-parallel tables need masked lookups and are not offered yet.)
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("embedding")


@TABLE.register(aten.embedding.default)
def embedding_rule(call: OpCall) -> list[DimStrategy]:
    indices = call.args[1]
    strategies = [DimStrategy((S(d),), (R, S(d))) for d in range(indices.ndim)]
    strategies.append(DimStrategy((S(indices.ndim),), (S(1), R)))
    return strategies
