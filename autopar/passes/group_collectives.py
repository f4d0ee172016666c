"""group_collectives: the parameter collectives the plan groups (``cost.groups``) written as one
call per group, as FSDP2 runs them per module.

The groups come from the plan's own prices (``problem.groups.param_groups``: per parameter read
once, the groups its forward gather, gradient reduce-scatter and gather again join). Per group:

- forward gathers: ``g = self.gather_group((w0, w1, ...), ('S(0)', 'R', 'S(0)', 'R', ...))`` issues
  them as one collective; each member's gather call waits for its piece
  (``pending = getitem(g, i)``). It is issued where ``prefetch_gathers`` would issue its
  members' gathers: before the block before starts computing (for a container's first block,
  before its first gather or op), in a checkpointed block or outside every block just before
  its first member's gather (inside the checkpointed region: its recompute issues it again);
- gathers again in backward (ZeRO-3's regathers): each member's ``self.regather`` names
  ``group = tag``; the runtime gathers the group's saved parameters together
  (``runtime.regather``);
- gradient reduce-scatters: each member's gather call names ``reduce_group = (tag, index,
  size)``; its backward hands its gradient to the group, reduced in one collective once the
  last is in (``runtime.grouped``), a group of one too (left running beside backward, as priced).

A group of one gather (or gather again) stays as it was: one call either way, and
``prefetch_gathers`` prefetches it. Runs after every pass that rewrites the gather calls, before
``prefetch_gathers`` (which leaves the gathers given a ``pending`` alone).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch.fx

from autopar.cost.groups import GroupKey
from autopar.passes.context import PassContext, plan_name
from autopar.passes.prefetch_gathers import GATHERS, containers, first_compute, gather_placements
from autopar.problem.groups import param_groups
from autopar.rules.redistribute import ALL_GATHER, REDUCE_SCATTER


def group_collectives(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    members = _members(gm, param_groups(pc.graph, pc.chosen, pc.ctx))
    checkpointed = set(pc.memory.checkpoint_blocks) if pc.memory is not None and pc.memory.checkpoint != "none" \
        else set()
    for key, nodes in sorted(members.items()):
        if key.kind == REDUCE_SCATTER:
            for i, node in enumerate(nodes):
                node.kwargs = {**node.kwargs, "reduce_group": (tag(key), i, len(nodes))}
        elif len(nodes) > 1 and key.phase == "forward":
            _launch_together(gm, key, nodes, checkpointed)
        elif len(nodes) > 1 and key.phase == "backward" and key.kind == ALL_GATHER:
            for node in nodes:
                if node.target != "regather":
                    raise RuntimeError(f"{node.name} gathers again in backward by the plan but is no regather")
                node.kwargs = {**node.kwargs, "group": tag(key)}
    gm.graph.lint()
    gm.recompile()
    return gm


def tag(key: GroupKey) -> str:
    """A group's name in the program: its block (or root), phase, mesh dim and dtype."""
    return f"{key.group or '(root)'}:{key.phase}:{key.kind}:{key.mesh_dim}:{key.dtype.removeprefix('torch.')}"


def _members(gm: torch.fx.GraphModule, groups: dict[str, list[GroupKey]]) -> dict[GroupKey, list[torch.fx.Node]]:
    """Group -> its members' gather calls, in program order."""
    out: dict[GroupKey, list[torch.fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in GATHERS:
            continue
        x = node.args[0]
        name = plan_name(x) if isinstance(x, torch.fx.Node) and x.op == "placeholder" else None
        if name not in groups:
            continue
        if len(x.users) != 1:  # the plan groups a parameter read once: its one gather call
            raise RuntimeError(f"parameter {name} is grouped but read by {len(x.users)} calls")
        for key in groups[name]:
            out[key].append(node)
    return out


def _launch_together(gm: torch.fx.GraphModule, key: GroupKey, nodes: list[torch.fx.Node],
                     checkpointed: set[str]) -> None:
    """One ``self.gather_group`` call for ``nodes``' gathers, each waiting for its piece."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(nodes, key=order.__getitem__)
    before = first
    starts = first_compute(graph)
    if key.group in starts and key.group not in checkpointed:
        blocks = next(seq for seq in containers(starts).values() if key.group in seq)
        i = blocks.index(key.group)
        before = starts[blocks[i - 1]] if i else min(starts[key.group], first, key=order.__getitem__)
    dtypes = {n.kwargs.get("dtype") for n in nodes}
    if len(dtypes) != 1:
        raise RuntimeError(f"gather group {tag(key)} casts its members to different dtypes {dtypes}")
    specs = tuple(p for n in nodes for p in gather_placements(n))
    dtype = dtypes.pop()
    kwargs = {} if dtype is None else {"dtype": dtype}
    with graph.inserting_before(before):
        launch = graph.call_module("gather_group", (tuple(n.args[0] for n in nodes), specs), kwargs)
        for i, node in enumerate(nodes):
            node.kwargs = {**node.kwargs, "pending": graph.call_function(operator.getitem, (launch, i))}
