"""Errors of a rank's program say where they arose: the node, its placements and its module
(``runtime.located``), as an exception of the original's type with the original as its cause."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.api.planning import plan_step
from autopar.runtime.build import build_rank_module
from autopar.runtime.located import retold
from autopar.runtime.module import ParallelModule
from examples import gpt


@pytest.fixture
def gpt_dp2() -> Iterator[tuple[ParallelModule, tuple[torch.Tensor, ...]]]:
    """GPT's rank-0 module on dp=2 under a fake process group (collectives keep shapes only)."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        model, inputs, loss_fn, targets = gpt.build()
        step = plan_step(model, autopar.Mesh.from_device_mesh(mesh), inputs, loss_fn=loss_fn,
                         example_targets=targets)
        yield build_rank_module(model, mesh, step), (*inputs, *targets)
    finally:
        dist.destroy_process_group()


def _retarget(pm: ParallelModule, placements: tuple[str, ...], new: tuple[str, ...]) -> torch.fx.Node:
    """Give the program's reshard with these placements others (a plan's mistake, made on purpose)."""
    node = next(n for n in pm.program.graph.nodes if n.op == "call_module" and n.args[1:] == placements)
    node.args = (node.args[0], *new)
    pm.program.recompile()
    return node


def test_a_backward_error_names_the_reshard_it_arose_in(gpt_dp2: tuple[ParallelModule, tuple]) -> None:
    """The position embedding's reshard, its gradient reduced to a shard instead of replicated:
    autograd's own error names only ``_RedistributeBackward``."""
    pm, values = gpt_dp2
    node = _retarget(pm, ("R", "R", "P", "R"), ("R", "R", "P", "S(0)"))
    with pytest.raises(RuntimeError, match="invalid gradient") as info:
        pm.step(*values)
    message = str(info.value)
    assert f"(raised in backward, in the backward of node {node.name} = self.reshard(embedding_1, 'R', 'R', 'P', " \
           "'S(0)'), from module 'wpe', read in module 'drop')" in message, message
    assert isinstance(info.value.__cause__, RuntimeError) and "raised in" not in str(info.value.__cause__)


def test_a_forward_error_names_its_node(gpt_dp2: tuple[ParallelModule, tuple]) -> None:
    """In a runtime op (the reshard's collective) and on a line of the program (an aten op)."""
    pm, values = gpt_dp2
    node = _retarget(pm, ("R", "R", "P", "R"), ("R", "S(5)", "P", "R"))
    with pytest.raises(IndexError) as info:
        pm(*values)
    assert f"(raised in forward at node {node.name} = self.reshard(embedding_1, 'R', 'S(5)', 'P', 'R'), " \
           "from module 'wpe', read in module 'drop')" in str(info.value)
    node.args = (node.args[0], "R", "R", "P", "R")
    view = next(n for n in pm.program.graph.nodes if n.target == torch.ops.aten.view.default)
    view.args = (view.args[0], [3, 5, 7])
    pm.program.recompile()
    with pytest.raises(RuntimeError, match=r"shape '\[3, 5, 7\]' is invalid") as info:
        pm(*values)
    assert f"(raised in forward at node {view.name} = aten.view.default(getitem, [3, 5, 7]), placed S(0) from " \
           "(S(0)), in module 'blocks.0.attn')" in str(info.value)


def test_a_told_error_keeps_its_type() -> None:
    """Of a type made from a message: that type (an out-of-memory error stays one); else a RuntimeError."""
    for exc in (torch.OutOfMemoryError("no memory"), autopar.InputError("bad"), ValueError("v")):
        told = retold(exc, "(where)")
        assert type(told) is type(exc) and str(told) == f"{exc}\n  (where)"
    told = retold(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), "(where)")
    assert type(told) is RuntimeError and str(told).startswith("UnicodeDecodeError: ")
