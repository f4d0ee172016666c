"""``passes.retarget_devices``: tensors the step creates go to this rank's device.

A step captured from a meta-device model creates its own tensors (``arange``, masks) on
``meta``; the rank's program creates them on ``PassContext.device_type``, in the subgraphs of
higher-order ops too. The pass reads no placements: the graphs here pin none."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn

from autopar.passes.retarget_devices import retarget_devices

from .filecheck import check
from .pinned import graph_module, op, pin

aten = torch.ops.aten
hop = torch.ops.higher_order
META = torch.device("meta")


def _made_on_meta() -> torch.fx.GraphModule:
    """x + arange(4) (device by keyword) + x.to(meta) (device positional), as a meta capture writes them."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    arange = op(graph, "arange", aten.arange.default, 4, device=META, pin_memory=False)
    moved = op(graph, "to", aten.to.device, x, META, torch.float32)
    graph.output(op(graph, "add_1", aten.add.Tensor, op(graph, "add", aten.add.Tensor, x, arange), moved))
    return graph_module(graph)


def test_tensors_made_on_meta_are_made_on_the_ranks_device() -> None:
    """Keyword and positional devices both become the rank's; the program then runs on CPU tensors."""
    gm = _made_on_meta()
    retarget_devices(gm, pin(gm, {}, {"dp": 2}, device_type="cpu"))
    check(gm, """
        CHECK:      arange = torch.ops.aten.arange.default(4, device = device(type='cpu'), pin_memory = False)
        CHECK-NEXT: to = torch.ops.aten.to.device(x, device(type='cpu'), torch.float32)
        CHECK-NOT:  meta
    """)
    x = torch.ones(4)
    torch.testing.assert_close(gm(x), x + torch.arange(4) + x)


def test_the_target_is_the_device_type_the_rank_runs_on() -> None:
    """On a GPU mesh the same step creates its tensors on ``cuda`` (the rank's current device)."""
    gm = _made_on_meta()
    retarget_devices(gm, pin(gm, {}, {"dp": 2}, device_type="cuda"))
    check(gm, """
        CHECK:     arange = torch.ops.aten.arange.default(4, device = device(type='cuda'), pin_memory = False)
        CHECK:     to = torch.ops.aten.to.device(x, device(type='cuda'), torch.float32)
        CHECK-NOT: meta
    """)


def test_a_tensor_made_inside_a_no_grad_block_is_retargeted_too() -> None:
    """The block's subgraph runs on the rank as well: its arange moves with the rest."""
    sub = torch.fx.Graph()
    x_in = sub.placeholder("x")
    sub.output((op(sub, "add", aten.add.Tensor, x_in, op(sub, "arange", aten.arange.default, 4, device=META)),))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    wrap = op(graph, "wrap", hop.wrap_with_set_grad_enabled, False, graph.get_attr("block"), x)
    graph.output(op(graph, "getitem", operator.getitem, wrap, 0))
    gm = graph_module(graph, block=torch.fx.GraphModule(nn.Module(), sub))
    retarget_devices(gm, pin(gm, {}, {"dp": 2}, device_type="cpu"))
    check(gm.get_submodule("block"), "CHECK: arange = torch.ops.aten.arange.default(4, device = device(type='cpu'))")
    torch.testing.assert_close(gm(torch.ones(4)), torch.ones(4) + torch.arange(4))
