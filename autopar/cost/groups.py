"""Grouped parameter collectives: the parameters a block gathers, gathers again or
reduce-scatters together run as one collective over all of them, as FSDP2 does per module.

A collective's fixed cost (``call_time``: the launch and the wait for the slowest rank, 1.45 ms
on the cpu profile) dominates the small gathers of a block's weights: a Llama block's nine
weights gathered one by one pay it nine times, in one call once. So a parameter read once
(``PlanGraph.read_once``) whose edge reshard is exactly one all-gather, or whose gradient's
is exactly one reduce-scatter, on a mesh dim that is not zig-zag (``grouped_calls``), has that
call marked ``grouped``: priced at its transfer alone, the fixed cost paid once by its group.

A group is one call the runtime runs (``GroupKey``): the collectives of one kind on one mesh dim,
in one phase, of the parameters read in one repeated block instance (``problem.groups.group_names``;
the parameters outside every block form one group, the root, as FSDP2's root module, or in a
pipeline's stage plan one per stretch between blocks: the embedding and the output head lie in
different stages, and no stage cut splits a stretch), of one dtype. Phases: the forward gathers
(issued together, ahead of the block as the prefetch issues them); the gradients'
reduce-scatters (issued once the last member's gradient is in); the gathers again in backward,
which are either ZeRO-3's regathers ("backward", issued as one when the block's backward needs
the first or the prefetch asks) or a checkpointed block's replay of its forward gathers
("recompute").

One rule, three readers: the ILP pays ``call_time`` once per group selected
(``solver.group_terms``), the plan lists one collective per group (``result.build``), and
the runtime runs one (``passes.prefetch_gathers``, ``runtime.ops.Comm.launch_group``,
``runtime.grouped``); all three find the groups with ``edge_groups``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from autopar.cost.collectives import CollectiveCall
from autopar.rules.redistribute import ALL_GATHER, REDUCE_SCATTER
from autopar.mesh import Mesh


@dataclass(frozen=True, order=True)
class GroupKey:
    """One grouped collective of a step (run once per micro-batch)."""

    group: str
    """The repeated block instance its members are read in, or the stretch outside blocks
    (``problem.groups.group_names``; "": the root)."""
    phase: str
    """'forward', 'backward' (gradients' reduce-scatters, ZeRO-3's gathers again) or 'recompute'."""
    kind: str
    mesh_dim: int
    dtype: str
    """The members' dtype as captured (a group's buffers hold one dtype)."""


def grouped_calls(calls: Sequence[CollectiveCall], kind: str, mesh: Mesh) -> list[CollectiveCall]:
    """``calls`` (one reshard's collectives), its one call marked ``grouped`` when the reshard is
    exactly one collective of ``kind`` on a mesh dim that is not zig-zag (zig-zag shards reorder
    around their collective, which a shared buffer does not)."""
    if len(calls) != 1 or calls[0].kind != kind or mesh.names[calls[0].mesh_dim] in mesh.zigzag:
        return list(calls)
    return [replace(calls[0], grouped=True)]


def edge_groups(forward: Iterable[CollectiveCall], backward: Iterable[CollectiveCall],
                again: Iterable[CollectiveCall], group: str, recomputed: bool, dtype: str
                ) -> list[tuple[GroupKey, CollectiveCall]]:
    """The groups one edge's grouped calls join (its forward gather, gradient reduce-scatter and
    gather again), read in ``group``; ``recomputed``: its gather again is a checkpointed block's replay."""
    again_phase = "recompute" if recomputed else "backward"
    out = []
    for phase, calls in (("forward", forward), ("backward", backward), (again_phase, again)):
        out += [(GroupKey(group, phase, c.kind, c.mesh_dim, dtype), c) for c in calls if c.grouped]
    return out


def group_call(key: GroupKey, members: Iterable[CollectiveCall]) -> CollectiveCall:
    """The one collective a group runs: its members' bytes together, at the full price of a call."""
    return CollectiveCall(key.kind, key.mesh_dim, sum(c.nbytes for c in members))


__all__ = ["ALL_GATHER", "REDUCE_SCATTER", "GroupKey", "edge_groups", "group_call", "grouped_calls"]
