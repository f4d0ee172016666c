"""embedding(weight [V, h], indices [...]) -> [..., h].

Split the indices (batch/sequence) with the table replicated, or split the table's
feature dim h with the indices replicated: both are plain gathers per rank. Or split the
table's rows (the vocabulary, Megatron-LM's ``VocabParallelEmbedding``) with the indices
replicated: each rank looks up the indices it holds and gives zero rows for the others, so
the output is Partial (``runtime.vocab``, which ``passes.localize_embedding`` calls). Not with
``scale_grad_by_freq``: a rank's frequencies would count the indices it does not hold.
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import P, R, DimStrategy, OpCall, Placements, S, shard_dim
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("embedding")


@TABLE.register(aten.embedding.default)
def embedding_rule(call: OpCall) -> list[DimStrategy]:
    indices = call.args[1]
    strategies = [DimStrategy((S(d),), (R, S(d))) for d in range(indices.ndim)]
    strategies.append(DimStrategy((S(indices.ndim),), (S(1), R)))
    if not call.get("scale_grad_by_freq", False):
        strategies.append(DimStrategy((P,), (S(0), R)))
    return strategies


def splits_rows(target: object, weight_placements: Placements) -> bool:
    """An embedding placed with its table's rows split (the vocabulary-parallel lookup)."""
    return target is aten.embedding.default and any(shard_dim(p) == 0 for p in weight_placements)
