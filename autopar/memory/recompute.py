"""Activation checkpointing in the planning graph: which ops of checkpointed blocks keep
their outputs for backward, which drop them and recompute, and what that costs.

A checkpointed block (``MemoryPlan.checkpoint_blocks``) replays its forward in backward:
- time: every op the replay re-executes adds its forward seconds again (``full``: all of
  them; ``selective``: all but the kept matmul/attention outputs, which the replay reads
  from its cache; ``selective_op``: all but attention and every other linear matmul,
  ``cost.recompute``), and every forward reshard feeding an op of the block runs again
  (``edge_cost(recomputed=True)``);
- memory: an op's outputs stay alive until backward only if the policy keeps them or they
  leave the block (the next block's or the head's input: kept either way), whole, whether
  or not autograd would keep them; what autograd keeps of the others is dropped after
  forward and comes back one block at a time while that block recomputes, so the plan's
  peak adds the largest block's dropped bytes (``recompute_memory``), not all. When only
  the first blocks checkpoint, backward has freed the activations of the blocks after them
  (``freed_before_recompute``) before any recomputes: the peak adds only what the largest
  block brings back beyond those.
A parameter gathered inside a checkpointed block is not held until backward either: the
replay gathers it again (that is one of the recomputed reshards).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from autopar.cost.collectives import collective_time
from autopar.cost.model import CostContext, NodeCost, step_repeats
from autopar.cost.moe import is_moe, moe_collectives
from autopar.cost.ring import ring_waited_time
from autopar.rules.attention import ATTENTION_OPS
from autopar.rules.dropout import draws_random
from autopar.cost.recompute import OP_UNSURE_GRAPH_OPS, counted_by_op_policy, kept_by_policy
from autopar.errors import InputError
from autopar.problem.block_paths import block_of
from autopar.rules.strategy import Strategy
from autopar.problem.nodes import OP, PlanGraph, PlanNode


Replayed = tuple[dict[str, tuple[str, PlanNode]], dict[str, str]]
"""One policy's ops of every repeated block priced as checkpointed (name -> its block, the node), and
why each block 'selective_op' cannot count is refused (block -> message)."""


def checkpointed(graph: PlanGraph, policy: str, blocks: list[str], ctx: CostContext | None = None,
                 memo: dict[str, Replayed] | None = None) -> PlanGraph:
    """A copy of ``graph`` priced with ``blocks`` checkpointed under ``policy`` (the
    original graph and its shared cost lists are left as they are). ``ctx`` prices what an
    op's replay communicates by itself (an expert-parallel layer's forward all-to-alls).
    ``memo`` (per ``graph`` and ``ctx``): each policy's ops priced once, whatever blocks a call names
    (an op's price under a policy depends on its own block alone)."""
    if policy == "none" or not blocks:
        return graph
    memo = {} if memo is None else memo
    if policy not in memo:
        memo[policy] = _replayed(graph, policy, ctx)
    ops, refused = memo[policy]
    chosen = set(blocks)
    for block in blocks:
        if block in refused:
            raise InputError(refused[block])
    nodes = dict(graph.nodes)
    nodes.update({name: node for name, (block, node) in ops.items() if block in chosen})
    return replace(graph, nodes=nodes)


def _replayed(graph: PlanGraph, policy: str, ctx: CostContext | None) -> Replayed:
    """Every op of every repeated block priced as replayed under ``policy`` (``checkpointed``)."""
    consumers = graph.consumers()
    ops: dict[str, tuple[str, PlanNode]] = {}
    refused: dict[str, str] = {}
    matmuls: dict[str, int] = {}  # block -> the matmuls 'selective_op' counted in it so far
    for name in graph.order:
        node = graph.nodes[name]
        block = block_of(node.module)
        if node.kind != OP or block is None:
            continue
        index = matmuls.get(block, 0)
        if counted_by_op_policy(_target(node)):  # counted whether or not it has a backward, as the runtime counts
            matmuls[block] = index + 1
        elif policy == "selective_op" and block not in refused:
            why = _uncountable(graph, name, block)
            if why:
                refused[block] = why
        if not node.needs_grad:
            continue  # ops with no backward save nothing and replay nothing
        leaves = any(block_of(graph.nodes[c].module) != block for c, _, _ in consumers[name]) \
            or name in graph.output_names
        draws = node.call is not None and draws_random(node.call.target, node.call.args, node.call.kwargs)
        cached = kept_by_policy(policy, _target(node), index, draws)
        replayed = _recomputed(node, block, cached=cached, keep=leaves or cached)
        if ctx is not None and node.call is not None and (is_moe(node.call.target)  # no policy keeps it: replayed
                                                           or node.call.target in ATTENTION_OPS):
            replayed = replace(replayed, comm_times=[t + replay_comm_time(node, s, ctx) for t, s in zip(
                node.comm_times or [0.0] * len(node.strategies), node.strategies)])
        ops[name] = (block, replayed)
    return ops, refused


def _uncountable(graph: PlanGraph, name: str, block: str) -> str:
    """Why 'selective_op' cannot count op ``name`` ("" when it can). It keeps every other linear matmul of
    a block, counted alike by the planner (graph nodes) and the runtime (dispatched ``mm``/``addmm``): a
    node that may or may not run one, or whose ops the graph does not show (a higher-order op's body),
    would shift the count."""
    call = graph.nodes[name].call
    target = call.target if call is not None else None
    hidden = isinstance(target, torch._ops.HigherOrderOperator)
    metas = [graph.nodes[src].outputs[idx] for src, idx in graph.nodes[name].args]
    folds = target in OP_UNSURE_GRAPH_OPS and any(meta is not None and len(meta.shape) <= 2 for meta in metas)
    if not (hidden or folds):
        return ""
    return (f"checkpoint='selective_op' keeps every other linear matmul of a block, counted as the block "
            f"runs them; {block} runs {target} (node {name}), whose matmuls that count cannot see: pin "
            "checkpoint='selective' or 'full'")


def replay_comm_time(node: PlanNode, strategy: Strategy, ctx: CostContext) -> float:
    """Seconds per step of the collectives an op's forward runs by itself, run again when its
    block recomputes (an expert-parallel layer's counts, dispatch and combine, ``cost.moe``; ring attention's sends,
    as waited for, ``cost.ring``)."""
    assert node.call is not None
    calls = moe_collectives(node.call, strategy, ctx.mesh, ctx.precision, ctx.train)
    ring = ring_waited_time(node.call, strategy, ctx.mesh, ctx.precision, ctx.train, ("forward",))  # ring attention's
    return (sum(collective_time(c.call, ctx.mesh) for c in calls if c.phase == "forward") + ring) * step_repeats(ctx)


def _recomputed(node: PlanNode, block: str, *, cached: bool, keep: bool) -> PlanNode:
    """``node`` in a checkpointed block; ``cached``: the policy keeps its output (the replay reads it
    from its cache, runs nothing); ``keep``: its output is held to backward."""
    # What the block keeps, it keeps whole, whether or not autograd would: the policy caches
    # its outputs, the next checkpointed block saves its inputs (``NodeCost.output_bytes``).
    costs = [NodeCost(c.time + (0.0 if cached else c.forward), c.output_bytes if keep else 0.0, c.forward,
                      c.output_bytes) for c in node.costs]
    dropped = [0.0 if keep else c.memory for c in node.costs]
    return replace(node, costs=costs, block=block, recompute_memory=dropped, replayed=not cached)


def _target(node: PlanNode) -> object:
    return node.call.target if node.call is not None else None


def freed_before_recompute(graph: PlanGraph) -> set[str]:
    """Ops of repeated blocks that are not checkpointed and run after every checkpointed op:
    backward is done with them (and frees what they keep) before the first recompute. Empty
    when nothing, or every block, is checkpointed."""
    last = max((i for i, n in enumerate(graph.order) if graph.nodes[n].block is not None), default=None)
    if last is None:
        return set()
    return {n for n in graph.order[last + 1:] if graph.nodes[n].kind == OP and graph.nodes[n].block is None
            and block_of(graph.nodes[n].module) is not None}


def recompute_peak(block_bytes: float, freed_bytes: float) -> float:
    """What recomputation adds to the peak: the largest block's bytes beyond what backward
    freed before it (``freed_before_recompute``)."""
    return max(0.0, block_bytes - freed_bytes)


def block_peak(graph: PlanGraph, memory_of: dict[str, float]) -> float:
    """The largest bytes one block brings back while recomputing, given each node's
    ``recompute_memory`` under its chosen strategy."""
    per_block: dict[str, float] = {}
    for name in graph.order:
        node = graph.nodes[name]
        if node.block is not None:
            per_block[node.block] = per_block.get(node.block, 0.0) + memory_of.get(name, 0.0)
    return max(per_block.values(), default=0.0)
