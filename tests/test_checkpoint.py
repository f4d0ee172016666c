"""Checkpoints with the optimizer, across meshes: 2 AdamW steps on one mesh, save, load on
another mesh (or into a plain module in this process), 1 more step; the parameters equal
the uninterrupted 3-step run on the saving mesh and on one device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

import autopar
from autopar.rules.strategy import is_strided
from autopar.runtime import checkpoint
from autopar.runtime.forked import run_ranks
from examples import gpt
from numerics_harness import EPS, LR, Packed, compile_gpt, mismatches, pack, reference, unpack

QKV = "blocks.0.attn.qkv.weight"  # strided (S(0/3)) under the pinned TP plan


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor,
           steps: int, loss_fn: Any = None) -> None:
    for _ in range(steps):
        loss = model(tokens, targets) if loss_fn is None else loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _full(pm: autopar.ParallelModule) -> dict[str, Packed]:
    """Whole parameters and buffers (every rank gathers; rank 0's copy is enough to return)."""
    full = {k: pack(v.full_tensor()) for k, v in pm.state_dict().items()}
    return full if dist.get_rank() == 0 else {}


def _full_exp_avg(pm: autopar.ParallelModule, opt: torch.optim.Optimizer, fqn: str) -> Packed:
    placements = pm.state_dict()[fqn].placements
    local = opt.state[pm.get_parameter(fqn)]["exp_avg"]
    return pack(DTensor.from_local(local, pm.device_mesh, placements, run_check=False).full_tensor())


def _save_rank(rank: int, world: int, mesh_spec: str, path: str) -> dict[str, Any]:
    pm, tokens, targets = compile_gpt(mesh_spec)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    _train(pm, opt, tokens, targets, 2)
    checkpoint.save(pm, path, opt)
    saved_exp_avg = _full_exp_avg(pm, opt, QKV)
    _train(pm, opt, tokens, targets, 1)  # the uninterrupted run's third step
    return {"state": _full(pm), "exp_avg": saved_exp_avg, "strided": _strided(pm)}


def _resume_rank(rank: int, world: int, mesh_spec: str, path: str) -> dict[str, Any]:
    pm, tokens, targets = compile_gpt(mesh_spec)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)  # no state yet: load creates it
    checkpoint.load(pm, path, opt)
    loaded_exp_avg = _full_exp_avg(pm, opt, QKV)
    steps = {float(s["step"]) for s in opt.state.values()}
    _train(pm, opt, tokens, targets, 1)
    return {"state": _full(pm), "exp_avg": loaded_exp_avg, "steps": sorted(steps), "strided": _strided(pm)}


def _strided(pm: autopar.ParallelModule) -> int:
    return sum(any(is_strided(p) for p in v.placements) for v in pm.state_dict().values())


def _tensors(state: dict[str, Packed]) -> dict[str, torch.Tensor]:
    return {k: unpack(v) for k, v in state.items()}


def _check_resumed(got: dict[str, torch.Tensor], uninterrupted: dict[str, torch.Tensor],
                   single_device: dict[str, torch.Tensor]) -> None:
    assert mismatches(uninterrupted, got) == [], "differs from the uninterrupted run on the saving mesh"
    assert mismatches(single_device, got) == [], "differs from the uninterrupted single-device run"


@pytest.mark.parametrize("saved_on,loaded_on", [("2x2", "4"), ("4", "2x2")], ids=["2x2-to-4", "4-to-2x2"])
def test_optimizer_state_round_trips_across_meshes(tmp_path: Path, saved_on: str, loaded_on: str) -> None:
    single_device = reference(gpt.build, steps=3).state
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_rank, 4, saved_on, path)[0]
    uninterrupted = _tensors(saved["state"])
    assert mismatches(single_device, uninterrupted) == []  # the baseline itself is right
    strided_side = saved if saved_on == "2x2" else None
    resumed = run_ranks(_resume_rank, 4, loaded_on, path)
    for r in resumed:
        assert r["steps"] == [2.0]  # Adam's step counter came from the checkpoint
        assert r["exp_avg"] == saved["exp_avg"]  # bit for bit, through the strided <-> plain conversion
        strided_side = strided_side or r
    _check_resumed(_tensors(resumed[0]["state"]), uninterrupted, single_device)
    assert strided_side is not None and strided_side["strided"] > 0  # the 2x2 side has strided shards

    if saved_on == "2x2":  # also into one process, without autopar or a process group
        _resume_single_device(path, saved, uninterrupted, single_device)


def _resume_single_device(path: str, saved: dict[str, Any], uninterrupted: dict[str, torch.Tensor],
                          single_device: dict[str, torch.Tensor]) -> None:
    assert not dist.is_initialized()
    model, (tokens,), loss_fn, (targets,) = gpt.build(gpt.GPTConfig())  # other values: overwritten by the load
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    loss_fn(model(tokens), targets).backward()  # gradients before the optimizer's first step: still loads
    checkpoint.load_single_device(model, path, opt)
    assert all(p.grad is not None for p in model.parameters())  # and they are left as they were
    opt.zero_grad()
    assert pack(opt.state[model.get_parameter(QKV)]["exp_avg"]) == saved["exp_avg"]
    _train(model, opt, tokens, targets, 1, loss_fn)
    _check_resumed(dict(model.state_dict()), uninterrupted, single_device)


def test_checkpoint_converts_to_one_torch_save_file(tmp_path: Path) -> None:
    """DCP's ``dcp_to_torch_save`` turns the checkpoint into one file a plain script loads."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_rank, 4, "2x2", path)[0]
    dcp_to_torch_save(path, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model, (tokens,), loss_fn, (targets,) = gpt.build(gpt.GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    model.load_state_dict({k: v for k, v in state.items() if k != checkpoint.OPTIMIZER})
    set_optimizer_state_dict(model, opt, state[checkpoint.OPTIMIZER])
    _train(model, opt, tokens, targets, 1, loss_fn)
    single_device = reference(gpt.build, steps=3).state
    _check_resumed(dict(model.state_dict()), _tensors(saved["state"]), single_device)


def _tied_gpt() -> tuple[Any, ...]:
    model, inputs, loss_fn, targets = gpt.build()
    model.lm_head.weight = model.wte.weight  # GPT-2's tie: one parameter, two keys
    return model, inputs, loss_fn, targets


def _save_tied_rank(rank: int, world: int, path: str) -> None:
    model, (tokens,), loss_fn, (targets,) = _tied_gpt()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, example_targets=(targets,),
                         constraints={**gpt.TP_PLAN, "lm_head": ColwiseParallel()}, pipeline=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    _train(pm, opt, tokens, targets, 2)
    checkpoint.save(pm, path, opt)


def test_tied_parameter_resumes_on_one_device(tmp_path: Path) -> None:
    """The optimizer's state of a tied parameter is keyed by the name the plain model reports."""
    path = str(tmp_path / "ckpt")
    run_ranks(_save_tied_rank, 2, path)
    model, (tokens,), loss_fn, (targets,) = _tied_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    checkpoint.load_single_device(model, path, opt)
    assert model.lm_head.weight is model.wte.weight
    _train(model, opt, tokens, targets, 1, loss_fn)
    assert mismatches(reference(_tied_gpt, steps=3).state, dict(model.state_dict())) == []
