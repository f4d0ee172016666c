"""prefetch_gathers: each repeated block's parameter all-gathers are issued one block ahead.

FSDP's forward prefetch: before block ``layers.i`` starts computing, the all-gathers of
``layers.i+1``'s parameters are issued, so they run while block i computes. A gather is a
parameter's ``self.reshard`` / ``self.regather`` call whose forward all-gathers; it splits
in two: ``p = self.prefetch(w, src, dst)`` issues the collective without waiting (placed
before the first compute op of the block before, or of its own block for the container's
first block, whose gathers nothing can hide), and the original call, given
``pending=p``, waits for it at the parameter's first use and stays the node autograd
records (its backward, the gradient's reduce-scatter, is unchanged).

Prefetched: a parameter read by that one call, whose consumers all lie in one block
instance (``memory.options.block_of``) that is not checkpointed (a recompute replays its
region's gathers in backward; a handle waited for once cannot serve it). Blocks follow one
another within their container (``layers.0``, ``layers.1``, ...), the windows
``solver.overlap`` prices.

In backward (ZeRO-3), block i-1's regathers are issued as block i's backward starts,
whatever block i does with its own parameters: after each value block i computes and
code outside it reads, ``self.backward_starts(v, 'layers.i', 'layers.i-1')`` hooks its
gradient (``autopar.runtime.regather``). A node belongs to a block by its module path; an
inserted node (a reshard) to the block of its users when they all lie in one. Written
for each block whose predecessor gathers parameters again (``self.regather`` of one of its
parameters); such a block computing nothing read after it is refused (nothing could
mark its start).
Runs after every pass that rewrites the gather calls and before ``checkpoint_blocks``
(the hook calls read a block's values and feed nothing: they stay outside its region).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.fx

from autopar.passes.context import PassContext, block_owners, plan_name
from autopar.rules.redistribute import ALL_GATHER, redistribute_steps
from autopar.rules.strategy import parse_placements
from autopar.problem.shared import module_path
from autopar.problem.block_paths import block_of
from autopar.problem.nodes import PARAM

GATHERS = ("reshard", "regather")


def prefetch_gathers(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    skipped = set(pc.memory.checkpoint_blocks) if pc.memory is not None and pc.memory.checkpoint != "none" else set()
    by_block: dict[str, list[torch.fx.Node]] = {}
    for gather, block in _gathers(gm, pc):
        if block not in skipped:
            by_block.setdefault(block, []).append(gather)
    starts = first_compute(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for container_blocks in containers(starts).values():
        for i, block in enumerate(container_blocks):
            gathers = by_block.get(block, [])
            if not gathers:
                continue
            # the block before starts computing; the first block: before its first gather or op
            before = starts[container_blocks[i - 1]] if i else min([starts[block], *gathers], key=order.__getitem__)
            for gather in gathers:
                _split(gm, gather, before)
    _mark_backward_starts(gm, containers(starts))
    gm.graph.lint()
    gm.recompile()
    return gm


def _gathers(gm: torch.fx.GraphModule, pc: PassContext) -> Iterator[tuple[torch.fx.Node, str]]:
    """(gather call, block of its consumers) for every prefetchable parameter gather."""
    mesh_shape = pc.mesh_shape
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in GATHERS or node.kwargs.get("pending") is not None:
            continue
        x = node.args[0]
        name = plan_name(x) if isinstance(x, torch.fx.Node) else None
        if name is None or x.op != "placeholder" or pc.graph.nodes[name].kind != PARAM or len(x.users) != 1:
            continue
        src, dst = gather_placements(node)
        steps = redistribute_steps(parse_placements(src), parse_placements(dst))
        if not any(s.kind == ALL_GATHER and mesh_shape[s.mesh_dim] > 1 for s in steps):
            continue
        blocks = {block_of(module_path(u)) if "nn_module_stack" in u.meta else None for u in node.users}
        if len(blocks) == 1 and None not in blocks:
            yield node, blocks.pop()


def gather_placements(gather: torch.fx.Node) -> tuple[str, str]:
    """(src, dst) of a gather call: ``reshard(x, src, dst, ...)``, ``regather(x, fqn, src, dst, ...)``."""
    first = 2 if gather.target == "regather" else 1
    return gather.args[first], gather.args[first + 1]  # type: ignore[return-value]


def first_compute(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """Block -> its first op in graph order (a captured op: inserted calls carry no module path)."""
    starts: dict[str, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_function" and "nn_module_stack" in node.meta:
            block = block_of(module_path(node))
            if block is not None and block not in starts:
                starts[block] = node
    return starts


def containers(starts: dict[str, torch.fx.Node]) -> dict[str, list[str]]:
    """Container path -> its blocks in the order they start."""
    out: dict[str, list[str]] = {}
    for block in starts:  # insertion order is graph order
        out.setdefault(block.rsplit(".", 1)[0], []).append(block)
    return out


def _split(gm: torch.fx.GraphModule, gather: torch.fx.Node, before: torch.fx.Node) -> None:
    """Issue ``gather``'s all-gather just before ``before``; ``gather`` waits for it."""
    src, dst = gather_placements(gather)
    kwargs = {"dtype": gather.kwargs["dtype"]} if gather.kwargs.get("dtype") is not None else {}
    with gm.graph.inserting_before(before):
        launch = gm.graph.call_module("prefetch", (gather.args[0], src, dst), kwargs)
    gather.kwargs = {**gather.kwargs, "pending": launch}


def _mark_backward_starts(gm: torch.fx.GraphModule, containers: dict[str, list[str]]) -> None:
    """``self.backward_starts(v, block, previous)`` after each value ``v`` that ``block``
    computes and code outside it reads, where ``previous`` gathers parameters again."""
    graph = gm.graph
    regathering = {block_of(str(n.args[1])) for n in graph.nodes if n.op == "call_module" and n.target == "regather"}
    owner = block_owners(graph, block_of)
    leaving: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        block = owner.get(node)
        if block is not None and _differentiable(node) and any(owner.get(u) != block for u in node.users):
            leaving.setdefault(block, []).append(node)
    for blocks in containers.values():
        for previous, block in zip(blocks, blocks[1:]):
            if previous not in regathering:
                continue
            if block not in leaving:
                raise RuntimeError(f"block {block} computes nothing read after it: its backward start, which "
                                   f"prefetches {previous}'s regathers, cannot be marked")
            for v in leaving[block]:
                with graph.inserting_after(v):
                    graph.call_module("backward_starts", (v, block, previous))


def _differentiable(node: torch.fx.Node) -> bool:
    """A tensor value a gradient may flow back to (floating or complex)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)
