"""checkpoint_blocks: each checkpointed block's forward runs as one call the runtime can
recompute in backward.

The nodes of block ``blocks.0`` move into a submodule ``self.checkpoint_blocks_0`` (its
inputs: the values it reads from outside, parameters included; its outputs: the values
read after it), called as ``self.recompute(self.checkpoint_blocks_0, 'full', x, w, ...)``;
the runtime (``autopar.runtime.recompute``) runs it under torch's checkpointing with the
plan's policy. Under 'selective_op' the call also names ``matmuls=(before, count)``: the linear
matmuls its block ran in earlier regions and those it runs (the policy keeps every other one,
counted over the whole block, as the planner priced it).

A node belongs to a block by its module path (``nn_module_stack``); a node a pass inserted
has none (reshards, their gathers included) and belongs to the block of its users when they
all lie in one, so a block's forward collectives run again in its recompute.

A region must be contiguous in graph order. Nodes of other blocks or of none that lie
between a block's first and last node are moved out when they can be: before the block
if they read nothing the block computes, after it if the block reads nothing they
compute. What still splits the block (a node both reading from and feeding the block)
leaves it as several regions, each checkpointed on its own (``checkpoint_blocks_0``,
``checkpoint_blocks_0_1``): still exact, it only keeps the values crossing the split.

An input whose values may change between the region's forward and its recompute (batch
norm's running statistics and ``num_batches_tracked``, which the block itself updates in
place; a tensor written after the block; a program input written anywhere, which the next
micro-batch's forward writes) is named in the call's ``mutated=`` (input positions): the
runtime keeps a copy of it as the region found it for the recompute and updates the real
one once, in the forward.
Runs last, on the finished per-rank program.
"""

from __future__ import annotations

import operator

import torch.fx

from autopar.capture.aliasing import storage_root, written_args
from autopar.cost.recompute import counted_by_op_policy
from autopar.passes.context import PassContext, block_owners
from autopar.problem.block_paths import in_block

REGION_PREFIX = "checkpoint_"
"""Name of a region's submodule: this prefix and the block's path, dots as underscores."""


def checkpoint_blocks(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    memory = pc.memory
    if memory is None or memory.checkpoint == "none" or not memory.checkpoint_blocks:
        return gm
    owner = _owners(gm.graph, memory.checkpoint_blocks)
    for block in memory.checkpoint_blocks:
        _make_contiguous(gm.graph, owner, block)
    seen: dict[str, int] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # before any region is outlined
    writes = _write_positions(gm.graph, order)
    matmuls: dict[str, int] = {}  # block -> the matmuls 'selective_op' counted in its earlier regions
    for block, nodes in _regions(gm.graph, owner):
        name = REGION_PREFIX + block.replace(".", "_")
        seen[block] = seen.get(block, -1) + 1
        mutated = _mutated(nodes, order, writes)
        counted = sum(n.op == "call_function" and counted_by_op_policy(n.target) for n in nodes)
        kwargs = {"mutated": mutated} if mutated else {}
        if memory.checkpoint == "selective_op":
            kwargs["matmuls"] = (matmuls.get(block, 0), counted)
        matmuls[block] = matmuls.get(block, 0) + counted
        _outline(gm, name + (f"_{seen[block]}" if seen[block] else ""), nodes, memory.checkpoint, kwargs)
    gm.graph.lint()
    gm.recompile()
    return gm


def _owners(graph: torch.fx.Graph, blocks: list[str]) -> dict[torch.fx.Node, str]:
    """The checkpointed block each node belongs to (nodes of none are absent)."""
    return block_owners(graph, lambda path: next((b for b in blocks if in_block(path, b)), None))


def _make_contiguous(graph: torch.fx.Graph, owner: dict[torch.fx.Node, str], block: str) -> None:
    """Move the nodes lying inside ``block``'s span that can leave it before or after it."""
    nodes = list(graph.nodes)
    where = [i for i, n in enumerate(nodes) if owner.get(n) == block]
    if not where:
        return
    span = nodes[where[0]: where[-1] + 1]
    inside = set(span)
    reads: set[torch.fx.Node] = set()  # outsiders reading what the block computes
    for node in span:
        if owner.get(node) != block and any(a in inside and (owner.get(a) == block or a in reads)
                                            for a in node.all_input_nodes):
            reads.add(node)
    feeds: set[torch.fx.Node] = set()  # outsiders the block (later) reads from
    for node in reversed(span):
        if owner.get(node) != block and any(u in inside and (owner.get(u) == block or u in feeds)
                                            for u in node.users):
            feeds.add(node)
    first, last = span[0], span[-1]
    for node in span:
        if owner.get(node) == block:
            continue
        if node not in reads:
            first.prepend(node)  # reads only what comes before the block: order kept among them
        elif node not in feeds:
            last.append(node)
            last = node


def _regions(graph: torch.fx.Graph, owner: dict[torch.fx.Node, str]) -> list[tuple[str, list[torch.fx.Node]]]:
    """Maximal runs of consecutive nodes of one block, in graph order."""
    runs: list[tuple[str, list[torch.fx.Node]]] = []
    previous: str | None = None
    for node in graph.nodes:
        block = owner.get(node)
        if block is not None and block == previous:
            runs[-1][1].append(node)
        elif block is not None:
            runs.append((block, [node]))
        previous = block
    return runs


def _write_positions(graph: torch.fx.Graph, order: dict[torch.fx.Node, int]) -> dict[torch.fx.Node, int]:
    """Storage root -> graph position of the last node writing into it in place."""
    writes: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        for target in written_args(node):
            writes[storage_root(target)] = order[node]
    return writes


def _region_inputs(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    inside = set(nodes)
    return list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))


def _mutated(nodes: list[torch.fx.Node], order: dict[torch.fx.Node, int], writes: dict[torch.fx.Node, int]
             ) -> tuple[int, ...]:
    """Positions of the region's inputs whose values may change before its recompute: written
    in place by the region or after it, or program inputs written anywhere (state that a
    later micro-batch's forward updates before this one's backward)."""
    start = order[nodes[0]]

    def changes(root: torch.fx.Node) -> bool:
        return root in writes and (root.op == "placeholder" or writes[root] >= start)
    return tuple(i for i, a in enumerate(_region_inputs(nodes)) if changes(storage_root(a)))


def _outline(gm: torch.fx.GraphModule, name: str, nodes: list[torch.fx.Node], policy: str,
             kwargs: dict[str, tuple[int, ...]]) -> None:
    """Replace ``nodes`` by one ``self.recompute`` call of a submodule running them; ``kwargs``: the
    call's ``mutated`` (positions of its inputs that may change before the recompute, ``_mutated``)
    and ``matmuls`` (under 'selective_op': the block's matmuls counted before this region, and in it)."""
    inside = set(nodes)
    inputs = _region_inputs(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = torch.fx.Graph()
    env = {a: sub.placeholder(a.name) for a in inputs}
    for node in nodes:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, torch.fx.GraphModule(gm, sub, class_name=name))
    graph = gm.graph
    with graph.inserting_before(nodes[0]):
        region = graph.get_attr(name)
        call = graph.call_module("recompute", (region, policy, *inputs), kwargs)
        for i, node in enumerate(outputs):
            got = graph.call_function(operator.getitem, (call, i))
            got.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(got)
    for node in reversed(nodes):
        graph.erase_node(node)
