"""localize_random: every op that draws random numbers goes through ``self.random``.

``dropout(x, 0.1, True)`` becomes ``self.random('aten.dropout.default', 'S(0)R',
(8, 64, 128), x, 0.1, True)``: the op with its output placements and global output
shape, so the runtime (``autopar.runtime.random``) can draw the global tensor from the
generator every rank keeps in lockstep and keep this rank's slice. Ops that draw nothing
(dropout with p = 0 or in eval, attention without dropout) are left alone. Runs last, so
the arguments it moves are already resharded and on the rank's device. A draw inside the
subgraph of a higher-order op (a ``torch.no_grad()`` block) is rewritten too: the block runs
replicated, so it draws the whole tensor, in its place in the stream.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.distributed.tensor import Replicate

from autopar.capture.subgraphs import nested_graph_modules
from autopar.passes.context import PassContext, strategy_of
from autopar.rules.dropout import draws_random
from autopar.rules.strategy import placement_str


def localize_random(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    random = gm.get_submodule("random")
    for module in (gm, *nested_graph_modules(gm)):
        _localize(module, random, pc)
    return gm


def _localize(gm: torch.fx.GraphModule, random: torch.nn.Module, pc: PassContext) -> None:
    """Rewrite ``gm``'s own draws into calls of ``random``."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not draws_random(node.target, node.args, node.kwargs):
            continue
        if not hasattr(gm, "random"):  # a subgraph: the same generator as every other draw
            gm.add_submodule("random", random)
        strategy = strategy_of(node)  # none inside a subgraph: it runs replicated
        placements = strategy.outputs[0] if strategy is not None and strategy.outputs[0] is not None \
            else (Replicate(),) * len(pc.mesh_shape)
        val = node.meta.get("val")
        first = val[0] if isinstance(val, (tuple, list)) else val
        shape = tuple(int(s) for s in first.shape)
        with gm.graph.inserting_before(node):
            drawn = gm.graph.call_module("random", (str(node.target), placement_str(placements), shape, *node.args),
                                         dict(node.kwargs))
        drawn.meta.update(node.meta)
        node.replace_all_uses_with(drawn)
        gm.graph.erase_node(node)
    gm.recompile()
