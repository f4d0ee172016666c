"""Golden per-rank programs: ``print(pm.program.code)`` for the examples.

Built under a fake process group (no processes); the code is the same on every rank.
Refresh with ``AUTOPAR_UPDATE_GOLDEN=1`` and review the diff like code.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar.api.planning import plan_step
from autopar.runtime.build import build_rank_module
from examples import gpt, llama

GOLDEN = Path(__file__).parent / "golden"
MODELS = {"gpt": gpt.build, "llama": llama.build}
MESHES = {"dp2": ((2,), ("dp",)), "dp2xtp2": ((2, 2), ("dp", "tp"))}


CASES = [(model, mesh, "free") for model in MODELS for mesh in MESHES] + [("gpt", "dp2xtp2", "tp")]
PLANS = {"free": {}, "tp": {"constraints": gpt.TP_PLAN, "data_axes": ("dp",)}}


@pytest.mark.parametrize(("model_name", "mesh_name", "plan_name"), CASES, ids=["-".join(c) for c in CASES])
def test_golden_rank_program(model_name: str, mesh_name: str, plan_name: str) -> None:
    """``tp``: the hand Megatron plan; its fused qkv runs interleaved (``S(2/3)``), so the
    attention between qkv and proj has no reshard."""
    shape, names = MESHES[mesh_name]
    dist.init_process_group("fake", rank=0, world_size=math.prod(shape), store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model, inputs, loss_fn, targets = MODELS[model_name]()
        step = plan_step(model, autopar.Mesh.from_device_mesh(mesh), inputs, loss_fn=loss_fn,
                         example_targets=targets, **PLANS[plan_name], pipeline=False)
        code = build_rank_module(model, mesh, step).program.code.strip() + "\n"
    finally:
        dist.destroy_process_group()
    assert "self.reshard(" in code
    suffix = "" if plan_name == "free" else f"_{plan_name}"
    path = GOLDEN / f"code_{model_name}_{mesh_name}{suffix}.py.txt"
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN") == "1":
        path.write_text(code)
    assert path.exists(), f"{path} missing: run with AUTOPAR_UPDATE_GOLDEN=1 and review it"
    assert code == path.read_text()
