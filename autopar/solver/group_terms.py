"""Grouped parameter collectives in the ILP: each group's call priced once, as it runs.

A grouped call (``cost.groups``) is priced on its edge at its transfer alone. Its group's fixed
cost (``call_time``) is a variable y[g] >= every column that selects a pairing running a call of
g, so y is 1 exactly when some member runs one: the group's one call is paid once however many
members join it (a block's nine weights gathered together cost one call, not nine). Folded
blocks share their variables; y's price counts every instance its block stands for. A group of
gradient reduce-scatters runs beside the rest of backward, so where the hardware hides those
(``grad_sync_overlap``) its price joins the gradient buckets' exposed-time row instead, as its
members' transfers do (``GradSyncTerms.unwaited``); a prefetched block's gathers and regathers
hold their group's call in the block's overlap window, as its members' transfers
(``OverlapTerms.group_call``); the others pay it in full, as ``result.build`` prices a plan.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.cost.collectives import call_time
from autopar.rules.redistribute import ALL_GATHER, REDUCE_SCATTER
from autopar.cost.groups import GroupKey, edge_groups
from autopar.cost.model import CostContext, EdgeCost, step_repeats
from autopar.problem.block_paths import block_of
from autopar.problem.groups import group_names
from autopar.problem.nodes import PlanGraph
from autopar.solver.grad_terms import GradSyncTerms
from autopar.solver.milp import INF, RESHARDS, SCALE, Model
from autopar.solver.overlap import OverlapTerms


class GroupTerms:
    """The groups' call variables of one ILP (``priced`` False: minimizing memory, nothing to price)."""

    def __init__(self, model: Model, graph: PlanGraph, ctx: CostContext, mult: dict[str, int], sync: GradSyncTerms,
                 overlap: OverlapTerms, *, priced: bool) -> None:
        self.model, self.graph, self.ctx, self.mult, self.sync, self.overlap = model, graph, ctx, mult, sync, overlap
        self.priced = priced
        self.y: dict[tuple[GroupKey, int], int] = {}
        self.groups = group_names(graph, ctx.pipelined)

    def edge(self, producer: str, consumer: str, price: Callable[[int, int], EdgeCost]) -> "_EdgeGroups | None":
        """For an edge out of a parameter read once: its ``note(j, a, b)`` learns that column j selects
        the pairing (a, b) whose collectives are ``price(a, b)``; ``close`` ties the group variables."""
        if not self.priced or producer not in self.graph.read_once:
            return None
        node = self.graph.nodes[consumer]
        meta = self.graph.nodes[producer].outputs[0]
        assert meta is not None
        return _EdgeGroups(self, price, self.groups[consumer], node.recompute, str(meta.dtype), self.mult[consumer],
                           producer in self.sync.single_use)

    def _var(self, key: GroupKey, mult: int, hidden: bool, windowed: bool) -> int:
        """y of group ``key`` (``mult`` instances alike): its call's seconds per step, where they count
        (``windowed``: a prefetched block's gathers or regathers, in the block's window)."""
        found = self.y.get((key, mult))
        if found is None:
            run = mult * call_time(key.kind, key.mesh_dim, self.ctx.mesh) * SCALE  # one micro-batch's calls
            runs = step_repeats(self.ctx)
            # the members' reshards' term (their calls' fixed cost, paid once for the group)
            if key.kind == REDUCE_SCATTER and hidden:  # the last micro-batch's beside backward, as its members'
                found = self.sync.beside_backward((runs - 1) * run, run, RESHARDS)
            else:
                found = self.model.var(runs * run, integer=False, upper=1.0, term=RESHARDS)
            if windowed:
                self.overlap.group_call(key.group, key.phase, found, runs * run / mult, mult)
            self.y[(key, mult)] = found
        return found


class _EdgeGroups:
    """One edge's columns by the group they put a call in: y[g] >= their sum (at most one is 1)."""

    def __init__(self, terms: GroupTerms, price: Callable[[int, int], EdgeCost], group: str, recomputed: bool,
                 dtype: str, mult: int, hidden: bool) -> None:
        self.terms, self.price, self.group, self.recomputed = terms, price, group, recomputed
        self.dtype, self.mult, self.hidden = dtype, mult, hidden
        self.keys: dict[tuple[int, int], list[GroupKey]] = {}
        self.selectors: dict[GroupKey, list[int]] = {}

    def note(self, j: int, a: int, b: int) -> None:
        if (a, b) not in self.keys:
            edge = self.price(a, b)
            self.keys[(a, b)] = [k for k, _ in edge_groups(edge.forward, edge.backward, edge.recompute, self.group,
                                                           self.recomputed, self.dtype)]
        for key in self.keys[(a, b)]:
            self.selectors.setdefault(key, []).append(j)

    def close(self) -> None:
        for key, js in self.selectors.items():
            # as ``windowed_params``: a block's gathers (a stage plan's stretch between blocks has no window)
            windowed = block_of(key.group) is not None and key.kind == ALL_GATHER and not self.recomputed
            row = {self.terms._var(key, self.mult, self.hidden, windowed): 1.0}
            for j in js:
                row[j] = row.get(j, 0.0) - 1.0
            self.terms.model.rows.append((row, 0.0, INF))
