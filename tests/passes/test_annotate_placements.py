"""``passes.annotate_placements``: each planned node carries its chosen strategy and plan name in
``node.meta``; the program itself does not change."""

from __future__ import annotations

import torch
import torch.fx

from autopar.passes.annotate_placements import annotate_placements
from autopar.passes.context import PLAN_NAME, STRATEGY, plan_name, strategy_of

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

aten = torch.ops.aten


def _linear() -> torch.fx.GraphModule:
    """x (8, 4) @ w (4, 4), then relu: three planned nodes and the output."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(op(graph, "relu", aten.relu.default, op(graph, "mm", aten.mm.default, x, w)))
    return propagate(graph_module(graph), torch.randn(8, 4), torch.randn(4, 4))


def test_each_chosen_node_carries_its_strategy_and_plan_name() -> None:
    """The passes after it find a node's placements in its meta, and its plan name survives the
    node being replaced (a pass copies the meta onto the call it writes)."""
    gm = _linear()
    chosen = {"x": strategy("S(0)"), "w": strategy("R"), "mm": strategy("S(0)", "S(0)", "R")}
    pc = pin(gm, chosen, {"dp": 2}, params={"w": "w"})
    for node in gm.graph.nodes:  # ``pin`` pins as the pass does: start from a bare graph
        node.meta.pop(STRATEGY, None), node.meta.pop(PLAN_NAME, None)
    before = gm.code
    annotate_placements(gm, pc)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, chosen_strategy in chosen.items():
        assert strategy_of(nodes[name]) is chosen_strategy and plan_name(nodes[name]) == name
    assert gm.code == before


def test_a_node_the_plan_does_not_place_is_left_bare() -> None:
    """relu has no chosen strategy here (a node the planner does not place, such as a symbolic
    size): no meta is written, and passes skip it."""
    gm = _linear()
    pc = pin(gm, {"x": strategy("R"), "w": strategy("R"), "mm": strategy("R", "R", "R")}, {"dp": 2},
             params={"w": "w"})
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    annotate_placements(gm, pc)
    assert STRATEGY not in relu.meta and PLAN_NAME not in relu.meta
    check(gm, """
        CHECK:      def forward(self, x, w):
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x, w)
        CHECK-NEXT: relu = torch.ops.aten.relu.default(mm)
        CHECK-NEXT: return relu
    """)
