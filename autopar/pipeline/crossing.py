"""What crosses a pipeline cut, and what a later stage computes again rather than receives.

A value a later stage reads is sent across each cut between its producer's stage and that
reader, once (``crossing_bytes``), except:

- user inputs: every rank is handed the step's whole inputs (``pm.step(*inputs, *targets)`` on
  every rank), so each stage reads its own micro-batch of those it needs (the targets the last
  stage's loss reads);
- values of constants alone (``constant_ops``): an op whose inputs are buffers, lifted constants
  and such ops only, or that has none (an ``arange``-based causal mask, a rotary table from its
  ``inv_freq`` buffer), is computed again by each later stage reading it (``recomputed_ops``),
  from its own copy of the buffers, and costs that stage its forward seconds.

Such an op draws no random number (each draw advances the step's stream once), writes into
nothing in place and has nothing written into its storage or its buffers' (a later stage's
copy would miss the write), lies outside the repeated blocks (a checkpointed block's ops run only
inside its call, which a later stage does not make; a transformer computes its mask and rotary
tables before the blocks), and receives each input as produced or by a slice, without
a collective (a copy of it would run that collective again). A parameter is no such input: a
stage computing from it would hold a copy, whose gradient the plan does not tie (``pipeline.tied``).
The runtime cuts by the same rule (``passes.split_stages``), so what runs is what is priced.
"""

from __future__ import annotations

import torch

from autopar.cost.collectives import reshard
from autopar.cost.model import CostContext
from autopar.problem.block_paths import block_of
from autopar.problem.nodes import BUFFER, OP, PlanGraph, PlanNode
from autopar.rules.dropout import draws_random
from autopar.rules.strategy import Strategy, local_numel


def constant_ops(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext) -> frozenset[str]:
    """The op nodes whose values are of constants alone (module docstring), which a later stage
    reading them computes again."""
    written = {src for node in graph.nodes.values() for k, (src, _) in enumerate(node.args) if k in node.as_produced}
    out: set[str] = set()
    for name in graph.order:
        node = graph.nodes[name]
        if node.kind != OP or name in written or not _pure(node) or block_of(node.module) is not None:
            continue
        sources = all(src in out or (graph.nodes[src].kind == BUFFER and src not in written) for src, _ in node.args)
        if sources and all(_sliced(graph, chosen, ctx, name, k) for k in range(len(node.args))):
            out.add(name)
    return frozenset(out)


def _pure(node: PlanNode) -> bool:
    """Computing ``node`` again gives the same value and changes nothing else."""
    call = node.call
    return call is not None and not node.recompute and not node.as_produced and not any(node.read_versions) \
        and not node.needs_grad and not isinstance(call.target, torch._ops.HigherOrderOperator) \
        and not draws_random(call.target, call.args, call.kwargs)


def _sliced(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, name: str, arg: int) -> bool:
    """Input ``arg`` of ``name`` arrives as produced, or resharded by slices alone (no collective)."""
    src, idx = graph.nodes[name].args[arg]
    meta, produced = graph.nodes[src].outputs[idx], chosen[src].outputs[idx]
    required = chosen[name].inputs[arg]
    return meta is None or produced is None or tuple(produced) == tuple(required) or \
        not reshard(meta, tuple(produced), tuple(required), ctx.mesh, ctx.precision)


def recomputed_ops(graph: PlanGraph, constants: frozenset[str], stage_of: dict[str, int], count: int
                   ) -> list[list[str]]:
    """Per stage, the ``constants`` of earlier stages it computes again, in graph order: those its
    ops read, and their own inputs of that kind."""
    again: list[set[str]] = [set() for _ in range(count)]
    for name, s in stage_of.items():
        todo = [src for src, _ in graph.nodes[name].args]
        while todo:
            src = todo.pop()
            if src in constants and stage_of[src] < s and src not in again[s]:
                again[s].add(src)
                todo.extend(a for a, _ in graph.nodes[src].args)
    return [[n for n in graph.order if n in mine] for mine in again]


def crossing_bytes(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, stage_of: dict[str, int],
                   count: int, constants: frozenset[str] = frozenset()) -> list[float]:
    """Per cut (after stage s), bytes per device of the values it carries forward in one
    micro-batch: outputs of ops read by a later stage, each once however many stages it passes,
    but for ``constants`` (``constant_ops``), which later stages compute again; user inputs
    never cross (each stage reads its own micro-batch of them)."""
    crossing: dict[tuple[str, int], tuple[int, int]] = {}  # value -> (its stage, last reader)
    for name, s in stage_of.items():
        for src, idx in graph.nodes[name].args:
            if graph.nodes[src].kind != OP or src in constants:
                continue
            born = stage_of[src]
            if born < s:
                first, last = crossing.get((src, idx), (born, s))
                crossing[(src, idx)] = (first, max(last, s))
    out = [0.0] * count
    for (src, idx), (first, last) in crossing.items():
        meta = graph.nodes[src].outputs[idx]
        if meta is None:
            continue
        nbytes = ctx.precision.tensor_bytes(meta, local_numel(meta, chosen[src].outputs[idx], ctx.mesh.shape))
        for cut in range(first, last):
            out[cut] += nbytes
    return out
