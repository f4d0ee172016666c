"""Checkpoints of pipelined modules, across pipelined and non-pipelined meshes: 2 AdamW steps
on one mesh, ``checkpoint.save``, ``checkpoint.load`` on another (or ``load_single_device``
in this process), 1 more step; parameters and AdamW state equal the uninterrupted run and
the single-device one. Each pipeline rank writes only its own stages' tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime import checkpoint
from autopar.runtime.forked import run_ranks
from examples import gpt, llama
from numerics_harness import EPS, LR, Packed, mismatches, pack, reference, unpack

SAVED_STEPS = 2
PIPELINE = autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=2)
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...], dict[str, Any]]] = {
    "pp2xdp2": ((2, 2), ("pp", "dp"), {"data_axes": ("dp",), "pipeline": PIPELINE}),
    "pp2xtp2": ((2, 2), ("pp", "tp"), {"constraints": llama.TP_PLAN, "pipeline": PIPELINE}),
    "tp2": ((2,), ("tp",), {"constraints": llama.TP_PLAN, "pipeline": False}),
    "pp4": ((4,), ("pp",), {"pipeline": autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=4)}),
}
"""Meshes by name: shape, axis names and what ``autopar.compile`` pins there."""


def _llama() -> Any:
    return llama.build(llama.LlamaConfig(layers=4))


def _compile(name: str) -> tuple[checkpoint.Compiled, tuple[torch.Tensor, ...]]:
    shape, names, options = MESHES[name]
    model, inputs, loss_fn, targets = _llama()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **options)
    return pm, (*inputs, *targets)


def _train(pm: checkpoint.Compiled, opt: torch.optim.Optimizer, args: tuple[torch.Tensor, ...], steps: int) -> None:
    for _ in range(steps):
        pm.step(*args)  # a ParallelModule's step too: forward and backward of the whole batch
        opt.step()
        opt.zero_grad()


def _whole(pm: checkpoint.Compiled, local: dict[str, torch.Tensor]) -> dict[str, Packed]:
    """This rank's tensors ``local`` (FQN -> local shard, laid out as ``pm.state_dict()``) as
    whole tensors, gathered over the mesh their DTensors live on (every rank calls)."""
    layout = pm.state_dict()
    return {k: pack(DTensor.from_local(t, layout[k].device_mesh, layout[k].placements, run_check=False).full_tensor())
            for k, t in local.items()}


def _exp_avgs(pm: checkpoint.Compiled, opt: torch.optim.Optimizer) -> dict[str, Packed]:
    return _whole(pm, {k: opt.state[p]["exp_avg"] for k, p in pm.named_parameters()})


def _params(pm: checkpoint.Compiled) -> dict[str, Packed]:
    return _whole(pm, {k: v.to_local() for k, v in pm.state_dict().items()})


def _save_rank(rank: int, world: int, mesh: str, path: str) -> dict[str, Any]:
    pm, args = _compile(mesh)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    _train(pm, opt, args, SAVED_STEPS)
    checkpoint.save(pm, path, opt)
    exp_avg = _exp_avgs(pm, opt)
    refused = ""
    try:
        checkpoint.full_state_dict(pm)  # gathers a ParallelModule; a pipelined one's rank 0 has one stage
    except autopar.InputError as exc:
        refused = str(exc)
    _train(pm, opt, args, 1)  # the uninterrupted run's next step
    return {"exp_avg": exp_avg, "params": _params(pm), "held": sorted(pm.state_dict()), "refused": refused}


def _resume_rank(rank: int, world: int, mesh: str, path: str) -> dict[str, Any]:
    pm, args = _compile(mesh)
    opt = pm.optimizer(torch.optim.AdamW, lr=7 * LR, eps=EPS)  # no state yet; lr: the checkpoint's wins
    checkpoint.load(pm, path, opt)
    exp_avg = _exp_avgs(pm, opt)
    steps = sorted({float(s["step"]) for s in opt.state.values()})
    lrs = sorted({g["lr"] for g in opt.param_groups})
    _train(pm, opt, args, 1)
    return {"exp_avg": exp_avg, "params": _params(pm), "steps": steps, "lrs": lrs, "rank": dist.get_rank()}


def _merged(results: list[dict[str, Any]], key: str) -> dict[str, Packed]:
    """The ranks' whole tensors together (each pipeline rank holds its stages')."""
    out: dict[str, Packed] = {}
    for r in results:
        for k, v in r[key].items():
            assert out.setdefault(k, v) == v, f"{k}: ranks holding it differ"
    return out


def _check_resumed(resumed: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    single_device = reference(_llama, steps=SAVED_STEPS + 1).state
    uninterrupted = {k: unpack(v) for k, v in _merged(saved, "params").items()}
    assert sorted(uninterrupted) == sorted(single_device)  # the pipeline ranks together hold every tensor
    assert mismatches(single_device, uninterrupted) == []  # the baseline itself is right
    for r in resumed:
        assert r["steps"] == [float(SAVED_STEPS)] and r["lrs"] == [LR], r  # Adam's step and lr: the checkpoint's
    assert _merged(resumed, "exp_avg") == _merged(saved, "exp_avg")  # bit for bit, every parameter's
    got = {k: unpack(v) for k, v in _merged(resumed, "params").items()}
    assert mismatches(uninterrupted, got) == [], "differs from the uninterrupted run"
    assert mismatches(single_device, got) == [], "differs from the single-device run"


def _written_by_rank(path: str) -> dict[int, set[str]]:
    """Checkpoint file of each rank (``__{rank}_{save_id}_0.distcp``) -> the model keys it holds."""
    out: dict[int, set[str]] = {}
    for index, info in FileSystemReader(path).read_metadata().storage_data.items():
        rank = int(info.relative_path.split("_")[2])
        if not index.fqn.startswith(checkpoint.OPTIMIZER):
            out.setdefault(rank, set()).add(index.fqn)
    return out


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    """A checkpoint saved on pp=2 x dp=2 after 2 steps (its path), and the saving ranks' results."""
    path = str(tmp_path_factory.mktemp("pipelined") / "ckpt")
    return path, run_ranks(_save_rank, 4, "pp2xdp2", path)


def test_pipelined_checkpoint_layout(pipelined: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Each rank wrote its stages' tensors only; the optimizer's groups name every parameter;
    ``full_state_dict`` (one mesh's gather) refuses a pipelined module."""
    path, saved = pipelined
    assert all("load_single_device" in r["refused"] for r in saved), saved[0]["refused"]
    for rank, keys in _written_by_rank(path).items():
        assert keys <= set(saved[rank]["held"]), f"rank {rank} wrote {sorted(keys - set(saved[rank]['held']))}"
    assert {k for r in saved[:2] for k in r["held"]}.isdisjoint(saved[2]["held"])  # pp rank 0 vs pp rank 1
    dcp_to_torch_save(path, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model = _llama()[0]
    assert sorted(k for k in state if k != checkpoint.OPTIMIZER) == sorted(model.state_dict())
    groups = state[checkpoint.OPTIMIZER]["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(dict(model.named_parameters()))]


def test_pipelined_checkpoint_resumes_without_pipeline(pipelined: tuple[str, list[dict[str, Any]]]) -> None:
    """pp=2 x dp=2 -> tp=2, and -> one process without autopar."""
    path, saved = pipelined
    _check_resumed(run_ranks(_resume_rank, 2, "tp2", path), saved)

    assert not dist.is_initialized()
    model, inputs, loss_fn, targets = _llama()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the checkpoint's values, or the step below differs
    opt = torch.optim.AdamW(model.parameters(), lr=7 * LR, eps=EPS)
    checkpoint.load_single_device(model, path, opt)
    exp_avg = {k: pack(opt.state[p]["exp_avg"]) for k, p in model.named_parameters()}
    _train_single(model, opt, inputs, loss_fn, targets)
    params = {k: pack(v) for k, v in model.state_dict().items()}
    _check_resumed([{"exp_avg": exp_avg, "params": params, "steps": [float(SAVED_STEPS)], "lrs": [LR]}], saved)


def test_pipelined_checkpoint_resumes_on_other_stages(pipelined: tuple[str, list[dict[str, Any]]]) -> None:
    """pp=2 x dp=2 -> pp=4: ranks 2 and 3 hold stages whose parameters no saving rank held alone."""
    path, saved = pipelined
    _check_resumed(run_ranks(_resume_rank, 4, "pp4", path), saved)


def _train_single(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...],
                  loss_fn: Any, targets: tuple[torch.Tensor, ...]) -> None:
    loss_fn(model(*inputs), *targets).backward()
    opt.step()
    opt.zero_grad()


def test_checkpoint_resumes_pipelined(tmp_path: Path) -> None:
    """tp=2 (no pipeline) -> pp=2 x tp=2: each pipeline rank reads its own stages' shards."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_rank, 2, "tp2", path)
    model_keys = {k for k in FileSystemReader(path).read_metadata().state_dict_metadata
                  if not k.startswith(checkpoint.OPTIMIZER)}
    assert model_keys == set(_llama()[0].state_dict())  # the rotary tables are not (non-persistent buffers)
    _check_resumed(run_ranks(_resume_rank, 4, "pp2xtp2", path), saved)


def _tied_gpt() -> Any:
    """A small GPT whose output head is its embedding table (``lm_head.weight`` is ``wte.weight``)."""
    model, inputs, loss_fn, targets = gpt.build(gpt.GPTConfig(vocab_size=64, max_seq_len=16, hidden=32, heads=2))
    model.lm_head.weight = model.wte.weight
    return model, inputs, loss_fn, targets


def _save_tied_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    model, inputs, loss_fn, targets = _tied_gpt()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=PIPELINE)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    _train(pm, opt, (*inputs, *targets), SAVED_STEPS)
    checkpoint.save(pm, path, opt)
    return {"held": sorted(pm.state_dict())}


def test_pipelined_tied_weight_checkpoint(tmp_path: Path) -> None:
    """A weight tied between the first and the last stage (both pp ranks hold it) is saved under
    both of its names, as the model's ``state_dict()`` has them, so one process loads it into the
    tied model and resumes on the single-device numbers."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_tied_rank, 2, path)
    assert all({"wte.weight", "lm_head.weight"} <= set(r["held"]) for r in saved), saved
    assert not dist.is_initialized()
    model, inputs, loss_fn, targets = _tied_gpt()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    checkpoint.load_single_device(model, path, opt)
    assert model.lm_head.weight is model.wte.weight
    _train_single(model, opt, inputs, loss_fn, targets)
    assert mismatches(reference(_tied_gpt, steps=SAVED_STEPS + 1).state, model.state_dict()) == []
