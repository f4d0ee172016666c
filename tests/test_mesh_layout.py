"""Meshes whose axes the planner lays out (``search.layout``): ``Mesh(devices=N)`` planned on every
layout of its devices (one axis, or dp x tp with tp inside a node), the depth searched on each, the
fastest kept; ``compile`` on a 1-D DeviceMesh without names reshapes its ranks for the chosen axes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime.forked import run_ranks
from autopar.search.layout import layouts
from examples import gpt

LR, EPS, STEPS = 1e-2, 1e-6, 2


def test_layouts_put_tp_inside_a_node() -> None:
    axes = [m.axes for m in layouts(autopar.Mesh(devices=512, hardware="h100", devices_per_node=8))]
    assert axes == [{"dp": 512}, {"dp": 256, "tp": 2}, {"dp": 128, "tp": 4}, {"dp": 64, "tp": 8}]
    assert [m.axes for m in layouts(autopar.Mesh(devices=12, devices_per_node=8))] == \
        [{"dp": 12}, {"dp": 6, "tp": 2}, {"dp": 3, "tp": 4}]
    assert [m.axes for m in layouts(autopar.Mesh(devices=2))] == [{"dp": 2}]  # tp=2 is the one axis again
    assert all(not m.open and m.hardware.name == "h100" for m in layouts(autopar.Mesh(devices=16)))


def test_an_open_mesh_says_so() -> None:
    mesh = autopar.Mesh(devices=64)
    assert mesh.open and mesh.size == 64 and mesh.describe() == "64 devices, axes open"
    assert mesh != autopar.Mesh({"dp": 64}) and mesh.to_json()["open"] is True
    with pytest.raises(autopar.InputError, match="not both"):
        autopar.Mesh({"dp": 2}, devices=2)
    with pytest.raises(autopar.InputError, match="number of devices"):
        autopar.Mesh()
    with pytest.raises(autopar.InputError, match="positive int"):
        autopar.Mesh(devices=0)


def _plan(mesh: autopar.Mesh, **options: Any) -> autopar.Plan:
    model, inputs, loss_fn, targets = gpt.build()
    return autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **options)


def test_the_fastest_layout_is_chosen_and_each_is_noted() -> None:
    """Every layout is planned as a mesh with those axes would be (the depth searched on each); the
    chosen plan is the fastest of them, ties to the first."""
    plan = _plan(autopar.Mesh(devices=4, hardware="h100"))
    by_layout = {str(axes): _plan(autopar.Mesh(axes, "h100")) for axes in ({"dp": 4}, {"dp": 2, "tp": 2})}
    best = min(by_layout.values(), key=lambda p: p.predicted.step_time_s)
    assert plan.plan_hash() == best.plan_hash() and plan.mesh == best.mesh
    note = plan.notes[-1]
    assert note.startswith("mesh layout search: 2 layouts of 4 devices tried, chosen ")
    assert "dp=4 " in note and "dp=2 x tp=2 " in note
    assert [r.item for r in plan.account if r.level == "layout" and r.outcome == "planned"] == \
        ["dp=4", "dp=2 x tp=2"]


@pytest.mark.parametrize("option", [{"data_axes": ("dp",)}, {"zero": {"dp": 3}}, {"context_axes": ("dp",)},
                                    {"pipeline": autopar.Pipeline(axis="pp")}])
def test_options_naming_axes_are_refused_on_an_open_mesh(option: dict[str, Any]) -> None:
    with pytest.raises(autopar.InputError, match=f"{next(iter(option))} names mesh axes, and the mesh "
                                                 r"\(4 devices, axes open\) leaves its axes to the planner"):
        _plan(autopar.Mesh(devices=4, hardware="cpu"), **option)


def test_nothing_fitting_says_why_for_each_layout() -> None:
    """On a stack of linears: the example GPT's memory search, every layout's every depth failing, took 9 s."""
    model, x, y = _step()
    with pytest.raises(autopar.MemoryLimitError, match=r"no layout of 4 devices gives a plan that fits: dp=4: .*; "
                                                       r"dp=2 x tp=2: "):
        autopar.plan(model, autopar.Mesh(devices=4, hardware="cpu"), (x,), loss_fn=nn.functional.mse_loss,
                     example_targets=(y,), memory_limit=64)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _step() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _Stack(), torch.randn(8, 16), torch.randn(8, 8)


def _single_device() -> list[float]:
    model, x, y = _step()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train_open(rank: int, world: int, given: str) -> dict[str, Any]:
    model, x, y = _step()
    mesh = init_device_mesh("cpu", (world,)) if given == "device mesh" else world  # no names: the axes are the planner's
    pm = autopar.compile(model, mesh, (x,), loss_fn=nn.functional.mse_loss, example_targets=(y,))
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        loss = pm.step(x, y)
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return {"plan": pm.plan.plan_hash(), "axes": pm.plan.mesh["axes"], "names": pm.device_mesh.mesh_dim_names,
            "losses": losses}


@pytest.mark.ranks
@pytest.mark.parametrize("given", ["device mesh", "world size"])
def test_compile_lays_an_unnamed_mesh_out_as_planned(given: str) -> None:
    """Every rank runs the plan ``plan`` makes for ``Mesh(devices=4)``, on the device mesh (given 1-D without
    names, or as the world size) reshaped for its axes, and trains to the single-device numbers."""
    model, x, y = _step()
    planned = autopar.plan(model, autopar.Mesh(devices=4, hardware="cpu"), (x,), loss_fn=nn.functional.mse_loss,
                           example_targets=(y,))
    expected = _single_device()
    for result in run_ranks(_train_open, 4, given):
        assert result["plan"] == planned.plan_hash() and result["axes"] == planned.mesh["axes"]
        assert result["names"] == tuple(planned.mesh["axes"])
        assert result["losses"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
