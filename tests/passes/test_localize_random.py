"""``passes.localize_random``: every op that draws random numbers becomes a ``self.random`` call
naming the op, its output placements and its global output shape, so the runtime
(``runtime.random.RandomOps``) answers each draw for the rank's elements of one global draw."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch import nn

from autopar.passes.localize_random import localize_random
from autopar.runtime.random import RandomOps
from autopar.runtime.stream import CounterStream

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

aten = torch.ops.aten
hop = torch.ops.higher_order
SEED = 7


def _dropout(p: float = 0.5, train: bool = True, **modules: nn.Module) -> torch.fx.GraphModule:
    """dropout(x (8, 4), p, train), as export writes ``nn.Dropout``."""
    graph = torch.fx.Graph()
    graph.output(op(graph, "dropout", aten.dropout.default, graph.placeholder("x"), p, train))
    return propagate(graph_module(graph, **modules), torch.randn(8, 4))


def test_a_dropout_on_split_rows_draws_the_ranks_slice_of_one_global_draw() -> None:
    """Rows split over 2 ranks: the call carries 'S(0)' and the global shape (8, 4). Run as
    rank 0 and rank 1 on their rows, the two halves are the single-device draw."""
    x = torch.randn(8, 4)
    halves = []
    for rank in (0, 1):
        gm = _dropout(random=RandomOps((2,), (rank,), CounterStream(SEED)))
        localize_random(gm, pin(gm, {"x": strategy("S(0)"), "dropout": strategy("S(0)", "S(0)")}, {"dp": 2}))
        halves.append(gm(x.chunk(2)[rank]))
    check(gm, """
        CHECK:      def forward(self, x):
        CHECK-NEXT: random = self.random('aten.dropout.default', 'S(0)', (8, 4), x, 0.5, True)
        CHECK-NEXT: return random
        CHECK-NOT:  aten.dropout
    """)
    whole = RandomOps((1,), (0,), CounterStream(SEED))("aten.dropout.default", "R", (8, 4), x, 0.5, True)
    torch.testing.assert_close(torch.cat(halves), whole)


@pytest.mark.parametrize("p, train", [(0.0, True), (0.5, False)])
def test_a_dropout_that_draws_nothing_is_left_as_captured(p: float, train: bool) -> None:
    """p = 0, or eval mode: no draw, so nothing to keep in lockstep."""
    gm = _dropout(p, train)
    before = gm.code
    localize_random(gm, pin(gm, {"x": strategy("S(0)"), "dropout": strategy("S(0)", "S(0)")}, {"dp": 2}))
    assert gm.code == before


def test_a_multi_output_draw_names_its_first_outputs_shape() -> None:
    """native_dropout returns (output, mask): the call names the output's placements and shape, on
    a 2 x 2 mesh."""
    graph = torch.fx.Graph()
    pair = op(graph, "native_dropout", aten.native_dropout.default, graph.placeholder("x"), 0.1, True)
    graph.output(op(graph, "getitem", operator.getitem, pair, 0))
    gm = propagate(graph_module(graph), torch.randn(8, 4))
    chosen = {"x": strategy("S(0)S(1)"), "native_dropout": strategy(("S(0)S(1)", "S(0)S(1)"), "S(0)S(1)")}
    localize_random(gm, pin(gm, chosen, {"dp": 2, "tp": 2}))
    check(gm, """
        CHECK:      random = self.random('aten.native_dropout.default', 'S(0)S(1)', (8, 4), x, 0.1, True)
        CHECK-NEXT: getitem = random[0]
    """)


def test_a_draw_inside_a_no_grad_block_draws_the_whole_tensor_from_the_same_stream() -> None:
    """The block runs replicated (no strategy inside it): its rand_like draws 'R' with the whole
    shape, through the very module the program's other draws use."""
    sub = torch.fx.Graph()
    sub.output((op(sub, "rand_like", aten.rand_like.default, sub.placeholder("x")),))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    wrap = op(graph, "wrap", hop.wrap_with_set_grad_enabled, False, graph.get_attr("block"), x)
    graph.output(op(graph, "getitem", operator.getitem, wrap, 0))
    random = RandomOps((2,), (0,), CounterStream(SEED))
    block = propagate(torch.fx.GraphModule(nn.Module(), sub), torch.randn(8, 4))  # export gives subgraphs values too
    gm = propagate(graph_module(graph, block=block, random=random), torch.randn(8, 4))
    localize_random(gm, pin(gm, {"x": strategy("R"), "wrap": strategy(("R",), "R")}, {"dp": 2}))
    check(block, "CHECK: random = self.random('aten.rand_like.default', 'R', (8, 4), x)")
    assert block.get_submodule("random") is random
    assert gm(torch.randn(8, 4)).shape == (8, 4)
