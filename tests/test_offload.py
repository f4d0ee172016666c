"""Optimizer state in host memory (``autopar.runtime.offload``) and its pricing
(``autopar.cost.offload``): an offloaded AdamW trains the GPT example on dp=2 to the same
bits as the plain optimizer (and to the single-device numbers), keeps its state in host
tensors of its own, round-trips through ``autopar.runtime.checkpoint``; the prices match
hand-computed figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.capture.graph import TensorMeta
from autopar.cost.model import CostContext, parameter_cost
from autopar.cost.offload import offloaded_parameter
from autopar.cost.precision import get_precision
from autopar.hardware import GB, PROFILES
from autopar.runtime import checkpoint
from autopar.runtime.forked import run_ranks
from autopar.runtime.offload import OffloadedOptimizer
from autopar.rules.strategy import parse_placements
from examples import gpt
from numerics_harness import EPS, LR, STEPS, check, mismatches, reference, run_compiled
from tiny_models import BigTable
from tests.planning import H100_STATE_ONCE, assert_one_price


def _compile() -> tuple[autopar.ParallelModule, tuple[torch.Tensor, torch.Tensor]]:
    model, (tokens,), loss_fn, (targets,) = gpt.build()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, example_targets=(targets,), pipeline=False)
    return pm, (tokens, targets)


def _train(pm: autopar.ParallelModule, opt: torch.optim.Optimizer, args: tuple[torch.Tensor, ...], steps: int) -> None:
    for _ in range(steps):
        pm(*args).backward()
        opt.step()
        opt.zero_grad()


def _local(pm: autopar.ParallelModule) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in pm.named_parameters()}


def _reset(pm: autopar.ParallelModule, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in pm.named_parameters():
            p.copy_(values[k])
            p.grad = None


def _unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


def _host_problems(pm: autopar.ParallelModule, opt: OffloadedOptimizer) -> list[str]:
    """Offloaded parameters whose state is not in host tensors of their own."""
    problems = []
    for fqn, p in pm.named_parameters():
        master = opt.host_copy(p)
        if master is None:
            continue
        own = {t.untyped_storage().data_ptr() for t in (p, p.grad) if t is not None}
        state = [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim()]
        if master.untyped_storage().data_ptr() in own or master.device.type != "cpu":
            problems.append(f"{fqn}: master copy")
        if not state or any(v.untyped_storage().data_ptr() in own or v.device.type != "cpu" for v in state):
            problems.append(f"{fqn}: state")
        if any(v is not w for v, w in zip(opt.state[p].values(), opt.inner.state[master].values())):
            problems.append(f"{fqn}: state differs from the wrapped optimizer's")
    return problems


def _numerics_rank(rank: int, world: int) -> dict[str, Any]:
    pm, args = _compile()
    start = _local(pm)
    plain = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    _train(pm, plain, args, STEPS)
    want = _local(pm)
    runs: dict[str, list[str]] = {}
    names = [k for k, _ in pm.named_parameters()]
    offloads = {"all": names, "some": [k for k in names if k.startswith("blocks.0.")], "plan": None}
    hosted: dict[str, list[str]] = {}
    for label, offload in offloads.items():
        _reset(pm, start)
        opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS, offload=offload)
        _train(pm, opt, args, STEPS)
        runs[label] = _unequal(want, _local(pm))
        hosted[label] = [k for k, p in pm.named_parameters() if opt.host_copy(p) is not None]
        if label == "some":
            problems = _host_problems(pm, opt)
    state = pm.state_dict()
    full = {k: v.full_tensor() for k, v in state.items()}
    return {"runs": runs, "hosted": hosted, "names": names, "problems": problems,
            "plan_offload": pm.plan.memory.offload, "full": {k: v.tolist() for k, v in full.items()}}


def test_offloaded_adamw_equals_plain_on_dp2() -> None:
    """Every parameter offloaded, some, or the plan's (none): the parameters after 3 steps
    are the plain AdamW's, bit for bit, on both ranks, and the single device's."""
    ref = reference(gpt.build, steps=STEPS)
    results = run_ranks(_numerics_rank, 2)
    for rank, r in enumerate(results):
        assert r["runs"] == {"all": [], "some": [], "plan": []}, f"rank {rank}"
        assert r["hosted"]["all"] == r["names"] and r["hosted"]["plan"] == r["plan_offload"] == []
        assert r["hosted"]["some"] and all(k.startswith("blocks.0.") for k in r["hosted"]["some"])
        assert r["problems"] == [], f"rank {rank}"
    got = {k: torch.tensor(v) for k, v in results[0]["full"].items()}
    assert mismatches(ref.state, got) == []


def _checkpoint_rank(rank: int, world: int, path: str) -> dict[str, Any]:
    pm, args = _compile()
    names = [k for k, _ in pm.named_parameters()]
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS, offload=names)
    _train(pm, opt, args, 2)
    checkpoint.save(pm, path, opt)
    _train(pm, opt, args, 1)
    uninterrupted = _local(pm)
    resumed = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS, offload=names)  # masters: the 3-step weights
    checkpoint.load(pm, path, resumed)  # module and state back to step 2; masters follow the module
    steps = sorted({float(s["step"]) for s in resumed.state.values()})
    problems = _host_problems(pm, resumed)
    _train(pm, resumed, args, 1)
    offloaded_to_offloaded = _unequal(uninterrupted, _local(pm))
    plain = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)  # the same checkpoint, no offload
    checkpoint.load(pm, path, plain)
    _train(pm, plain, args, 1)
    return {"steps": steps, "problems": problems, "offloaded": offloaded_to_offloaded,
            "plain": _unequal(uninterrupted, _local(pm))}


def test_offloaded_optimizer_checkpoint_round_trip(tmp_path: Path) -> None:
    """Saved after 2 offloaded steps, loaded into a fresh offloaded optimizer (and into a
    plain one): one more step gives the uninterrupted run's parameters, bit for bit."""
    for rank, r in enumerate(run_ranks(_checkpoint_rank, 2, str(tmp_path / "ckpt"))):
        assert r["steps"] == [2.0], f"rank {rank}"
        assert r["problems"] == [], f"rank {rank}"
        assert r["offloaded"] == [] and r["plain"] == [], f"rank {rank}"


def test_offloaded_bf16_keeps_fp32_master_and_follows_lr_scheduler() -> None:
    """A bf16 parameter's host master and Adam state are fp32 (ZeRO-Offload's scheme), its
    device copy is the master rounded; hyperparameters set on the wrapper reach the host."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8).to(torch.bfloat16)
    opt = OffloadedOptimizer(layer.parameters(), torch.optim.AdamW, offload=list(layer.parameters()), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(2):
        layer(torch.randn(4, 8, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    master = opt.host_copy(layer.weight)
    assert master is not None and master.dtype == torch.float32
    assert opt.state[layer.weight]["exp_avg"].dtype == torch.float32
    assert torch.equal(layer.weight.detach(), master.detach().to(torch.bfloat16))
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(5e-3)  # synced at the second step
    assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(2.5e-3)


# ---- pricing -----------------------------------------------------------------------------

def _ctx(hardware: str, shape: dict[str, int], precision: str) -> CostContext:
    return CostContext(mesh=autopar.Mesh(shape, hardware=hardware), precision=get_precision(precision), train=True)


def test_offloaded_parameter_price_h100_bf16() -> None:
    """A 1024 x 1024 weight sharded on dp=2 (524,288 elements per device), mixed bf16 on H100:
    the registered parameter is the fp32 master (the program computes with bf16 casts), so the
    device keeps fp32 weights and gradient and the copies move fp32."""
    ctx = _ctx("h100", {"dp": 2}, "bf16")
    meta = TensorMeta(shape=(1024, 1024), dtype=torch.bfloat16)
    placements = parse_placements("S(0)")
    cost = offloaded_parameter(meta, placements, ctx.mesh, ctx.precision)
    n, hw = 524_288, PROFILES["h100"]
    assert cost.device_bytes == n * 8  # fp32 weights 4 + gradient 4
    assert cost.host_bytes == n * (12 + 4)  # master, m, v; fp32 gradient; no staging
    # 2 x 2 MiB over 50 GB/s, two copy_ calls of 10 us
    assert cost.transfer_s == pytest.approx(2 * n * 4 / (50 * GB) + 2 * 10e-6)
    # 28 B of fp32 Adam per element at 30.7 GB/s, 64 us per tensor
    assert cost.update_s == pytest.approx(n * 28 / (30.7 * GB) + 64e-6)
    assert hw.host_link_bandwidth == 50 * GB
    node = parameter_cost(meta, placements, ctx, offloaded=True)
    assert (node.time, node.memory) == (pytest.approx(cost.time_s), cost.device_bytes)
    kept = parameter_cost(meta, placements, ctx)
    assert kept.memory == n * 16 and node.memory == kept.memory / 2


def test_offloaded_parameter_price_cpu_fp32() -> None:
    """fp32 on the cpu profile: no casts, no staging; 1,000 elements replicated."""
    ctx = _ctx("cpu", {"dp": 2}, "fp32")
    meta = TensorMeta(shape=(10, 100), dtype=torch.float32)
    cost = offloaded_parameter(meta, parse_placements("R"), ctx.mesh, ctx.precision)
    assert cost.device_bytes == 8000 and cost.host_bytes == 16000
    assert cost.transfer_s == pytest.approx(2 * (4000 / (5 * GB) + 17.5e-6))
    assert cost.update_s == pytest.approx(28_000 / (1.8 * GB) + 64e-6)
    frozen = parameter_cost(meta, parse_placements("R"), ctx, trainable=False, offloaded=True)
    assert frozen.time == 0 and frozen.memory == 4000  # nothing to update, nothing offloaded


def test_every_profile_prices_the_host_link() -> None:
    for hw in PROFILES.values():
        assert hw.host_link_bandwidth > 0 and hw.host_memory_bandwidth > 0, hw.name
    assert PROFILES["a100"].host_link_bandwidth == 25 * GB
    assert PROFILES["h200"].host_link_bandwidth == PROFILES["h100"].host_link_bandwidth


def test_offload_is_chosen_per_parameter_where_the_limit_needs_it() -> None:
    """A 4096 x 64 table (E = 262,144 elements) beside 4,680 elements of linears, on dp=2
    h100s, fp32, ZeRO pinned to stage 0 (DDP: 16 bytes per element, weights, gradient, Adam m
    and v). Offloaded, a parameter keeps its weights and gradient alone on the device (8). A
    limit 2E bytes below DDP's peak needs the table's state on the host (saving 8E; all the
    linears' would save 37,440 bytes < 2E), and offloading costs time (the copies over PCIe
    and the host update), so the ILP offloads the table alone; pinned, every parameter."""
    torch.manual_seed(0)
    model, tokens, targets = BigTable(), torch.randint(0, 4096, (64, 32)), torch.randint(0, 8, (64,))
    mesh = autopar.Mesh({"dp": 2}, "h100")
    kwargs: dict[str, Any] = dict(loss_fn=torch.nn.functional.cross_entropy, example_targets=(targets,),
                                  data_axes=("dp",), precision="fp32", micro_batches=1, zero={"dp": 0})
    table, linears = 4096 * 64, 64 * 64 + 64 + 8 * 64 + 8
    ddp = autopar.plan(model, mesh, (tokens,), **kwargs)
    assert ddp.memory.offload == [] and ddp.predicted.parameter_memory_bytes == 16 * (table + linears)
    limit = ddp.predicted.peak_memory_bytes - 2 * table
    plan = autopar.plan(model, mesh, (tokens,), memory_limit=limit, **kwargs)
    assert plan.memory.offload == ["emb.weight"]
    assert "optimizer state of 1 of 5 parameters on the host" in plan.memory.describe()
    assert plan.predicted.parameter_memory_bytes == 16 * linears + 8 * table
    assert plan.predicted.memory_parts["optimizer state"] == 8 * linears
    assert plan.predicted.peak_memory_bytes == ddp.predicted.peak_memory_bytes - 8 * table <= limit
    assert_one_price(plan)
    everything = autopar.plan(model, mesh, (tokens,), offload=True, **kwargs)
    assert len(everything.memory.offload) == 5
    assert "optimizer state of 5 parameters on the host" in everything.memory.describe()
    assert ddp.predicted.step_time_s < plan.predicted.step_time_s < everything.predicted.step_time_s


def _big_table() -> tuple[nn.Module, tuple[torch.Tensor], Any, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model, tokens, targets = BigTable(), torch.randint(0, 4096, (64, 32)), torch.randint(0, 8, (64,))
    return model, (tokens,), torch.nn.functional.cross_entropy, (targets,)


MIXED: dict[str, Any] = dict(hardware="h100", precision="fp32", micro_batches=1, zero={"dp": 0}, data_axes=("dp",))


def _mixed_rank(rank: int, world: int, limit: float, ref: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = _big_table()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, memory_limit=limit,
                         **{"pipeline": False, **MIXED})
    return {**run_compiled(pm, (*inputs, *targets), ref), "offload": pm.plan.memory.offload}


def test_offload_per_parameter_matches_single_device() -> None:
    """The limit of ``test_offload_is_chosen_per_parameter_where_the_limit_needs_it``: the
    table's state steps on the host, the linears' on the device, together matching one
    device (loss, every gradient, parameters after 3 AdamW steps), executed == planned."""
    model, inputs, loss_fn, targets = _big_table()
    planning = {k: v for k, v in MIXED.items() if k != "hardware"}
    ddp = autopar.plan(model, autopar.Mesh({"dp": 2}, "h100"), inputs, loss_fn=loss_fn, example_targets=targets,
                       **planning)
    ref = reference(_big_table)
    results = run_ranks(_mixed_rank, 2, ddp.predicted.peak_memory_bytes - 2 * 4096 * 64, ref)
    check(results, ref)
    assert [r["offload"] for r in results] == [["emb.weight"], ["emb.weight"]]


def test_a_plan_shards_or_offloads_state_not_both() -> None:
    """Unpinned, ZeRO-1 and offload are one family of scenarios, one of the two per plan (the
    runtime's optimizers do not combine them). On the table of the test above: 2E bytes under
    DDP's peak, ZeRO-1 on the table (saving 4E, cheaper than its PCIe copies) does; 6E under,
    ZeRO-1 of everything saves too little (4E and the linears' 8 bytes per element), so the
    table goes to the host (8E) and nothing is ZeRO-1. On h100 with the update moving its state once
    (``H100_STATE_ONCE``), where ZeRO-1 costs time and is taken for memory only."""
    model, inputs, loss_fn, targets = _big_table()
    mesh = autopar.Mesh({"dp": 2}, H100_STATE_ONCE)
    kwargs: dict[str, Any] = dict(loss_fn=loss_fn, example_targets=targets, data_axes=("dp",), precision="fp32",
                                  micro_batches=1)
    table = 4096 * 64
    ddp = autopar.plan(model, mesh, inputs, **kwargs)
    sharded = autopar.plan(model, mesh, inputs, memory_limit=ddp.predicted.peak_memory_bytes - 2 * table, **kwargs)
    assert sharded.memory.zero1 == {"emb.weight": "dp"} and sharded.memory.offload == []
    hosted = autopar.plan(model, mesh, inputs, memory_limit=ddp.predicted.peak_memory_bytes - 6 * table, **kwargs)
    assert hosted.memory.offload and hosted.memory.zero1 == {}
    assert "emb.weight" in hosted.memory.offload
