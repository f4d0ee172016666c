"""ZeRO-1 (``zero={"dp": 1}``): parameters replicated on dp, each rank's optimizer state for
its 1/n chunk only, gradients reduce-scattered and chunks all-gathered at the optimizer
step. Trains to the single-device numbers (``numerics_harness``: loss, every gradient,
parameters after 3 AdamW steps, the collectives the plan lists), on dp=2, dp=4, dp x tp and
with 4 micro-batches; its state round-trips through checkpoints across meshes; the search
takes it where the memory limit binds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.cost.buckets import bucket_count, shard_buckets
from autopar.cost.zero1 import chunk_elements, shard_bucket_cap
from autopar.errors import InputError
from autopar.runtime import checkpoint
from autopar.runtime.forked import run_ranks
from examples import gpt, llama
from numerics_harness import (EPS, LR, TP_PLANS, Reference, check, compile_gpt, mismatches, reference,
                              reference_accumulated, run_checked, run_compiled)
from tests.planning import H100_STATE_ONCE, assert_one_price

def _gpt_frozen() -> Any:
    """GPT with its position table frozen: no gradient, no optimizer state, not ZeRO-1."""
    model, inputs, loss_fn, targets = gpt.build()
    model.wpe.weight.requires_grad_(False)
    return model, inputs, loss_fn, targets


def _gpt_odd() -> Any:
    """GPT 66 wide: its biases and norms' 66 elements pad to 68 on 4 ranks, so the stream's rows
    end and start inside parameters."""
    return gpt.build(gpt.GPTConfig(hidden=66, heads=3))


MODELS = {"gpt": gpt.build, "llama": llama.build, "gpt_frozen": _gpt_frozen, "gpt_odd": _gpt_odd}


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    micro_batches: int = 1
    bucket_bytes: int | None = None
    """Small buckets: parameters straddle them, and each runs its own reduce-scatter and all-gather."""

    @property
    def id(self) -> str:
        small = f"-b{self.bucket_bytes}" if self.bucket_bytes else ""
        return f"{self.model}-{'x'.join(map(str, self.mesh))}-m{self.micro_batches}{small}"

    def compile_kwargs(self) -> dict[str, Any]:
        # data_axes: the batch stays split on dp (the cpu profile would otherwise use dp as TP on these tiny models)
        kw: dict[str, Any] = {"zero": {"dp": 1}, "data_axes": ("dp",), "micro_batches": self.micro_batches}
        if self.bucket_bytes:
            kw["bucket_bytes"] = self.bucket_bytes
        if "tp" in self.names:
            kw["constraints"] = TP_PLANS[self.model]
        return kw


CASES = [Case("gpt", (2,), ("dp",)), Case("llama", (4,), ("dp",)), Case("gpt", (2, 2), ("dp", "tp")),
         Case("gpt", (2,), ("dp",), micro_batches=4), Case("gpt_frozen", (2,), ("dp",)),
         Case("gpt", (4,), ("dp",), bucket_bytes=96 * 1024), Case("gpt_odd", (4,), ("dp",)),
         Case("gpt_odd", (4,), ("dp",), bucket_bytes=96 * 1024)]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = MODELS[case.model]()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **case.compile_kwargs(),
                         pipeline=False)
    result = run_compiled(pm, (*inputs, *targets), ref, step=case.micro_batches > 1)
    dp = mesh.size(case.names.index("dp"))
    chunks = {fqn: math.ceil(pm.get_parameter(fqn).numel() / dp) for fqn in pm.plan.memory.zero1}
    local = {k: p.numel() for k, p in pm.named_parameters() if p.requires_grad}
    state = {k: math.prod(result["adam_shapes"][k][1]) if k in result["adam_shapes"] else 0 for k in local}
    return {**result, "zero1": pm.plan.memory.zero1, "chunks": chunks, "local": local, "state": state,
            "describe": pm.plan.memory.describe()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_zero1_matches_single_device(case: Case) -> None:
    """Single-device numbers, executed == planned collectives, and every rank's Adam state is
    its row of the parameters' stream: the ranks' rows partition each parameter, each at most
    the chunks' total (so per rank ~1/n of DDP's state)."""
    build = MODELS[case.model]
    ref = reference_accumulated(build, case.micro_batches) if case.micro_batches > 1 else reference(build)
    results = run_checked(train_on_rank, case.mesh, case, ref)
    dp = case.mesh[case.names.index("dp")]
    for r in results:
        assert "ZeRO-1 on dp" in r["describe"]
        assert set(r["zero1"]) == set(r["local"]) and set(r["zero1"].values()) == {"dp"}  # every trainable one
        assert r["frozen"] == (["wpe.weight"] if case.model == "gpt_frozen" else [])
        assert sum(r["state"].values()) <= sum(r["chunks"].values())  # a row: the chunks' columns
        assert all(shape == (r["state"][k],) for k, (_, shape) in r["adam_shapes"].items())  # flat pieces
        ratio = sum(r["state"].values()) / sum(r["local"].values())
        assert ratio <= 1 / dp + 0.01, ratio  # measured: Adam state per rank ~1/n of DDP's (padding aside)
        kinds = {(phase, kind) for (phase, kind, *_), _ in r["ran"] if phase == "optimizer"}
        assert kinds == {("optimizer", "reduce_scatter"), ("optimizer", "all_gather")}
        calls = sum(n for (phase, *_), n in r["ran"] if phase == "optimizer")
        assert calls > 2 if case.bucket_bytes else calls == 2  # one bucket each, or many (ran == planned)
    inner = math.prod(case.mesh[1:])  # ranks with the same coordinates past dp (mesh dim 0) share a dp group
    for group in range(inner):
        members = results[group::inner]
        summed = {k: sum(r["state"][k] for r in members) for k in members[0]["state"]}
        assert summed == members[0]["local"]  # the dp ranks' chunks partition each local tensor


MIXED = [((2,), ("dp",)), ((2, 2), ("dp", "tp"))]


def _mixed_options(names: tuple[str, ...]) -> dict[str, Any]:
    """Priced as h100s with the update moving its state once (``H100_STATE_ONCE``: the all-reduce hides
    behind backward, ZeRO-1's reduce-scatter and all-gather do not: ZeRO-1 only where memory needs it; at
    foreach AdamW's traffic sharding the update pays for every parameter), run in fp32 on gloo; the batch
    split on dp, Megatron's TP pinned on tp, nothing else to trade (one micro-batch, no offload)."""
    options: dict[str, Any] = {"precision": "fp32", "data_axes": ("dp",), "micro_batches": 1, "offload": False}
    return {**options, "constraints": TP_PLANS["gpt"]} if "tp" in names else options


def _mixed_limit(shape: tuple[int, ...], names: tuple[str, ...]) -> float:
    """85% of the way from DDP's peak to every parameter ZeRO-1's (pinned): some must be ZeRO-1,
    not all (nearer DDP's, on dp x tp, storing the free parameters split on tp is enough)."""
    model, inputs, loss_fn, targets = gpt.build()
    mesh = autopar.Mesh(dict(zip(names, shape)), H100_STATE_ONCE)
    peaks = [autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **_mixed_options(names),
                          **pin).predicted.peak_memory_bytes for pin in ({}, {"zero": {"dp": 1}})]
    return 0.15 * peaks[0] + 0.85 * peaks[1]


def _train_mixed(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], limit: float,
                 ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, inputs, loss_fn, targets = gpt.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, hardware=H100_STATE_ONCE,
                         memory_limit=limit, **_mixed_options(names), pipeline=False)
    result = run_compiled(pm, (*inputs, *targets), ref)
    return {**result, "zero1": pm.plan.memory.zero1, "trainable": pm.plan.memory.trainable_parameters,
            "peak": pm.plan.predicted.peak_memory_bytes}


@pytest.mark.parametrize("shape, names", MIXED, ids=["dp2", "dp2xtp2"])
def test_zero1_per_parameter_matches_single_device(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    """A memory limit the ILP meets by sharding the optimizer state of some parameters only:
    those train as ZeRO-1 (reduce-scattered, chunk stepped, all-gathered), the others as DDP
    (bucketed all-reduce), together matching one device, executed == planned collectives."""
    ref = reference(gpt.build)
    limit = _mixed_limit(shape, names)
    results = run_ranks(_train_mixed, math.prod(shape), shape, names, limit, ref)
    check(results, ref)
    for r in results:
        assert r["zero1"] == results[0]["zero1"] and 0 < len(r["zero1"]) < r["trainable"], r["zero1"]
        assert set(r["zero1"].values()) == {"dp"} and r["peak"] <= limit
        shapes = r["adam_shapes"]
        assert len(set(shapes) - set(r["zero1"])) == r["trainable"] - len(r["zero1"])  # the others: state on every rank
        assert all(state == shape_ if k not in r["zero1"] else len(state) == 1  # the others' is the parameter's,
                   for k, (shape_, state) in shapes.items()), shapes            # ZeRO-1's a flat piece
        kinds = {(phase, kind) for (phase, kind, *_), _ in r["ran"]}
        assert {("optimizer", "reduce_scatter"), ("optimizer", "all_gather"), ("backward", "all_reduce")} <= kinds


def _steps(pm: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor,
           steps: int, loss_fn: Any = None) -> None:
    for _ in range(steps):
        (pm(tokens, targets) if loss_fn is None else loss_fn(pm(tokens), targets)).backward()
        opt.step()
        opt.zero_grad()


def _whole(pm: autopar.ParallelModule) -> dict[str, list[float]]:
    full = {k: v.full_tensor().flatten().tolist() for k, v in pm.state_dict().items()}
    return full if dist.get_rank() == 0 else {}


def _save_rank(rank: int, world: int, mesh_spec: str, path: str) -> dict[str, Any]:
    pm, tokens, targets = compile_gpt(mesh_spec, zero={"dp": 1}, data_axes=("dp",))
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    _steps(pm, opt, tokens, targets, 2)
    checkpoint.save(pm, path, opt)
    _steps(pm, opt, tokens, targets, 1)  # the uninterrupted run's third step
    return {"state": _whole(pm), "zero1": len(pm.plan.memory.zero1)}


def _resume_rank(rank: int, world: int, mesh_spec: str, path: str) -> dict[str, Any]:
    pm, tokens, targets = compile_gpt(mesh_spec, zero={"dp": 1}, data_axes=("dp",))
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)  # no state yet: load creates it, chunk-sized
    checkpoint.load(pm, path, opt)
    steps = sorted({float(s["step"]) for s in opt.state.values()})
    # this rank's row of each stream: flat pieces, together at most the chunks' total
    pieces = [s["exp_avg"] for s in opt.state.values()]
    chunked = all(t.dim() == 1 for t in pieces) and \
        sum(t.numel() for t in pieces) <= sum(math.ceil(p.numel() / 4) for p in pm.parameters())
    _steps(pm, opt, tokens, targets, 1)
    return {"state": _whole(pm), "steps": steps, "chunked": chunked}


def _tensors(state: dict[str, list[float]], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=like[k].dtype).reshape(like[k].shape) for k, v in state.items() if k in like}


def test_zero1_optimizer_state_round_trips_across_meshes(tmp_path: Path) -> None:
    """2 steps with ZeRO-1 on dp x tp, saved; loaded with ZeRO-1 on dp=4 (state chunks of
    another size) and into one process: one more step gives the uninterrupted run's parameters."""
    single = reference(gpt.build, steps=3).state
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_rank, 4, "2x2", path)[0]
    assert saved["zero1"] > 0
    uninterrupted = _tensors(saved["state"], single)
    assert mismatches(single, uninterrupted) == []
    resumed = run_ranks(_resume_rank, 4, "4", path)
    assert all(r["steps"] == [2.0] and r["chunked"] for r in resumed)
    assert mismatches(uninterrupted, _tensors(resumed[0]["state"], single)) == []  # rank 0's whole tensors
    model, (tokens,), loss_fn, (targets,) = gpt.build(gpt.GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    checkpoint.load_single_device(model, path, opt)  # the plain layout: whole state tensors
    _steps(model, opt, tokens, targets, 1, loss_fn)
    assert mismatches(uninterrupted, dict(model.state_dict())) == []


def _plain_optimizer_rank(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = gpt.build()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, zero={"dp": 1}, pipeline=False)
    torch.optim.AdamW(pm.parameters(), lr=LR)
    try:
        pm(*inputs, *targets)
    except InputError as exc:
        return str(exc)
    return ""


def test_zero1_refuses_training_without_its_optimizer() -> None:
    """A plain optimizer would step unreduced gradients: the module refuses to train until
    ``pm.optimizer`` made the one that reduces them."""
    assert all("pm.optimizer" in message for message in run_ranks(_plain_optimizer_rank, 2))


def _plan(**kwargs: Any) -> autopar.Plan:
    """GPT on dp=4 (h100, its update moving the state once: ``H100_STATE_ONCE``), batch split on dp (the
    search tries only micro-batches that split 4 ways)."""
    model, inputs, loss_fn, targets = gpt.build()
    return autopar.plan(model, autopar.Mesh({"dp": 4}, H100_STATE_ONCE), inputs, loss_fn=loss_fn, example_targets=targets,
                        data_axes=("dp",), **kwargs)


def test_zero1_pricing_and_search() -> None:
    """Pinned ZeRO-1 keeps 1/4 of Adam's state per rank, lists RS + AG buckets for what DDP
    all-reduces, and its objective is the plan's step time; a limit between its peak and
    DDP's makes the search take it (h100: the all-reduce would hide behind backward, the
    optimizer step's RS + AG do not, so it is slower and chosen only for memory), for only
    some parameters: those whose state the limit needs sharded."""
    ddp = _plan()
    zero1 = _plan(zero={"dp": 1})
    assert_one_price(zero1)
    assert zero1.predicted.memory_parts["optimizer state"] == pytest.approx(
        ddp.predicted.memory_parts["optimizer state"] / 4, rel=0.01)
    assert sum(zero1.predicted.memory_parts.values()) == pytest.approx(zero1.predicted.peak_memory_bytes)
    assert zero1.predicted.step_time_s > ddp.predicted.step_time_s
    kinds = {(c.phase, c.kind) for c in zero1.collectives if c.consumer == "optimizer"}
    assert kinds == {("optimizer", "reduce_scatter"), ("optimizer", "all_gather")}
    limit = (ddp.predicted.peak_memory_bytes + zero1.predicted.peak_memory_bytes) / 2
    searched = _plan(memory_limit=limit)  # the ILP shards the state of only as many parameters as it must
    some = len(searched.memory.zero1)
    assert 0 < some < len(zero1.memory.zero1) == zero1.memory.trainable_parameters
    assert searched.memory.describe() == f"1 micro-batch, ZeRO-1 on dp for {some} of {len(zero1.memory.zero1)} " \
                                         "parameters"
    assert searched.predicted.peak_memory_bytes <= limit
    assert_one_price(searched)
    assert ddp.predicted.step_time_s < searched.predicted.step_time_s < zero1.predicted.step_time_s
    assert searched.plan_hash() != ddp.plan_hash()
    with pytest.raises(InputError, match="not both"):
        _plan(zero={"dp": 1}, offload=True)


def test_shard_buckets_cut_stream_columns_every_cap_bytes() -> None:
    """Each stream's parameters padded to a multiple of ways and laid end to end, viewed as ways
    rows; the streams' columns cut every cap bytes, so M bytes run exactly ceil(M / cap) calls,
    as the ILP prices; each bucket names the parameters it moves elements of."""
    cap = shard_bucket_cap(40, itemsize=4, ways=2)  # 5 columns of 2 fp32 elements
    assert cap == 40
    stream = [("b", chunk_elements(9, 2)), ("a", chunk_elements(7, 2))]  # chunks of 5 and 4: rows of 9 columns
    buckets = shard_buckets("reduce_scatter", 0, 2, [stream], itemsize=4, cap=cap)
    assert [b.columns for b in buckets] == [(0, 5), (5, 9)]
    # row 0 is b's 10 elements less its last; row 1 b's last, then a's 8
    assert [[(s.param, s.start, s.stop) for s in b.slices] for b in buckets] == [
        [("b", 0, 10), ("a", 10, 18)], [("b", 0, 10), ("a", 10, 18)]]
    assert [b.nbytes for b in buckets] == [40, 32]
    two = shard_buckets("all_gather", 0, 2, [[("b", 4)], [("a", 3)]], itemsize=4, cap=cap)
    assert [(b.columns, b.params) for b in two] == [((0, 5), ("b", "a")), ((5, 7), ("a",))]
    assert len(two) == bucket_count(2 * 4 * (3 + 4), cap)
