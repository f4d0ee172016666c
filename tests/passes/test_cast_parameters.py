"""``passes.cast_parameters``: mixed precision. A parameter arrives as an fp32 master and is read in
the dtype the step was captured in (bf16): one ``_to_copy`` for its direct readers, a cast inside
each of its reshards (``dtype=``), and its gradient reduced in fp32 (``grad_dtype=``)."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from autopar.passes.cast_parameters import cast_parameters
from autopar.rules.strategy import Strategy

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

aten = torch.ops.aten
bf16 = torch.bfloat16


def _two_readers(dtype: torch.dtype = bf16) -> torch.fx.GraphModule:
    """x @ w + relu(w)[0], captured from a ``dtype`` model: w is read directly twice."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    mm = op(graph, "mm", aten.mm.default, x, w)
    graph.output(op(graph, "add", aten.add.Tensor, mm, op(graph, "relu", aten.relu.default, w)))
    return propagate(graph_module(graph), torch.randn(4, 4, dtype=dtype), torch.randn(4, 4, dtype=dtype))


def _replicated(gm: torch.fx.GraphModule) -> dict[str, Strategy]:
    """Every planned node of ``gm`` replicated on one mesh dim."""
    names = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    return {n.name: strategy("R", *(["R"] * len(n.all_input_nodes))) for n in names}


def test_a_parameters_direct_readers_share_one_bf16_copy() -> None:
    """mm and relu read one ``_to_copy(w, dtype=bf16)`` made just before the first of them (it
    lives no longer than it must); the input x, bf16 already, is no parameter: untouched. Run on
    an fp32 master, the program computes in bf16 what the bf16 model computed."""
    gm = _two_readers()
    cast_parameters(gm, pin(gm, _replicated(gm), {"dp": 2}, params={"w": "fc.weight"}, master_dtype=torch.float32))
    check(gm, """
        CHECK:      def forward(self, x, w):
        CHECK-NEXT: _to_copy_default = torch.ops.aten._to_copy.default(w, dtype = torch.bfloat16)
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x, _to_copy_default)
        CHECK-NEXT: relu = torch.ops.aten.relu.default(_to_copy_default)
        CHECK-NOT:  _to_copy
    """)
    x, master = torch.randn(4, 4, dtype=bf16), torch.randn(4, 4)
    out = gm(x, master)
    assert out.dtype == bf16
    torch.testing.assert_close(out, x @ master.to(bf16) + master.to(bf16).relu())


def test_an_fp32_parameter_is_read_as_it_is() -> None:
    """A parameter captured in fp32 needs no cast, whatever the masters."""
    gm = _two_readers(torch.float32)
    before = gm.code
    cast_parameters(gm, pin(gm, _replicated(gm), {"dp": 2}, params={"w": "fc.weight"}, master_dtype=torch.float32))
    assert gm.code == before


def _resharded() -> torch.fx.GraphModule:
    """x @ gather(w): w's only reader is its reshard, as insert_reshards writes it."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    gathered = graph.call_module("reshard", (w, "S(0)", "R", "P", "S(0)"))
    graph.output(op(graph, "mm", aten.mm.default, x, gathered))
    return propagate(graph_module(graph), torch.randn(4, 4, dtype=bf16), torch.randn(4, 4, dtype=bf16))


def test_a_reshard_of_a_parameter_casts_before_its_collectives() -> None:
    """The gather moves bf16 (``dtype=``) and its backward reduce-scatters the gradient in fp32
    (``grad_dtype=``) before handing the master its fp32 gradient; no separate copy is made."""
    gm = _resharded()
    chosen = {"x": strategy("R"), "w": strategy("S(0)"), "mm": strategy("R", "R", "R")}
    cast_parameters(gm, pin(gm, chosen, {"dp": 2}, params={"w": "fc.weight"}, master_dtype=torch.float32))
    check(gm, """
        CHECK:      reshard = self.reshard(w, 'S(0)', 'R', 'P', 'S(0)', dtype = torch.bfloat16, grad_dtype = torch.float32)
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x, reshard)
        CHECK-NOT:  _to_copy
    """)


def test_a_bf16_model_without_masters_only_reduces_gradients_in_fp32() -> None:
    """Parameters that are bf16 themselves (no ``master_dtype``) are read as they are, but their
    gradients are still reduced in fp32, as the plan prices them."""
    gm = _resharded()
    chosen = {"x": strategy("R"), "w": strategy("S(0)"), "mm": strategy("R", "R", "R")}
    cast_parameters(gm, pin(gm, chosen, {"dp": 2}, params={"w": "fc.weight"}))
    check(gm, """
        CHECK:     reshard = self.reshard(w, 'S(0)', 'R', 'P', 'S(0)', grad_dtype = torch.float32)
        CHECK-NOT: _to_copy
    """)


def test_a_parameter_written_in_place_is_refused() -> None:
    """w.add_(1) on a bf16 copy would be lost on the fp32 master: refused."""
    graph = torch.fx.Graph()
    w = graph.placeholder("w")
    graph.output(op(graph, "add_", aten.add_.Tensor, w, 1.0))
    gm = propagate(graph_module(graph), torch.randn(4, dtype=bf16))
    pc = pin(gm, {"w": strategy("R"), "add_": strategy("R", "R")}, {"dp": 2}, params={"w": "fc.weight"},
             master_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="parameter fc.weight is written in place"):
        cast_parameters(gm, pc)
