"""ZeRO-3's gathering again in backward, per repeated block, in the planning graph.

A parameter stored split on a data axis is all-gathered for its forward use. An op that
saves it for backward either holds the gathered copy until then, or frees it after forward
and gathers it again in backward (FSDP2's ``reshard_after_forward``): the copy costs no
memory between the two passes, the second gather costs time (hidden under the next
block's backward where ``autopar.solver.overlap`` finds a window). The choice is made per
repeated block, as FSDP wraps one block at a time: the first k blocks gather again, or
every parameter does (k = None: the blocks and the unrepeated head and tail); the search
tries all blocks but the last (``autopar.memory.scenarios.REGATHER_HELD``), a pin any k. Every held
copy is alive at the end of forward, so any k blocks save the same memory; the first ones
are chosen because the last block's regathers are the ones no later backward can hide
(torchtitan keeps the last block gathered for that reason). ``PlanNode.regather`` marks
the ops; ``edge_flags`` hands it to ``edge_cost`` and ``held_reshard_bytes``; the plan
lists the parameters it gathers again in ``MemoryPlan.regather``, which the runtime
executes (``autopar.runtime.regather``).
"""

from __future__ import annotations

from dataclasses import replace

from autopar.problem.block_paths import block_of
from autopar.problem.nodes import OP, PlanGraph, PlanNode


Regathered = dict[tuple[str, int], tuple[PlanNode, PlanNode]]
"""(op name, id of the node priced) -> that node and its copy gathering again (the node kept: its id stays its own)."""


def regathering(graph: PlanGraph, blocks: list[str] | None, memo: Regathered | None = None) -> PlanGraph:
    """A copy of ``graph`` whose ops in ``blocks`` (None: every op) gather their parameters
    again in backward; the original graph is left as it is. ``memo``: each node's copy made once
    (a memory search asks for the same ops under many scenarios)."""
    if blocks is not None and not blocks:
        return graph
    memo = {} if memo is None else memo
    chosen = None if blocks is None else set(blocks)
    nodes = dict(graph.nodes)
    for name in graph.order:
        node = graph.nodes[name]
        if node.kind == OP and (chosen is None or block_of(node.module) in chosen):
            key = (name, id(node))
            if key not in memo or memo[key][0] is not node:
                memo[key] = (node, replace(node, regather=True))
            nodes[name] = memo[key][1]
    return replace(graph, nodes=nodes)


def regathering_blocks(graph: PlanGraph) -> set[str]:
    """The repeated blocks whose ops gather their parameters again in backward (the runtime
    prefetches a block's regathers as the next one starts its backward, whatever that one
    does with its own: ``autopar.solver.overlap.prefetched_blocks``)."""
    return {b for n in graph.order if (node := graph.nodes[n]).kind == OP and node.regather
            and (b := block_of(node.module)) is not None}
