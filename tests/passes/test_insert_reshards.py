"""``passes.insert_reshards``: a ``self.reshard`` call on every edge whose placements differ.

The calls name forward placements (producer -> consumer) and, in training, the gradient's
(consumer -> producer); the runtime (``runtime.ops.Reshard``) runs them, so these tests read the
calls and run nothing."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from autopar.capture.graph import TensorMeta
from autopar.passes.insert_reshards import insert_reshards

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

aten = torch.ops.aten


def _mm_relu() -> torch.fx.GraphModule:
    """relu(x (8, 4) @ w (4, 4))."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(op(graph, "relu", aten.relu.default, op(graph, "mm", aten.mm.default, x, w)))
    return propagate(graph_module(graph), torch.randn(8, 4), torch.randn(4, 4))


MM_RELU = {"x": strategy("S(0)"), "w": strategy("R"), "mm": strategy("S(0)", "S(0)", "R"), "relu": strategy("R", "R")}
"""Batch-split matmul, replicated relu (its input must be gathered)."""


def test_an_edge_whose_placements_differ_gets_a_reshard_and_an_equal_one_none() -> None:
    """mm -> relu is S(0) -> R: gathered; x -> mm and w -> mm are as produced: nothing. An input
    that every rank receives whole is sliced to its planned S(0) first."""
    gm = _mm_relu()
    insert_reshards(gm, pin(gm, MM_RELU, {"dp": 2}, params={"w": "fc.weight"}))
    check(gm, """
        CHECK:      def forward(self, x, w):
        CHECK-NEXT: reshard_1 = self.reshard(x, 'R', 'S(0)')
        CHECK-NEXT: mm = torch.ops.aten.mm.default(reshard_1, w)
        CHECK-NEXT: reshard = self.reshard(mm, 'S(0)', 'R')
        CHECK-NEXT: relu = torch.ops.aten.relu.default(reshard)
        CHECK-NEXT: return relu
    """)


def test_an_input_that_arrives_split_is_not_sliced() -> None:
    """``input_sharded``: each rank is handed its own rows, as planned: x goes straight to mm."""
    gm = _mm_relu()
    insert_reshards(gm, pin(gm, MM_RELU, {"dp": 2}, params={"w": "fc.weight"}, input_sharded=True))
    check(gm, """
        CHECK:      mm = torch.ops.aten.mm.default(x, w)
        CHECK-NEXT: reshard = self.reshard(mm, 'S(0)', 'R')
        CHECK-NOT:  self.reshard
    """)


def _three_readers() -> torch.fx.GraphModule:
    """relu, neg and sigmoid of one x (8, 4)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(tuple(op(graph, name, target, x) for name, target in
                       (("relu", aten.relu.default), ("neg", aten.neg.default), ("sigmoid", aten.sigmoid.default))))
    return propagate(graph_module(graph), torch.randn(8, 4))


THREE_READERS = {"x": strategy("S(0)"), "relu": strategy("R", "R"), "neg": strategy("R", "R"),
                 "sigmoid": strategy("S(0)", "S(0)")}
"""Two readers need x whole, one takes it split as produced."""


def test_readers_needing_the_same_placement_share_one_reshard() -> None:
    """relu and neg both need x replicated: one all-gather serves both (autograd sums their
    gradients before its backward); sigmoid reads x as produced."""
    gm = _three_readers()
    insert_reshards(gm, pin(gm, THREE_READERS, {"dp": 2}, input_sharded=True))
    check(gm, """
        CHECK:      reshard = self.reshard(x, 'S(0)', 'R')
        CHECK-NEXT: relu = torch.ops.aten.relu.default(reshard)
        CHECK-NEXT: neg = torch.ops.aten.neg.default(reshard)
        CHECK-NEXT: sigmoid = torch.ops.aten.sigmoid.default(x)
        CHECK-NOT:  self.reshard
    """)


def test_reads_of_different_versions_do_not_share_a_reshard() -> None:
    """neg reads x after a write in place into it (``read_versions``): a reshard made before the
    write holds the old values, so neg gets a reshard of its own."""
    gm = _three_readers()
    pc = pin(gm, THREE_READERS, {"dp": 2}, input_sharded=True)
    pc.graph.nodes["neg"].read_versions = (1,)
    insert_reshards(gm, pc)
    check(gm, """
        CHECK:      reshard = self.reshard(x, 'S(0)', 'R')
        CHECK-NEXT: relu = torch.ops.aten.relu.default(reshard)
        CHECK-NEXT: reshard_1 = self.reshard(x, 'S(0)', 'R')
        CHECK-NEXT: neg = torch.ops.aten.neg.default(reshard_1)
    """)


def test_an_input_that_must_arrive_as_produced_is_never_resharded() -> None:
    """relu writes into x in place (``as_produced``): a plan resharding that edge would write into a
    copy; the pass refuses it rather than lose the write."""
    gm = _three_readers()
    pc = pin(gm, THREE_READERS, {"dp": 2}, input_sharded=True)
    pc.graph.nodes["relu"].as_produced = frozenset({0})
    with pytest.raises(RuntimeError, match="relu must take x as produced"):
        insert_reshards(gm, pc)


def _train_step() -> torch.fx.GraphModule:
    """loss = sum(x @ relu(w) + x @ v): w feeds a replicated relu, v a matmul directly."""
    graph = torch.fx.Graph()
    x, w, v = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("v")
    mm = op(graph, "mm", aten.mm.default, x, op(graph, "relu", aten.relu.default, w))
    add = op(graph, "add", aten.add.Tensor, mm, op(graph, "mm_1", aten.mm.default, x, v))
    graph.output(op(graph, "sum_1", aten.sum.default, add))
    return propagate(graph_module(graph), torch.randn(8, 4), torch.randn(4, 4), torch.randn(4, 4))


TRAIN = {"x": strategy("S(0)"), "w": strategy("R"), "v": strategy("R"), "relu": strategy("R", "R"),
         "mm": strategy("S(0)", "S(0)", "R"), "mm_1": strategy("S(0)", "S(0)", "R"),
         "add": strategy("S(0)", "S(0)", "S(0)"), "sum_1": strategy("P", "S(0)")}
"""Data parallel: batch-split matmuls of replicated weights, the loss a Partial sum."""


def test_training_reshards_name_the_gradients_placements_and_replicate_the_loss() -> None:
    """relu's output is replicated but its reader is batch-split: its gradient comes back
    Partial and must be summed (a gradient-only reshard 'R' -> 'R', 'P' -> 'R'). Parameter v's
    gradient stays Partial on its sync dim (the buckets all-reduce it once): no reshard. The
    loss (Partial) is reduced so that every rank returns all of it."""
    gm = _train_step()
    pc = pin(gm, TRAIN, {"dp": 2}, params={"w": "w", "v": "v"}, train=True, loss="sum_1", input_sharded=True,
             sync_dims={"v": frozenset({0})})
    insert_reshards(gm, pc)
    check(gm, """
        CHECK:      relu = torch.ops.aten.relu.default(w)
        CHECK-NEXT: reshard = self.reshard(relu, 'R', 'R', 'P', 'R')
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x, reshard)
        CHECK-NEXT: mm_1 = torch.ops.aten.mm.default(x, v)
        CHECK-NEXT: add = torch.ops.aten.add.Tensor(mm, mm_1)
        CHECK-NEXT: sum_1 = torch.ops.aten.sum.default(add)
        CHECK-NEXT: reshard_1 = self.reshard(sum_1, 'P', 'R')
        CHECK-NEXT: return reshard_1
    """)


def test_a_parameter_without_a_sync_dim_gets_its_gradient_reduced_on_the_edge() -> None:
    """The same step with no bucketed sync for v: its reader's Partial gradient is reduced to
    v's Replicate on the edge."""
    gm = _train_step()
    pc = pin(gm, TRAIN, {"dp": 2}, params={"w": "w", "v": "v"}, train=True, loss="sum_1", input_sharded=True)
    insert_reshards(gm, pc)
    check(gm, """
        CHECK:      reshard_1 = self.reshard(v, 'R', 'R', 'P', 'R')
        CHECK-NEXT: mm_1 = torch.ops.aten.mm.default(x, reshard_1)
    """)


@pytest.mark.parametrize("regathered", [False, True])
def test_a_zero3_parameters_gather_is_a_regather(regathered: bool) -> None:
    """w stored split by rows (ZeRO-3) and read whole by mm: its gather is a ``self.regather``
    naming its FQN when the plan gathers it again in backward, a plain reshard otherwise; both
    reduce-scatter the Partial gradient back to w's rows."""
    gm = _mm_relu()
    chosen = {**MM_RELU, "w": strategy("S(0)"), "relu": strategy("S(0)", "S(0)")}
    pc = pin(gm, chosen, {"dp": 2}, params={"w": "fc.weight"}, train=True, input_sharded=True,
             regather=frozenset({"fc.weight"} if regathered else ()))
    insert_reshards(gm, pc)
    gather = "self.regather(w, 'fc.weight', 'S(0)'" if regathered else "self.reshard(w, 'S(0)'"
    check(gm, f"""
        CHECK:      = {gather}, 'R', 'P', 'S(0)')
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x,
    """)


def test_a_piece_of_a_multi_output_op_is_resharded_after_it_is_picked() -> None:
    """split's pieces are placed S(0) by the op; a reader needing a piece whole gets it through
    a reshard after the getitem (a tuple cannot be resharded). A piece whose size the data
    decides is marked ``data_dependent`` (the runtime logs its collectives so)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    pieces = op(graph, "split", aten.split.Tensor, x, 2, 1)
    graph.output(op(graph, "relu", aten.relu.default, op(graph, "getitem", operator.getitem, pieces, 0)))
    gm = propagate(graph_module(graph), torch.randn(8, 4))
    chosen = {"x": strategy("S(0)"), "split": strategy(("S(0)", "S(0)"), "S(0)"), "getitem": strategy("R", "R"),
              "relu": strategy("R", "R")}
    pc = pin(gm, chosen, {"dp": 2}, input_sharded=True)
    pc.graph.nodes["split"].outputs = (TensorMeta((8, 2), torch.float32, frozenset({0})),) * 2
    insert_reshards(gm, pc)
    check(gm, """
        CHECK:      getitem = split[0]
        CHECK-NEXT: reshard = self.reshard(getitem, 'S(0)', 'R', data_dependent = True)
        CHECK-NEXT: relu = torch.ops.aten.relu.default(reshard)
    """)
