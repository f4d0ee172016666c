"""``passes.group_collectives``: the parameter collectives the plan groups (``cost.groups``) run as
one call per block, as FSDP2 runs them per module: one ``self.gather_group`` issuing a block's
gathers, its members waiting for their pieces (``pending=``), its regathers tagged ``group=`` and
its gradients' reduce-scatters ``reduce_group=``.

The input is a two-block ZeRO program as insert_reshards leaves it: each block reads two weights
(``a_i``, ``b_i``), each gathered by a reshard just before its matmul. The groups come from the
plan's prices, so the PassContext's graph is the planning graph the pinned strategies price."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.fx

from autopar.memory.options import MemoryPlan
from autopar.memory.regather import regathering
from autopar.passes.context import PassContext
from autopar.passes.group_collectives import group_collectives
from autopar.passes.prefetch_gathers import prefetch_gathers
from autopar.problem.groups import group_names

from .filecheck import check
from .pinned import graph_module, in_module, op, pin, propagate, strategy

aten = torch.ops.aten
BLOCKS = ("layers.0", "layers.1")


def _program(gather: str = "reshard", read_twice: bool = False) -> torch.fx.GraphModule:
    """h = x; per block i: h = relu((h @ gather(a_i)) @ gather(b_i)). ``gather``: 'reshard', or
    'regather' (ZeRO-3, naming the FQN); ``read_twice``: b_1 is also read by a third matmul."""
    graph = torch.fx.Graph()
    h = graph.placeholder("x")
    weights = {f"{w}{i}": graph.placeholder(f"{w}{i}") for i in range(len(BLOCKS)) for w in "ab"}
    for i, block in enumerate(BLOCKS):
        for w in "ab":
            fqn = (f"{block}.{w}.weight",) if gather == "regather" else ()
            gathered = graph.call_module(gather, (weights[f"{w}{i}"], *fqn, "S(0)", "R", "P", "S(0)"))
            h = in_module(op(graph, f"mm_{w}{i}", aten.mm.default, h, gathered), f"{block}.{w}")
        h = in_module(op(graph, f"relu_{i}", aten.relu.default, h), f"{block}.act")
    if read_twice:
        h = op(graph, "mm_again", aten.mm.default, h, weights["b1"])
    graph.output(h)
    return propagate(graph_module(graph), torch.randn(4, 4), *(torch.randn(4, 4) for _ in weights))


def _pin(gm: torch.fx.GraphModule, regather: bool = False, **options: Any) -> PassContext:
    """FSDP on dp: the batch split, each weight stored split by rows and gathered whole for its
    matmul (its gradient, Partial, reduce-scattered back to its shard); ``regather``: the ops gather
    them again in backward (ZeRO-3)."""
    names = [f"{w}{i}" for i in range(len(BLOCKS)) for w in "ab"]
    ops = {n.name: strategy("S(0)", *(["S(0)", "R"] if n.target is aten.mm.default else ["S(0)"]))
           for n in gm.graph.nodes if n.op == "call_function"}
    chosen = {"x": strategy("S(0)"), **{n: strategy("S(0)") for n in names}, **ops}
    params = {n: f"{BLOCKS[int(n[1])]}.{n[0]}.weight" for n in names}
    pc = pin(gm, chosen, {"dp": 2}, params=params, train=True, input_sharded=True, **options)
    return replace(pc, graph=regathering(pc.graph, None)) if regather else pc


def test_a_blocks_gathers_are_issued_as_one_where_the_prefetch_issues_them() -> None:
    """Each block's two gathers: one ``gather_group`` call (layers.1's before layers.0 computes,
    layers.0's as early as its first gather), each reshard waiting for its piece; each gradient
    names its block's reduce-scatter group (index, size)."""
    gm = _program()
    pc = _pin(gm)
    group_collectives(gm, pc)
    prefetch_gathers(gm, pc)
    check(gm, """
        CHECK:      def forward(self, x, a0, b0, a1, b1):
        CHECK-NEXT: gather_group = self.gather_group((a0, b0), ('S(0)', 'R', 'S(0)', 'R'))
        CHECK-NEXT: getitem = gather_group[0]
        CHECK-NEXT: getitem_1 = gather_group[1]
        CHECK-NEXT: reshard = self.reshard(a0, 'S(0)', 'R', 'P', 'S(0)', reduce_group = ('layers.0:backward:reduce_scatter:0:float32', 0, 2), pending = getitem)
        CHECK-NEXT: gather_group_1 = self.gather_group((a1, b1), ('S(0)', 'R', 'S(0)', 'R'))
        CHECK:      mm_a0 = torch.ops.aten.mm.default(x, reshard)
        CHECK-NEXT: reshard_1 = self.reshard(b0, 'S(0)', 'R', 'P', 'S(0)', reduce_group = ('layers.0:backward:reduce_scatter:0:float32', 1, 2), pending = getitem_1)
        CHECK:      reduce_group = ('layers.1:backward:reduce_scatter:0:float32', 0, 2), pending = getitem_2)
        CHECK-NOT:  self.prefetch
    """)


def test_zero3_regathers_are_tagged_with_their_blocks_group() -> None:
    """Gathering again in backward (ZeRO-3), a block's regathers carry one tag: the runtime gathers
    the handles they save together (``runtime.regather``). layers.0's first matmul reads the input,
    which needs no gradient, so it keeps none of a0: b0 alone gathers again there, on its own."""
    gm = _program("regather")
    group_collectives(gm, _pin(gm, regather=True))
    check(gm, """
        CHECK:     regather = self.regather(a0, 'layers.0.a.weight', 'S(0)', 'R', 'P', 'S(0)', reduce_group
        CHECK:     regather_1 = self.regather(b0, 'layers.0.b.weight', 'S(0)', 'R', 'P', 'S(0)', reduce_group
        CHECK-NOT: group = 'layers.0:backward:all_gather
        CHECK:     regather_2 = self.regather(a1, 'layers.1.a.weight', 'S(0)', 'R', 'P', 'S(0)', group = 'layers.1:backward:all_gather:0:float32', reduce_group
        CHECK:     regather_3 = self.regather(b1, 'layers.1.b.weight', 'S(0)', 'R', 'P', 'S(0)', group = 'layers.1:backward:all_gather:0:float32', reduce_group
    """)


def test_a_checkpointed_blocks_group_is_issued_inside_it() -> None:
    """A checkpointed block replays its gathers in its recompute: its group is issued just before
    its first member's gather (where the region will take it along), not a block ahead."""
    gm = _program()
    group_collectives(gm, _pin(gm, memory=MemoryPlan(checkpoint="full", checkpoint_blocks=["layers.1"])))
    check(gm, """
        CHECK:      relu_0 = torch.ops.aten.relu.default(mm_b0)
        CHECK-NEXT: gather_group_1 = self.gather_group((a1, b1), ('S(0)', 'R', 'S(0)', 'R'))
        CHECK:      reshard_2 = self.reshard(a1,
    """)


def test_a_parameter_read_twice_joins_no_group() -> None:
    """b1, read by its gather and by another matmul, gathers and reduces on its own (its two
    gradients are summed before any reduction); layers.1's group is a1 alone: its gather stays
    as it was, its gradient still goes through its group (of one)."""
    gm = _program(read_twice=True)
    group_collectives(gm, _pin(gm))
    check(gm, """
        CHECK:     gather_group = self.gather_group((a0, b0),
        CHECK-NOT: gather_group_1
        CHECK:     self.reshard(a1, 'S(0)', 'R', 'P', 'S(0)', reduce_group = ('layers.1:backward:reduce_scatter:0:float32', 0, 1))
        CHECK:     self.reshard(b1, 'S(0)', 'R', 'P', 'S(0)')
    """)


def test_a_stage_plan_groups_the_parameters_outside_blocks_per_stretch() -> None:
    """Outside every block a parameter joins the root group, or in a pipeline's stage plan the
    stretch between blocks its reader lies in: a stage cut between blocks puts the embedding and
    the output head on different ranks, which one root collective cannot gather for."""
    graph = _pin(_program(read_twice=True)).graph
    plain, staged = group_names(graph, pipelined=False), group_names(graph, pipelined=True)
    assert plain["mm_a1"] == staged["mm_a1"] == "layers.1"
    assert plain["x"] == plain["mm_again"] == ""
    assert (staged["x"], staged["mm_again"]) == ("@0", "@2")
