"""``passes.checkpoint_blocks``: each checkpointed block's nodes move into a submodule run as one
``self.recompute(region, policy, *inputs)`` call, which the runtime (``runtime.recompute``) runs
under activation checkpointing.

Block membership is export's ``nn_module_stack`` (``pinned.in_module``). The runs here call the
region directly (``CallRegion``): what they check is that outlining keeps the program's values
and gradients, not torch's checkpointing."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from autopar.passes.checkpoint_blocks import checkpoint_blocks
from autopar.passes.context import PassContext
from autopar.memory.options import MemoryPlan

from .filecheck import check
from .pinned import graph_module, in_module, op, pin, propagate

aten = torch.ops.aten


class CallRegion(nn.Module):
    """``self.recompute`` without checkpointing: runs the region once."""

    def forward(self, region: nn.Module, policy: str, *inputs: Any, mutated: tuple[int, ...] = ()) -> Any:
        return region(*inputs)


def _mlp(gathered: bool = False, **modules: nn.Module) -> torch.fx.GraphModule:
    """relu(relu(x @ w0) @ w1), layer i in block ``layers.i``; ``gathered``: w0 reaches its
    matmul through a reshard (inserted: no module path)."""
    graph = torch.fx.Graph()
    x, w0, w1 = graph.placeholder("x"), graph.placeholder("w0"), graph.placeholder("w1")
    w = graph.call_module("reshard", (w0, "S(0)", "R")) if gathered else w0
    h = in_module(op(graph, "mm", aten.mm.default, x, w), "layers.0.fc")
    h = in_module(op(graph, "relu", aten.relu.default, h), "layers.0.act")
    h = in_module(op(graph, "mm_1", aten.mm.default, h, w1), "layers.1.fc")
    graph.output(in_module(op(graph, "relu_1", aten.relu.default, h), "layers.1.act"))
    return propagate(graph_module(graph, **modules), *(torch.randn(4, 4) for _ in range(3)))


def _context(gm: torch.fx.GraphModule, blocks: list[str], policy: str = "full") -> PassContext:
    """Every placement replicated (this pass reads none); ``blocks`` checkpointed under ``policy``."""
    return pin(gm, {}, {"dp": 2}, memory=MemoryPlan(checkpoint=policy, checkpoint_blocks=blocks))


def test_a_blocks_nodes_become_one_recompute_call() -> None:
    """layers.0 (mm, relu) becomes the submodule ``checkpoint_layers_0`` taking x and w0 and
    returning relu, the one value read after it; layers.1, not checkpointed, stays. The program
    computes the same values and gradients."""
    gm = _mlp(recompute=CallRegion())
    x, w0, w1 = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    expected = gm(x, w0, w1)
    expected_grads = torch.autograd.grad(expected.sum(), (x, w0, w1))
    checkpoint_blocks(gm, _context(gm, ["layers.0"]))
    check(gm, """
        CHECK:      def forward(self, x, w0, w1):
        CHECK-NEXT: checkpoint_layers_0 = self.checkpoint_layers_0
        CHECK-NEXT: recompute = self.recompute(checkpoint_layers_0, 'full', x, w0)
        CHECK-NEXT: getitem = recompute[0]
        CHECK-NEXT: mm_1 = torch.ops.aten.mm.default(getitem, w1)
        CHECK-NEXT: relu_1 = torch.ops.aten.relu.default(mm_1)
    """)
    check(gm.get_submodule("checkpoint_layers_0"), """
        CHECK:      def forward(self, x, w0):
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x, w0)
        CHECK-NEXT: relu = torch.ops.aten.relu.default(mm)
        CHECK-NEXT: return (relu,)
    """)
    out = gm(x, w0, w1)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), (x, w0, w1)), expected_grads)


def test_a_reshard_feeding_only_the_block_is_recomputed_with_it() -> None:
    """w0's gather, inserted with no module path, belongs to the block its readers lie in: it
    moves into the region (its all-gather runs again in the recompute), and the region takes w0.
    Both blocks checkpointed under the selective policy: two calls."""
    gm = _mlp(gathered=True)
    checkpoint_blocks(gm, _context(gm, ["layers.0", "layers.1"], "selective"))
    check(gm, """
        CHECK:      recompute = self.recompute(checkpoint_layers_0, 'selective', w0, x)
        CHECK:      recompute_1 = self.recompute(checkpoint_layers_1, 'selective', getitem, w1)
        CHECK-NOT:  self.reshard
    """)
    check(gm.get_submodule("checkpoint_layers_0"), """
        CHECK:      def forward(self, w0, x):
        CHECK-NEXT: reshard = self.reshard(w0, 'S(0)', 'R')
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x, reshard)
    """)


def test_no_checkpointing_leaves_the_program_as_it_is() -> None:
    """Policy 'none' (the plan recomputes nothing), whatever blocks it lists: no region."""
    gm = _mlp()
    before = gm.code
    checkpoint_blocks(gm, _context(gm, ["layers.0"], "none"))
    assert gm.code == before


def _interleaved(head_reads_block: bool) -> torch.fx.GraphModule:
    """layers.0 computes mm then relu; between them a node of module ``head`` computes neg of
    x (``head_reads_block`` False: it can leave before the block) or of mm, read by relu (it
    reads from and feeds the block: it splits it)."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    mm = in_module(op(graph, "mm", aten.mm.default, x, w), "layers.0.fc")
    neg = in_module(op(graph, "neg", aten.neg.default, mm if head_reads_block else x), "head")
    add = in_module(op(graph, "add", aten.add.Tensor, mm, neg), "layers.0.act")
    graph.output(add)
    return propagate(graph_module(graph, recompute=CallRegion()), torch.randn(4, 4), torch.randn(4, 4))


def test_a_node_inside_a_blocks_span_that_can_leave_it_moves_out() -> None:
    """neg(x), of another module but lying between the block's nodes, reads nothing the block
    computes: it moves before the block, which is then one region."""
    gm = _interleaved(head_reads_block=False)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    expected = gm(x, w)
    checkpoint_blocks(gm, _context(gm, ["layers.0"]))
    check(gm, """
        CHECK:      neg = torch.ops.aten.neg.default(x)
        CHECK-NEXT: checkpoint_layers_0 = self.checkpoint_layers_0
        CHECK-NEXT: recompute = self.recompute(checkpoint_layers_0, 'full', x, w, neg)
        CHECK-NOT:  self.recompute
    """)
    torch.testing.assert_close(gm(x, w), expected)


def test_a_node_that_reads_from_and_feeds_a_block_splits_it_in_two_regions() -> None:
    """neg(mm) is read by the block's add: it can go neither before nor after, so the block runs
    as two regions (``checkpoint_layers_0`` and ``checkpoint_layers_0_1``), still exact."""
    gm = _interleaved(head_reads_block=True)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    expected = gm(x, w)
    checkpoint_blocks(gm, _context(gm, ["layers.0"]))
    check(gm, """
        CHECK:      recompute = self.recompute(checkpoint_layers_0, 'full', x, w)
        CHECK-NEXT: getitem = recompute[0]
        CHECK-NEXT: neg = torch.ops.aten.neg.default(getitem)
        CHECK-NEXT: checkpoint_layers_0_1 = self.checkpoint_layers_0_1
        CHECK-NEXT: recompute_1 = self.recompute(checkpoint_layers_0_1, 'full', getitem, neg)
    """)
    torch.testing.assert_close(gm(x, w), expected)


def test_an_input_the_block_writes_in_place_is_named_mutated() -> None:
    """The block adds into a program input (a buffer) in place: its recompute must see the value
    the forward found, so the call names its position (``mutated=(0,)``: buf is the region's
    first input) and the runtime keeps a copy for the recompute."""
    graph = torch.fx.Graph()
    x, buf = graph.placeholder("x"), graph.placeholder("buf")
    add_ = in_module(op(graph, "add_", aten.add_.Tensor, buf, 1.0), "layers.0.norm")
    graph.output(in_module(op(graph, "mul", aten.mul.Tensor, x, add_), "layers.0.norm"))
    gm = propagate(graph_module(graph), torch.randn(4), torch.zeros(4))
    checkpoint_blocks(gm, _context(gm, ["layers.0"]))
    check(gm, "CHECK: recompute = self.recompute(checkpoint_layers_0, 'full', buf, x, mutated = (0,))")
