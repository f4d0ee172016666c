"""annotate_placements: record each node's chosen strategy in ``node.meta``."""

from __future__ import annotations

import torch.fx

from autopar.passes.context import PLAN_NAME, STRATEGY, PassContext


def annotate_placements(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        strategy = pc.chosen.get(node.name)
        if strategy is not None:
            node.meta[STRATEGY] = strategy
            node.meta[PLAN_NAME] = node.name
    return gm
