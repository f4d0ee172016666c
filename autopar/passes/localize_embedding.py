"""localize_embedding: a lookup in a table split by its rows becomes a ``self.vocab_embedding`` call.

``embedding(weight, indices)`` planned with the weight's rows (the vocabulary) split on some mesh
dims and the indices whole there (``rules.embedding``: Megatron-LM's ``VocabParallelEmbedding``)
becomes ``self.vocab_embedding('S(0)R', weight, indices, padding_idx, scale_grad_by_freq, sparse)``:
each rank looks up the indices its rows hold and gives zero rows for the others
(``autopar.runtime.vocab``), the Partial output the plan reshards. Runs after the reshards, so the
weight is this rank's rows and the indices are whole.
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.passes.context import PassContext, strategy_of
from autopar.rules.embedding import splits_rows
from autopar.rules.strategy import placement_str, positional_args


def localize_embedding(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        strategy = strategy_of(node)
        if node.op != "call_function" or strategy is None or not strategy.inputs \
                or not splits_rows(node.target, strategy.inputs[0]):
            continue
        with gm.graph.inserting_before(node):
            local = gm.graph.call_module("vocab_embedding", (placement_str(strategy.inputs[0]),
                                                             *positional_args(node.target, node.args, node.kwargs)))
        local.meta.update(node.meta)
        node.replace_all_uses_with(local)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
