"""Runtime on forked gloo ranks: meta-device init, forward-only outputs, sharded inputs,
checkpoints across meshes, and errors raised on every rank."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autopar
from autopar.rules.strategy import is_strided, shard_dim
from autopar.runtime import checkpoint
from autopar.runtime.parameters import initialize_like_compile
from autopar.runtime.forked import RankFailure, run_ranks
from examples import gpt
from tiny_models import PairwiseBatch


def _tokens(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (batch, 64), generator=gen)
    return tokens, torch.roll(tokens, -1, dims=1)


def _meta_init_rank(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, _, loss_fn, _ = gpt.build(device="meta")
    tokens, targets = _tokens()
    # Pinned TP, so that parameters are sharded (the free plan of this tiny model on the cpu
    # profile is plain data parallelism: every parameter replicated).
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, example_targets=(targets,),
                         constraints=gpt.TP_PLAN, pipeline=False)
    assert all(not p.is_meta for p in pm.parameters()) and all(p.is_meta for p in model.parameters())
    local = sum(p.numel() for p in pm.parameters())
    expected = sum(v.numel() // math.prod(n for p, n in zip(v.placements, mesh.shape) if shard_dim(p) is not None)
                   for v in pm.state_dict().values())  # strided shards (the fused qkv's S(0/3)) count
    loss = pm(tokens, targets).full_tensor().item()
    return {"local_numel": local, "expected_local": expected, "loss": loss,
            "full": {k: v.tolist() for k, v in checkpoint.full_state_dict(pm).items()}}


def test_meta_model_is_initialized_shard_by_shard_like_one_device() -> None:
    twin, _, loss_fn, _ = gpt.build(device="meta")
    initialize_like_compile(twin)
    tokens, targets = _tokens()
    ref_loss = loss_fn(twin(tokens), targets).item()
    results = run_ranks(_meta_init_rank, 4)
    total = sum(p.numel() for p in twin.parameters())
    for r in results:
        assert r["local_numel"] == r["expected_local"] < total  # only shards are kept
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-5)
    for key, value in twin.state_dict().items():
        assert torch.equal(torch.tensor(results[0]["full"][key]), value), key
    assert results[1]["full"] == {}  # the full state dict lands on rank 0 only


def _forward_only_rank(rank: int, world: int) -> list[float]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model, (tokens,), _, _ = gpt.build()
    pm = autopar.compile(model, mesh, (tokens,), train=False, pipeline=False)
    logits = pm(tokens)
    assert isinstance(logits, DTensor)
    return _bytes(logits.full_tensor())


def _bytes(t: torch.Tensor) -> tuple[list[int], bytes]:
    """A whole tensor as picklable (shape, fp32 bytes): ranks return results without tensors."""
    return list(t.shape), t.detach().to(torch.float32).contiguous().numpy().tobytes()


def _tensor(shape_and_bytes: tuple[list[int], bytes]) -> torch.Tensor:
    shape, raw = shape_and_bytes
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


def test_forward_only_outputs_are_dtensors_with_the_single_device_value() -> None:
    model, (tokens,), _, _ = gpt.build()
    expected = model(tokens).detach()
    for got in run_ranks(_forward_only_rank, 2):
        torch.testing.assert_close(_tensor(got), expected, rtol=1e-4, atol=1e-5)  # every logit


def _sharded_input_rank(rank: int, world: int) -> float:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, _, loss_fn, _ = gpt.build()
    tokens, targets = _tokens()
    half = slice(rank * 4, rank * 4 + 4)
    pm = autopar.compile(model, mesh, (tokens[half],), loss_fn=loss_fn, example_targets=(targets[half],),
                         input_sharded=True, pipeline=False)
    return pm(tokens[half], targets[half]).full_tensor().item()


def test_input_sharded_each_rank_passes_its_data_shard() -> None:
    model, _, loss_fn, _ = gpt.build()
    tokens, targets = _tokens()
    expected = loss_fn(model(tokens), targets).item()
    assert run_ranks(_sharded_input_rank, 2) == pytest.approx([expected] * 2, rel=1e-5)


def _mean_loss_rank(rank: int, world: int) -> dict[str, float]:
    """Batch-split 'mean' losses whose count needs no all-reduce: counted on the whole
    targets input (with ignored positions), or fixed by shapes (MSE)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, _, loss_fn, _ = gpt.build()
    tokens, targets = _tokens()
    targets = targets.clone()
    targets[:3, 5:] = -100  # rank 0's half of the batch has far fewer counted positions
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, example_targets=(targets,), data_axes=("dp",),
                         pipeline=False)
    torch.manual_seed(5)
    reg = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)), torch.zeros(8, 4)
    pm_reg = autopar.compile(reg, mesh, (x,), loss_fn=torch.nn.functional.mse_loss, example_targets=(y,),
                             data_axes=("dp",), pipeline=False)
    counts = [c for p in (pm, pm_reg) for c in p.plan.collectives if c.tensor.startswith(("cross", "mse"))]
    return {"ce": pm(tokens, targets).full_tensor().item(), "mse": pm_reg(x, y).full_tensor().item(),
            "count_collectives": len(counts)}


def test_mean_loss_counts_without_collectives_when_targets_are_whole() -> None:
    model, _, loss_fn, _ = gpt.build()
    tokens, targets = _tokens()
    targets = targets.clone()
    targets[:3, 5:] = -100
    torch.manual_seed(5)
    reg = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)), torch.zeros(8, 4)
    ce, mse = loss_fn(model(tokens), targets).item(), torch.nn.functional.mse_loss(reg(x), y).item()
    for r in run_ranks(_mean_loss_rank, 2):
        assert r["ce"] == pytest.approx(ce, rel=1e-5) and r["mse"] == pytest.approx(mse, rel=1e-5)
        assert r["count_collectives"] == 0


def _checkpoint_rank(rank: int, world: int, path: str, pinned: bool) -> dict[str, Any]:
    tokens, targets = _tokens()
    model, _, loss_fn, _ = gpt.build()
    mesh_2x2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = {"constraints": gpt.TP_PLAN} if pinned else {}
    pm = autopar.compile(model, mesh_2x2, (tokens,), loss_fn=loss_fn, example_targets=(targets,),
                         **{"pipeline": False, **tp})
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(tokens, targets).backward()
    opt.step()
    checkpoint.save(pm, path)
    saved = {k: v.full_tensor() for k, v in pm.state_dict().items()}
    fresh, _, _, _ = gpt.build(gpt.GPTConfig())  # same shapes, other values after training
    mesh_4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    other = autopar.compile(fresh, mesh_4, (tokens,), loss_fn=loss_fn, example_targets=(targets,),
                            **{"pipeline": False, **tp})
    strided = [k for k, v in [*pm.state_dict().items(), *other.state_dict().items()]
               if any(is_strided(p) for p in v.placements)]
    changed = [k for k, v in other.state_dict().items() if not torch.equal(v.full_tensor(), saved[k])]
    checkpoint.load(other, path)
    mismatched = [k for k, v in other.state_dict().items() if not torch.equal(v.full_tensor(), saved[k])]
    same_loss = other(tokens, targets).full_tensor().item() == pytest.approx(pm(tokens, targets).full_tensor().item(),
                                                                           rel=1e-5)
    return {"changed_before_load": len(changed), "mismatched_after_load": mismatched, "same_loss": same_loss,
            "strided": len(strided),
            "keys": sorted(pm.state_dict()) == sorted(model.state_dict())}


@pytest.mark.parametrize("pinned", [False, True], ids=["free", "tp-interleaved-qkv"])
def test_checkpoint_saved_on_one_mesh_loads_on_another(tmp_path: Path, pinned: bool) -> None:
    """Also with strided shards (the pinned TP plan's interleaved qkv) on both sides."""
    for r in run_ranks(_checkpoint_rank, 4, str(tmp_path / "ckpt"), pinned):
        assert (r["strided"] > 0) == pinned
        assert r["keys"], "state_dict keys are the original model's"
        assert r["changed_before_load"] > 0  # the test can fail: the two modules started different
        assert r["mismatched_after_load"] == []
        assert r["same_loss"]


def _wrong_mesh_rank(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    model, inputs, loss_fn, targets = gpt.build()
    with pytest.raises(autopar.CompileError, match="2 devices .* 4 ranks") as info:
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=False)
    return str(info.value)


def _rank_disagrees(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build(batch=8 if rank == 0 else 4)
    with pytest.raises(autopar.CompileError, match="planned differently") as info:
        autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=False)
    return str(info.value)


def _rank_fails(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()

    def broken_loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            raise RuntimeError("this rank's loss is broken")
        return loss_fn(logits, t)

    with pytest.raises(autopar.CaptureError, match="rank 1.*loss is broken") as info:  # the user's: its own type
        autopar.compile(model, mesh, inputs, loss_fn=broken_loss, example_targets=targets, pipeline=False)
    return str(info.value)


@pytest.mark.parametrize("scenario,world", [(_wrong_mesh_rank, 4), (_rank_disagrees, 2), (_rank_fails, 2)],
                         ids=["mesh-size-not-world-size", "ranks-plan-differently", "one-rank-fails"])
def test_errors_are_raised_on_every_rank(scenario: Any, world: int) -> None:
    messages = run_ranks(scenario, world)
    assert len(messages) == world and len(set(messages)) == 1  # every rank raised, and the same error


def _accumulate_rank(rank: int, world: int) -> dict[str, list[float]]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, _, loss_fn, _ = gpt.build()
    tokens, targets = _tokens()
    pm = autopar.compile(model, mesh, (tokens[:4],), loss_fn=loss_fn, example_targets=(targets[:4],),
                         data_axes=("dp",), pipeline=False)
    for micro in (slice(0, 4), slice(4, 8)):  # two micro-batches, one optimizer step
        pm(tokens[micro], targets[micro]).backward()
    state = pm.state_dict()
    return {k: _bytes(DTensor.from_local(p.grad, mesh, state[k].placements, run_check=False).full_tensor())
            for k, p in pm.named_parameters()}


def test_gradients_accumulate_over_several_backward_passes() -> None:
    model, _, loss_fn, _ = gpt.build()
    tokens, targets = _tokens()
    for micro in (slice(0, 4), slice(4, 8)):
        loss_fn(model(tokens[micro]), targets[micro]).backward()
    for got in run_ranks(_accumulate_rank, 2):
        assert sorted(got) == sorted(dict(model.named_parameters()))
        for name, p in model.named_parameters():
            torch.testing.assert_close(_tensor(got[name]), p.grad, rtol=1e-4, atol=1e-5)  # whole gradients


def _strided_batch_rank(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, x = PairwiseBatch(), torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.compile(model, mesh, (x,), data_axes=("dp",), pipeline=False)
    loss = pm(x)
    loss.backward()
    grads = {k: DTensor.from_local(p.grad, mesh, pm.state_dict()[k].placements).full_tensor().tolist()
             for k, p in pm.named_parameters()}
    return {"loss": loss.full_tensor().item(), "grads": grads,
            "input": [n.outputs[0] for n in pm.plan.nodes if n.op == "input"]}


def test_strided_batch_split_of_a_whole_input_matches_one_device() -> None:
    """The input sliced strided by the runtime (each rank a slice of both halves)."""
    torch.manual_seed(0)
    model, x = PairwiseBatch(), torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    loss = model(x)
    loss.backward()
    for r in run_ranks(_strided_batch_rank, 2):
        assert r["input"] == ["S(0/2)"]
        assert r["loss"] == pytest.approx(loss.item(), rel=1e-5)
        for k, p in model.named_parameters():
            torch.testing.assert_close(torch.tensor(r["grads"][k]), p.grad, rtol=1e-4, atol=1e-5)


def _killed_rank(rank: int, world: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a crash in C++ ends a rank: no report, no traceback
    return rank


def test_a_rank_killed_by_a_signal_fails_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 died without a report \(exit code -9\)"):
        run_ranks(_killed_rank, 2, timeout_s=30)
    assert time.monotonic() - start < 20  # not the 90 s the parent would wait for a report


_FORK_AFTER_THREADS = """
import torch
from autopar.runtime.forked import run_ranks

def rank(rank: int, world: int) -> float:
    return float(torch.tanh(torch.ones(1 << 20)).sum())  # a parallel op

torch.set_num_threads(2)
torch.tanh(torch.ones(1 << 20))  # the parent's OpenMP pool starts
print(run_ranks(rank, 2, timeout_s=10))
"""


def test_ranks_forked_after_the_parent_computed_on_threads_do_not_hang() -> None:
    """A rank using the OpenMP pool its parent started before the fork waits forever in its
    first parallel op (a pipelined step once seemed to hang in its first stage so); each rank
    computes on one thread instead. In a fresh interpreter: this session computes on one."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FORK_AFTER_THREADS], env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = (float(v) for v in done.stdout.strip().strip("[]").split(","))
    assert first == second == pytest.approx((1 << 20) * math.tanh(1.0), rel=1e-5)


def _gathers_in_flight(rank: int, world: int) -> list[int]:
    """Unwaited collectives after each of three launched all-gathers and after finishing them."""
    from torch._C._distributed_c10d import _get_work_registry_size

    from autopar.runtime.ops import Comm, _steps

    comm = Comm(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    steps = _steps("S(0)", "R")
    pending, in_flight = [], []
    for size in (64, 256, 1024):
        pending.append(comm.launch(torch.full((size,), float(rank)), steps, "forward"))
        in_flight.append(_get_work_registry_size())
    gathered = [comm.finish(p, "forward") for p in pending]
    in_flight.append(_get_work_registry_size())
    assert all(g.shape == (world * n,) and g[n:].eq(1).all() for g, n in zip(gathered, (64, 256, 1024)))
    return in_flight


def test_a_cpu_mesh_runs_one_all_gather_at_a_time() -> None:
    """gloo corrupts the heap when two all-gathers run at once (``runtime.ops``): a gather
    launched ahead is waited for before the next one is issued."""
    assert run_ranks(_gathers_in_flight, 2) == [[1, 1, 1, 0]] * 2
