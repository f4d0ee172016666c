"""Stage 5: graph passes that turn the captured step into one rank's program.

Each pass is a plain function ``(gm, PassContext) -> gm`` in its own module; they run
in this order:
1. annotate_placements: each node's chosen strategy into ``node.meta``;
2. localize_shapes: size arguments become this rank's;
3. insert_reshards: ``self.reshard`` on every edge whose placements differ;
4. cast_parameters: mixed precision: each parameter read in the captured (bf16) dtype,
   cast before its reshards, its gradient reduced in fp32 (after the reshards it fuses with);
5. localize_losses: batch-split 'mean' losses become local sum / global count (after
   the reshards, so a count can still read the whole targets input);
   localize_embedding: a lookup in a table split by its rows (the vocabulary) becomes a
   ``self.vocab_embedding`` call (zero rows for the indices other ranks hold);
6. localize_attention: a causal attention split on its queries' sequence becomes a
   ``self.context_attention`` call (the causal mask of this rank's query positions), one
   planned as ring attention (keys split on the sequence too) a ``self.ring_attention`` call;
7. expert_parallel: a dropless expert layer whose experts are split becomes a
   ``self.moe_dispatch_combine`` call (variable-split all-to-alls to the experts' ranks and back);
8. retarget_devices: tensors the step creates go to the rank's device;
9. localize_random: ops that draw random numbers become ``self.random`` calls (one
   global draw per op, this rank keeping its slice);
10. group_collectives: the parameter collectives the plan groups run as one call per group
   (``self.gather_group``; ``group=`` and ``reduce_group=`` of the members' gather calls);
   prefetch_gathers: a repeated block's parameter all-gathers are issued before the block
   before it computes (``self.prefetch``), and waited for at their use; a block's backward
   start, which issues the block before's ZeRO-3 regathers, is marked (``self.backward_starts``);
11. checkpoint_blocks: each block the plan checkpoints runs as one ``self.recompute``
   call of a submodule holding its nodes (last: a block takes its reshards and draws along).
A higher-order op (a ``torch.no_grad()`` block) runs replicated, so its subgraph keeps
its global shapes and reshards nothing; only retarget_devices and localize_random, which
rewrite an op whatever its placement, rewrite inside subgraphs too.
The ``reshard``, ``regather``, ``prefetch``, ``gather_group``, ``backward_starts``, ``partial_mean_loss``,
``vocab_embedding``, ``context_attention``, ``ring_attention``, ``moe_dispatch_combine``, ``random`` and
``recompute`` modules they call are runtime code (``autopar.runtime.ops``, ``autopar.runtime.grouped``,
``autopar.runtime.losses``, ``autopar.runtime.regather``, ``autopar.runtime.attention``,
``autopar.runtime.ring``, ``autopar.runtime.moe``, ``autopar.runtime.vocab``, ``autopar.runtime.random``,
``autopar.runtime.recompute``), handed in by the caller: passes
only write the calls.
"""

from __future__ import annotations

import torch.fx
from torch import nn

from autopar.capture.subgraphs import module_of
from autopar.passes.annotate_placements import annotate_placements
from autopar.passes.cast_parameters import cast_parameters
from autopar.passes.checkpoint_blocks import checkpoint_blocks
from autopar.passes.context import PassContext
from autopar.passes.expert_parallel import expert_parallel
from autopar.passes.group_collectives import group_collectives
from autopar.passes.insert_reshards import insert_reshards
from autopar.passes.localize_attention import localize_attention
from autopar.passes.localize_embedding import localize_embedding
from autopar.passes.localize_losses import localize_losses
from autopar.passes.localize_random import localize_random
from autopar.passes.localize_shapes import localize_shapes
from autopar.passes.prefetch_gathers import prefetch_gathers
from autopar.passes.retarget_devices import retarget_devices

PASSES = (annotate_placements, localize_shapes, insert_reshards, cast_parameters, localize_losses,
          localize_embedding, localize_attention, expert_parallel, retarget_devices, localize_random, group_collectives,
          prefetch_gathers, checkpoint_blocks)


def parallelize_graph(gm: torch.fx.GraphModule, pc: PassContext, modules: dict[str, nn.Module]
                      ) -> torch.fx.GraphModule:
    """A per-rank copy of ``gm`` with the plan applied (``gm`` itself is left as it was).

    ``modules`` are the ops the passes call (``reshard``, ``regather``, ``prefetch``, ``gather_group``,
    ``backward_starts``, ``partial_mean_loss``, ``vocab_embedding``, ``context_attention``, ``random``,
    ``recompute``).
    """
    gm = _copy(gm)
    for name, module in modules.items():
        gm.add_submodule(name, module)
    # Each pass ends by regenerating the program's Python code (``recompile``: 14 ms for a 4-layer
    # Llama's 434 nodes, most of what the passes cost); they rewrite the graph only, so here the
    # code is generated once, at the end. A pass run on its own (tests) still recompiles.
    copied = gm
    copied.recompile = _deferred  # type: ignore[method-assign]
    try:
        for run in PASSES:
            gm = run(gm, pc)
    finally:
        del copied.recompile
    gm.recompile()
    return gm


def _deferred() -> None:
    """``recompile`` while ``parallelize_graph`` runs the passes: nothing yet."""


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with a graph of its own, and a copy of every subgraph its higher-order ops run."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = torch.fx.GraphModule(gm, graph)
    for node in out.graph.nodes:
        sub = module_of(node)
        if sub is not None:
            setattr(out, str(node.target), _copy(sub))
    return out


__all__ = ["PassContext", "parallelize_graph", "PASSES"]
