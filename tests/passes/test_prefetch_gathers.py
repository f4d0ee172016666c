"""``passes.prefetch_gathers``: each repeated block's parameter all-gathers are issued one block
ahead (FSDP's forward prefetch), and with ZeRO-3 each block's backward start is marked so the
block before's regathers can be issued then.

The input is a two-block program as insert_reshards leaves it: each block's weight gathered by a
reshard just before the block's matmul reads it. Block membership is export's
``nn_module_stack`` (``pinned.in_module``); the reshards, inserted, have none."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx

from autopar.passes.context import PassContext
from autopar.passes.prefetch_gathers import prefetch_gathers
from autopar.memory.options import MemoryPlan

from .filecheck import check
from .pinned import graph_module, in_module, op, pin, propagate, strategy

aten = torch.ops.aten
BLOCKS = ("layers.0", "layers.1")


def _two_blocks(gather: str = "reshard", read_twice: bool = False, last_block_read: bool = True
                ) -> torch.fx.GraphModule:
    """h = x; per block i: h = relu(h @ gather(w_i)). ``gather``: 'reshard', or 'regather'
    (ZeRO-3, naming the FQN); ``read_twice``: w0 is also read directly; ``last_block_read``:
    the program returns layers.1's value (else layers.0's, leaving layers.1 unread)."""
    graph = torch.fx.Graph()
    h = graph.placeholder("x")
    weights = [graph.placeholder(f"w{i}") for i in range(len(BLOCKS))]
    outs = []
    for i, (block, w) in enumerate(zip(BLOCKS, weights)):
        fqn = (f"{block}.fc.weight",) if gather == "regather" else ()
        gathered = graph.call_module(gather, (w, *fqn, "S(0)", "R", "P", "S(0)"))
        suffix = f"_{i}" if i else ""
        mm = in_module(op(graph, "mm" + suffix, aten.mm.default, h, gathered), f"{block}.fc")
        h = in_module(op(graph, "relu" + suffix, aten.relu.default, mm), f"{block}.act")
        outs.append(h)
    result = outs[-1] if last_block_read else outs[0]
    if read_twice:
        result = op(graph, "add", aten.add.Tensor, result, weights[0])
    graph.output(result)
    return propagate(graph_module(graph), torch.randn(4, 4), *(torch.randn(4, 4) for _ in BLOCKS))


def _pin(gm: torch.fx.GraphModule, mesh: dict[str, int] | None = None, **options: Any) -> PassContext:
    """Data parallel with ZeRO-3 weights: each w_i split by rows, gathered for its matmul."""
    chosen = {"x": strategy("R"), "w0": strategy("S(0)"), "w1": strategy("S(0)")}
    return pin(gm, chosen, mesh or {"dp": 2}, params={"w0": "layers.0.fc.weight", "w1": "layers.1.fc.weight"},
               train=True, **options)


def test_each_blocks_gathers_are_issued_before_the_block_before_computes() -> None:
    """layers.1's gather is issued before layers.0's first op (it runs while layers.0
    computes); layers.0's, the container's first, as early as its own gather. Each reshard
    waits for its handle (``pending=``) and stays the node autograd records."""
    gm = _two_blocks()
    prefetch_gathers(gm, _pin(gm))
    check(gm, """
        CHECK:      def forward(self, x, w0, w1):
        CHECK-NEXT: prefetch = self.prefetch(w0, 'S(0)', 'R')
        CHECK-NEXT: reshard = self.reshard(w0, 'S(0)', 'R', 'P', 'S(0)', pending = prefetch)
        CHECK-NEXT: prefetch_1 = self.prefetch(w1, 'S(0)', 'R')
        CHECK-NEXT: mm = torch.ops.aten.mm.default(x, reshard)
        CHECK-NEXT: relu = torch.ops.aten.relu.default(mm)
        CHECK-NEXT: reshard_1 = self.reshard(w1, 'S(0)', 'R', 'P', 'S(0)', pending = prefetch_1)
        CHECK-NEXT: mm_1 = torch.ops.aten.mm.default(relu, reshard_1)
        CHECK-NOT:  backward_starts
    """)


def test_a_prefetch_moves_what_the_gather_moves() -> None:
    """A gather that casts first (mixed precision, ``dtype=``) is prefetched in that dtype."""
    gm = _two_blocks()
    for node in gm.graph.nodes:
        if node.target == "reshard":
            node.kwargs = {"dtype": torch.bfloat16}
    prefetch_gathers(gm, _pin(gm))
    check(gm, "CHECK: prefetch_1 = self.prefetch(w1, 'S(0)', 'R', dtype = torch.bfloat16)")


@pytest.mark.parametrize("case, prefetched", [("checkpointed", {"w0"}), ("read twice", {"w1"}),
                                              ("one-device mesh", set())])
def test_gathers_that_cannot_be_prefetched_stay_as_they_are(case: str, prefetched: set[str]) -> None:
    """A checkpointed block's gathers (layers.1: its recompute replays them, and a handle serves
    one wait), a parameter another call reads too (w0), and gathers on a mesh dim of one device
    (nothing to gather) are left alone; the others are prefetched."""
    gm = _two_blocks(read_twice=case == "read twice")
    memory = MemoryPlan(checkpoint="full", checkpoint_blocks=["layers.1"]) if case == "checkpointed" else None
    prefetch_gathers(gm, _pin(gm, {"dp": 1} if case == "one-device mesh" else None, memory=memory))
    for i, w in enumerate(("w0", "w1")):
        reshard = "reshard_1" if i else "reshard"
        if w in prefetched:
            check(gm, f"""
                CHECK: = self.prefetch({w}, 'S(0)', 'R')
                CHECK: {reshard} = self.reshard({w}, 'S(0)', 'R', 'P', 'S(0)', pending =
            """)
        else:
            check(gm, f"""
                CHECK-NOT: self.prefetch({w}
                CHECK:     {reshard} = self.reshard({w}, 'S(0)', 'R', 'P', 'S(0)')
            """)


def test_zero3_marks_each_blocks_backward_start_for_the_block_befores_regathers() -> None:
    """With regathers (ZeRO-3 gathers again in backward), layers.1's value read after it is
    hooked: as its gradient arrives, layers.1's backward starts and layers.0's regathers are
    issued. The regathers are prefetched as gathers are (their placements after the FQN)."""
    gm = _two_blocks("regather")
    prefetch_gathers(gm, _pin(gm))
    check(gm, """
        CHECK:      prefetch = self.prefetch(w0, 'S(0)', 'R')
        CHECK-NEXT: regather = self.regather(w0, 'layers.0.fc.weight', 'S(0)', 'R', 'P', 'S(0)', pending = prefetch)
        CHECK-NEXT: prefetch_1 = self.prefetch(w1, 'S(0)', 'R')
        CHECK:      relu_1 = torch.ops.aten.relu.default(mm_1)
        CHECK-NEXT: backward_starts = self.backward_starts(relu_1, 'layers.1', 'layers.0')
        CHECK-NEXT: return relu_1
    """)


def test_a_block_whose_start_cannot_be_marked_is_refused() -> None:
    """layers.1 computes nothing read after it: no value to hook, so layers.0's regathers could
    never be issued ahead; refused rather than silently not prefetched."""
    gm = _two_blocks("regather", last_block_read=False)
    with pytest.raises(RuntimeError, match="block layers.1 computes nothing read after it"):
        prefetch_gathers(gm, _pin(gm))
