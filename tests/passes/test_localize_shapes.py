"""``passes.localize_shapes``: size arguments written for the global tensor become this rank's.

Each test pins a tensor's split, runs the pass, checks the rewritten size arguments and, where
the op is local, runs the program on rank 0's shard against the slice of the global result."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch import nn

from autopar.passes.localize_shapes import localize_shapes

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

aten = torch.ops.aten
hop = torch.ops.higher_order


def _one_op(target: object, *args: object, shape: tuple[int, ...] = (8, 6)
            ) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    """``out = target(x, *args)`` on a global x of ``shape``, with its values."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(op(graph, "out", target, x, *args))
    x_ = torch.randn(shape)
    return propagate(graph_module(graph), x_), x_


def test_a_views_sizes_become_the_ranks() -> None:
    """view(x, [8, 2, 3]) with x and its output split on dim 0 over 2 ranks: the rank views its
    4 rows, so the size argument is [4, 2, 3]; rank 0's program gives rank 0's rows."""
    gm, x = _one_op(aten.view.default, [8, 2, 3])
    pc = pin(gm, {"x": strategy("S(0)"), "out": strategy("S(0)", "S(0)")}, {"dp": 2}, input_sharded=True)
    localize_shapes(gm, pc)
    check(gm, """
        CHECK:      def forward(self, x):
        CHECK-NEXT: out = torch.ops.aten.view.default(x, [4, 2, 3])
    """)
    torch.testing.assert_close(gm(x[:4]), x.view(8, 2, 3)[:4])


def test_a_reshape_split_on_two_mesh_dims_divides_each_split_dim() -> None:
    """reshape(x, [8, 2, 3]) placed S(0)S(1) on a 2 x 2 mesh: rows halved by dp, the 2 dim by tp."""
    gm, x = _one_op(aten.reshape.default, [8, 2, 3])
    pc = pin(gm, {"x": strategy("S(0)S(1)"), "out": strategy("S(0)S(1)", "S(0)S(1)")}, {"dp": 2, "tp": 2})
    localize_shapes(gm, pc)
    check(gm, "CHECK: out = torch.ops.aten.reshape.default(x, [4, 1, 3])")
    torch.testing.assert_close(gm(x[:4, :3]), x.view(8, 2, 3)[:4, :1])


def test_an_expand_and_an_unflatten_name_local_sizes() -> None:
    """expand names its whole output shape, unflatten the sizes its dim becomes (a negative dim
    counted from the input's rank): both are divided where the output is split."""
    gm, x = _one_op(aten.expand.default, [8, 6], shape=(8, 1))
    localize_shapes(gm, pin(gm, {"x": strategy("S(0)"), "out": strategy("S(0)", "S(0)")}, {"dp": 2}))
    check(gm, "CHECK: out = torch.ops.aten.expand.default(x, [4, 6])")
    torch.testing.assert_close(gm(x[:4]), x.expand(8, 6)[:4])

    gm, x = _one_op(aten.unflatten.int, -1, [2, 3])
    localize_shapes(gm, pin(gm, {"x": strategy("S(1)"), "out": strategy("S(1)", "S(1)")}, {"tp": 2}))
    check(gm, "CHECK: out = torch.ops.aten.unflatten.int(x, -1, [1, 3])")
    torch.testing.assert_close(gm(x[:, :3]), x.unflatten(-1, (2, 3))[:, :1])


def test_a_split_of_a_strided_shard_splits_locally() -> None:
    """x (8, 8) placed S(1/2) (each rank holds its half of both 4-column blocks, a fused
    projection's layout): split(x, 4, 1) becomes split(x, 2, 1) and each piece is the rank's
    half of the global piece. A split along a dim no one splits keeps its sizes."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    pieces = op(graph, "split", aten.split.Tensor, x, 4, 1)
    graph.output(tuple(op(graph, name, operator.getitem, pieces, i) for i, name in enumerate(("getitem", "getitem_1"))))
    x_ = torch.randn(8, 8)
    gm = propagate(graph_module(graph), x_)
    localize_shapes(gm, pin(gm, {"x": strategy("S(1/2)"), "split": strategy(("S(1)", "S(1)"), "S(1/2)")}, {"tp": 2}))
    check(gm, "CHECK: split = torch.ops.aten.split.Tensor(x, 2, 1)")
    first, second = gm(x_[:, [0, 1, 4, 5]])
    torch.testing.assert_close((first, second), (x_[:, 0:2], x_[:, 4:6]))

    gm, x_ = _one_op(aten.split_with_sizes.default, [2, 4], 1)
    localize_shapes(gm, pin(gm, {"x": strategy("S(0)"), "out": strategy(("S(0)", "S(0)"), "S(0)")}, {"dp": 2}))
    check(gm, "CHECK: out = torch.ops.aten.split_with_sizes.default(x, [2, 4], 1)")


def test_squeeze_names_the_globally_size_one_dims() -> None:
    """x (2, 1, 6) split on dim 0 over 2 ranks holds (1, 1, 6): a bare squeeze would drop the
    rank's dim 0 too, so it becomes squeeze.dims(x, [1]); squeeze.dim of a dim that is not
    size 1 globally squeezes nothing, even where the rank's piece of it is."""
    gm, x = _one_op(aten.squeeze.default, shape=(2, 1, 6))
    localize_shapes(gm, pin(gm, {"x": strategy("S(0)"), "out": strategy("S(0)", "S(0)")}, {"dp": 2}))
    check(gm, "CHECK: out = torch.ops.aten.squeeze.dims(x, [1])")
    assert gm(x[:1]).shape == (1, 6)

    gm, x = _one_op(aten.squeeze.dim, 0, shape=(2, 1, 6))
    localize_shapes(gm, pin(gm, {"x": strategy("S(0)"), "out": strategy("S(0)", "S(0)")}, {"dp": 2}))
    check(gm, "CHECK: out = torch.ops.aten.squeeze.dims(x, [])")
    assert gm(x[:1]).shape == (1, 1, 6)


def _grouped_conv(groups_as_kwarg: bool) -> tuple[torch.fx.GraphModule, torch.Tensor, torch.Tensor]:
    """conv2d of x (2, 4, 5, 5) by w (4, 1, 3, 3) in 4 groups (depthwise)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    if groups_as_kwarg:
        conv = op(graph, "conv2d", aten.conv2d.default, x, w, groups=4)
    else:
        conv = op(graph, "conv2d", aten.conv2d.default, x, w, None, [1, 1], [0, 0], [1, 1], 4)
    graph.output(conv)
    x_, w_ = torch.randn(2, 4, 5, 5), torch.randn(4, 1, 3, 3)
    return propagate(graph_module(graph), x_, w_), x_, w_


@pytest.mark.parametrize("groups_as_kwarg", [False, True])
def test_a_convolution_split_by_groups_runs_the_ranks_groups(groups_as_kwarg: bool) -> None:
    """Channels and weight rows split over 2 ranks: each rank runs 2 of the 4 groups, whether
    ``groups`` was written positionally or by name."""
    gm, x, w = _grouped_conv(groups_as_kwarg)
    chosen = {"x": strategy("S(1)"), "w": strategy("S(0)"), "conv2d": strategy("S(1)", "S(1)", "S(0)")}
    localize_shapes(gm, pin(gm, chosen, {"tp": 2}, params={"w": "conv.weight"}))
    groups = "groups = 2" if groups_as_kwarg else "None, [1, 1], [0, 0], [1, 1], 2)"
    check(gm, f"CHECK: conv2d = torch.ops.aten.conv2d.default(x, w, {groups}")
    torch.testing.assert_close(gm(x[:, :2], w[:2]), torch.conv2d(x, w, groups=4)[:, :2])


def _no_grad_block() -> torch.fx.GraphModule:
    """out = wrap_with_set_grad_enabled(False, block, x), the block viewing x as [8, 2, 3]."""
    sub = torch.fx.Graph()
    sub.output((op(sub, "view", aten.view.default, sub.placeholder("x"), [8, 2, 3]),))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    block = graph.get_attr("block")
    graph.output(op(graph, "wrap", hop.wrap_with_set_grad_enabled, False, block, x))
    gm = graph_module(graph, block=torch.fx.GraphModule(nn.Module(), sub))
    return propagate(gm, torch.randn(8, 6))


def test_a_higher_order_ops_subgraph_keeps_its_global_sizes() -> None:
    """A torch.no_grad() block runs replicated: its subgraph's view still names [8, 2, 3]; a plan
    splitting the block is refused (its subgraph is written for whole tensors)."""
    gm = _no_grad_block()
    localize_shapes(gm, pin(gm, {"x": strategy("R"), "wrap": strategy(("R",), "R")}, {"dp": 2}))
    check(gm.get_submodule("block"), "CHECK: view = torch.ops.aten.view.default(x, [8, 2, 3])")

    gm = _no_grad_block()
    with pytest.raises(RuntimeError, match="must run replicated"):
        localize_shapes(gm, pin(gm, {"x": strategy("S(0)"), "wrap": strategy(("S(0)",), "S(0)")}, {"dp": 2}))


class _Selected(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = x[ids.nonzero().squeeze(-1)]  # as many rows as ids the data selects
        return rows.reshape(rows.shape[0], 2, 3)


def test_a_data_dependent_size_stays_the_node_computing_it() -> None:
    """A tiny torch.export capture (its sizes are SymInts): reshape(rows, [u0, 2, 3]) with u0 the
    number of rows the data selects. Split on the 2 dim, the 2 becomes 1 but u0 stays the
    ``sym_size`` node: its planning-time hint would freeze one batch's count into the program."""
    ep = torch.export.export(_Selected(), (torch.randn(8, 6), torch.tensor([1, 0, 1, 1, 0, 1, 1, 0])))
    gm = ep.graph_module
    reshape = next(n for n in gm.graph.nodes if n.target is aten.reshape.default)
    index = reshape.args[0]
    hints = {index.meta["val"].shape[0].node.expr: 5}
    pc = pin(gm, {index.name: strategy("S(1)"), "reshape": strategy("S(1)", "S(1)")}, {"tp": 2}, size_hints=hints)
    localize_shapes(gm, pc)
    check(gm, """
        CHECK:      sym_size_int_1 = torch.ops.aten.sym_size.int(nonzero, 0)
        CHECK:      reshape = torch.ops.aten.reshape.default(index, [sym_size_int_1, 1, 3])
    """)
