"""Checkpoints that must not load wrong: a save that fails on one rank leaves the previous
checkpoint whole (never old and new shards together), a directory no save completed is
refused, and a checkpoint whose keys differ from the model's is refused by name unless
``strict=False``; on forked dp x tp ranks, every rank together, and in one process."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.runtime import checkpoint
from autopar.runtime.forked import run_ranks
from examples import gpt
from numerics_harness import EPS, LR, Packed, pack

FAILING_RANK = 1


def _compile(layers: int = 2) -> tuple[autopar.ParallelModule, torch.Tensor, torch.Tensor]:
    """The GPT example on dp=2 x tp=2 with Megatron TP pinned (sharded and strided parameters)."""
    model, (tokens,), loss_fn, (targets,) = gpt.build(gpt.GPTConfig(layers=layers))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, example_targets=(targets,),
                         constraints=gpt.TP_PLAN, pipeline=False)
    return pm, tokens, targets


def _train(pm: autopar.ParallelModule, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor,
           steps: int) -> None:
    for _ in range(steps):
        pm(tokens, targets).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(pm: autopar.ParallelModule, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of this rank's shards of every parameter, buffer and optimizer state tensor."""
    out = {k: v.to_local().detach().clone() for k, v in pm.state_dict().items()}
    for fqn, p in pm.named_parameters():
        out |= {f"{fqn}.{name}": t.detach().clone() for name, t in opt.state[p].items()}
    return out


def _differ(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in want if not torch.equal(want[k], got[k]))


def _whole(pm: autopar.ParallelModule) -> dict[str, Packed]:
    """Whole parameters and buffers (every rank gathers)."""
    return {k: pack(v.full_tensor()) for k, v in pm.state_dict().items()}


class _FillsUp:
    """A file stream on a disk with ``room`` bytes left: the write that overflows it writes what fits, then fails."""

    def __init__(self, stream: Any, room: int) -> None:
        self.stream, self.room = stream, room

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.room:
            self.stream.write(data[:self.room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _disk_full(fail: bool, room: int | None) -> contextlib.AbstractContextManager[Any]:
    """On a failing rank, DCP's file writer finds the disk full: when it opens its shard file
    (``room`` None), or once it has written ``room`` bytes of it."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Any:
        if room is None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        with real(self, path, mode) as stream:
            yield _FillsUp(stream, room)

    return mock.patch.object(FileSystem, "create_stream", create_stream) if fail else contextlib.nullcontext()


def _failed_save(pm: autopar.ParallelModule, path: str, opt: torch.optim.Optimizer, room: int | None = None) -> str:
    """``checkpoint.save`` with one rank's disk full: the error this rank got ("" if none)."""
    with _disk_full(dist.get_rank() == FAILING_RANK, room):
        try:
            checkpoint.save(pm, path, opt)
        except checkpoint.CheckpointError as exc:
            return str(exc)
    return ""


def _refusal(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except autopar.InputError as exc:
        return str(exc)
    return ""


def _overwrite_fails_rank(rank: int, world: int, path: str, fresh: str) -> dict[str, Any]:
    pm, tokens, targets = _compile()
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    _train(pm, opt, tokens, targets, 2)
    checkpoint.save(pm, path, opt)
    saved, whole = _snapshot(pm, opt), _whole(pm)
    _train(pm, opt, tokens, targets, 3)
    error = _failed_save(pm, path, opt)  # the step-5 save, over the step-2 one
    cut_short = _failed_save(pm, path, opt, room=4096)  # again, its shard file written in part
    checkpoint.load(pm, path, opt)
    loaded = _snapshot(pm, opt)
    steps = sorted({float(s["step"]) for s in opt.state.values()})
    fresh_error = _failed_save(pm, fresh, opt)  # no save completed there
    return {"error": error, "cut_short": cut_short, "differ": _differ(saved, loaded), "steps": steps, "whole": whole,
            "fresh_error": fresh_error, "refused": _refusal(checkpoint.load, pm, fresh, opt)}


def _referenced(path: Path) -> set[str]:
    return {info.relative_path for info in FileSystemReader(path).read_metadata().storage_data.values()}


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """Save at step 2, save again at step 5 with one rank's disk full: every rank gets the
    error, and the checkpoint still loads as the step-2 save, whole, on 4 ranks and on one
    device; a directory where no save completed, or one missing bytes, is refused."""
    path, fresh = tmp_path / "ckpt", tmp_path / "fresh"
    results = run_ranks(_overwrite_fails_rank, 4, str(path), str(fresh))
    for r in results:
        for error in (r["error"], r["cut_short"]):
            assert f"rank {FAILING_RANK}" in error and "No space left on device" in error, error
        assert r["differ"] == [], f"loaded as a mixture of two saves: {r['differ']}"
        assert r["steps"] == [2.0]
        assert "rank 1" in r["fresh_error"] and "no complete checkpoint" in r["refused"], r["refused"]
    assert sorted(os.listdir(path)) == sorted({".metadata"} | _referenced(path))  # the failed save's files: gone

    model, *_ = gpt.build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    checkpoint.load_single_device(model, path, opt)
    assert {k: pack(v) for k, v in model.state_dict().items()} == results[0]["whole"]
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}
    with pytest.raises(autopar.InputError, match="no complete checkpoint"):
        checkpoint.load_single_device(model, fresh)

    shard = path / sorted(_referenced(path))[-1]
    shard.write_bytes(shard.read_bytes()[:-1])  # one byte short, as a copy cut off
    with pytest.raises(autopar.InputError, match=f"{shard.name}.*bytes"):
        checkpoint.load_single_device(model, path)


def _smaller_and_larger_rank(rank: int, world: int, large_path: str, small_path: str) -> dict[str, Any]:
    large, tokens, targets = _compile(layers=2)
    large_opt = torch.optim.AdamW(large.parameters(), lr=LR, eps=EPS)
    _train(large, large_opt, tokens, targets, 1)  # its values differ from the small model's
    checkpoint.save(large, large_path, large_opt)
    small, *_ = _compile(layers=1)
    small_opt = torch.optim.AdamW(small.parameters(), lr=LR, eps=EPS)
    checkpoint.save(small, small_path, small_opt)
    large_saved, small_saved = _whole(large), _whole(small)
    out = {"into_small": _refusal(checkpoint.load, small, large_path, small_opt),
           "into_large": _refusal(checkpoint.load, large, small_path, large_opt)}
    checkpoint.load(small, large_path, small_opt, strict=False)
    out["small_loaded"] = _whole(small) == {k: large_saved[k] for k in small_saved}
    checkpoint.load(large, small_path, large_opt, strict=False)
    kept = {k: v for k, v in large_saved.items() if k not in small_saved}
    out["large_loaded"] = _whole(large) == {**large_saved, **small_saved} and bool(kept)
    return out


def test_checkpoint_keys_must_match_the_model(tmp_path: Path) -> None:
    """A 2-block checkpoint into a 1-block model (and the reverse) is refused, naming the
    block-1 keys, on 4 ranks together and on one device; ``strict=False`` loads the keys both
    hold and leaves the others as they were (a strided qkv too)."""
    large_path, small_path = str(tmp_path / "large"), str(tmp_path / "small")
    for r in run_ranks(_smaller_and_larger_rank, 4, large_path, small_path):
        assert "not in the model" in r["into_small"] and "blocks.1.attn.qkv.weight" in r["into_small"], r
        assert "optimizer.state.blocks.1." in r["into_small"], r["into_small"]
        assert "not in the checkpoint" in r["into_large"] and "blocks.1.mlp.fc.weight" in r["into_large"], r
        assert r["small_loaded"] and r["large_loaded"]

    small, *_ = gpt.build(gpt.GPTConfig(layers=1))
    with pytest.raises(autopar.InputError, match=r"not in the model.*blocks\.1\.ln_1\.weight"):
        checkpoint.load_single_device(small, large_path)
    large, *_ = gpt.build()
    with pytest.raises(autopar.InputError, match=r"not in the checkpoint.*blocks\.1\.ln_1\.weight"):
        checkpoint.load_single_device(large, small_path, torch.optim.AdamW(large.parameters()))
    checkpoint.load_single_device(small, large_path, strict=False)
