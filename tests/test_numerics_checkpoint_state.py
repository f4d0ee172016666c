"""Checkpointed blocks that update state in place train to the single-device numbers.

Batch norm in training mode updates its running statistics and bumps ``num_batches_tracked``
in place, inside the block. A checkpointed block's recompute must not update them a second
time, and must not need their values from before the update (autograd has seen those
tensors' versions bumped), yet see what the forward saw: the real state is updated once, in
the forward, and each recompute runs on a copy of it as the forward found it. Loss, every
gradient, parameters and the running statistics / ``num_batches_tracked`` after 3 AdamW steps
match one device: a conv + batch norm stack with checkpointing pinned ('full', 'selective')
on dp=2 and in pipeline stages (1F1B; a zero-bubble schedule, which recomputes each block
twice), Hugging Face's ResNet under memory limits at which the planner chooses
checkpointing itself (alone, and with micro-batches), and blocks reading a buffer written
after them (on dp=2) or before them by the next micro-batch's forward (a pipeline's
second forward runs before the first backward)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from conv_models import build_blocks_cnn, build_hf_resnet
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

import autopar
from autopar.passes.checkpoint_blocks import REGION_PREFIX
from autopar.runtime.forked import run_ranks
from autopar.runtime.recompute import Recompute
from numerics_harness import (EPS, LR, STEPS, Reference, check, mismatches, reference, reference_accumulated,
                              run_compiled)


class _Counting(nn.Module):
    """A region that writes state and reads what it wrote: a step counter bumped in place and
    multiplied into the output, and batch norm's running statistics updated by a cumulative
    average (the factor 1 / count)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                count: torch.Tensor) -> torch.Tensor:
        count.add_(1)
        y = torch.batch_norm(x, weight, None, mean, var, True, 1.0 / float(count), 1e-5, False)
        return torch.tanh(y * weight.view(1, -1, 1, 1)) * count


class _NoLog:
    """A ``Comm`` stand-in for a region without collectives."""

    def recomputing(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _state() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 4, 4, generator=gen).requires_grad_(), torch.rand(3, generator=gen).add(0.5)
            .requires_grad_(), torch.zeros(3), torch.ones(3), torch.tensor(1)]


def _run(policy: str | None, replays: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two steps of the region (plain when ``policy`` is None), each with a split backward
    (input gradients, then the weight's, as a zero-bubble schedule runs it) when ``replays``:
    the gradients of both steps and the state after them."""
    x, weight, *buffers = _state()
    run = Recompute(_NoLog(), torch.Generator(), replays=replays)  # type: ignore[arg-type]
    grads: list[torch.Tensor] = []
    for _ in range(2):
        out = _Counting()(x, weight, *buffers) if policy is None else run(_Counting(), policy, x, weight, *buffers,
                                                                          mutated=(2, 3, 4))
        loss = out.square().sum()
        if replays:
            grads += [*torch.autograd.grad(loss, x, retain_graph=True), *torch.autograd.grad(loss, weight)]
        else:
            grads += torch.autograd.grad(loss, (x, weight))
    return grads, buffers


@pytest.mark.parametrize("replays", [False, True])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_updates_written_state_once(policy: str, replays: bool) -> None:
    """Gradients and state equal the plain run's bit for bit: the recompute (twice per step
    with ``replays``) saw the forward's counter and running statistics and left them alone."""
    want_grads, want_state = _run(None, False)
    grads, state = _run(policy, replays)
    assert all(torch.equal(w, g) for w, g in zip(want_grads, grads, strict=True))
    assert all(torch.equal(w, g) for w, g in zip(want_state, state, strict=True)), (want_state, state)
    assert int(state[2]) == 3


def test_recompute_without_mutated_fails_on_written_state() -> None:
    """What ``mutated=`` is for: the written buffers as checkpoint's own inputs are refused in
    backward (their versions were bumped after checkpoint saved them)."""
    x, weight, *buffers = _state()
    out = Recompute(_NoLog(), torch.Generator())(_Counting(), "full", x, weight, *buffers)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _train_cnn(rank: int, world: int, policy: str, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = build_blocks_cnn()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, checkpoint=policy,
                         pipeline=False)
    result = run_compiled(pm, (*inputs, *targets), ref)
    return {**result, "blocks": list(pm.plan.memory.checkpoint_blocks),
            "regions": sorted(n for n, _ in pm.program.named_children() if n.startswith(REGION_PREFIX))}


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_batch_norm_blocks_match_single_device(policy: str) -> None:
    ref = reference(build_blocks_cnn)
    assert int(ref.state["blocks.1.bn.num_batches_tracked"]) == 3  # what the ranks must have too
    results = run_ranks(_train_cnn, 2, policy, ref)
    check(results, ref)
    for r in results:
        assert r["blocks"] == ["blocks.0", "blocks.1"]
        assert r["regions"] == ["checkpoint_blocks_0", "checkpoint_blocks_1"], r["regions"]


def _hf_resnet_peak() -> float:
    model, inputs, loss_fn, targets = build_hf_resnet()
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets)
    return plan.predicted.peak_memory_bytes


def _train_hf_resnet(rank: int, world: int, limit: float, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = build_hf_resnet()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, memory_limit=limit,
                         pipeline=False)
    memory = pm.plan.memory
    result = run_compiled(pm, (*inputs, *targets), ref, step=memory.micro_batches > 1)
    return {**result, "memory": (memory.checkpoint, list(memory.checkpoint_blocks), memory.micro_batches)}


@pytest.mark.parametrize(("share", "micro_batches"), [(0.75, 1), (0.5, 2)])
def test_memory_limited_hf_resnet_checkpoints_and_matches_single_device(share: float, micro_batches: int) -> None:
    """At 3/4 of its unconstrained peak the planner checkpoints a stage of HF's ResNet; at half
    it also cuts the batch in two micro-batches (batch norm then normalizes each on its own,
    as one device accumulating gradients over them does: the reference)."""
    ref = reference_accumulated(build_hf_resnet, micro_batches)
    results = run_ranks(_train_hf_resnet, 2, share * _hf_resnet_peak(), ref)
    check(results, ref)
    for r in results:
        checkpoint, blocks, m = r["memory"]
        assert checkpoint != "none" and blocks and m == micro_batches, r["memory"]


class _Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x) + shift)  # the add saves nothing: only checkpoint keeps ``shift``


class _SharedState(nn.Module):
    """Residual blocks reading one buffer of the root's, which the root updates in place:
    ``count`` before them (bumped every forward), ``decay`` after them (under no_grad; kept as
    it is with ``written_after=False``: pipeline stages do not share a buffer one of them
    writes, checkpointed or not)."""

    def __init__(self, written_after: bool = True) -> None:
        super().__init__()
        self.written_after = written_after
        self.register_buffer("decay", torch.ones(8))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Shifted() for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            x = block(x, self.decay if i % 2 else self.count)
        if self.written_after:
            with torch.no_grad():
                self.decay.mul_(0.5)
        return self.head(x)


def _shared_state(written_after: bool = True) -> tuple[nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    return (_SharedState(written_after), (torch.randn(8, 8, generator=gen),), F.mse_loss,
            (torch.randn(8, 3, generator=gen),))


def _counted() -> tuple[nn.Module, tuple[Any, ...], Any, tuple[Any, ...]]:
    return _shared_state(written_after=False)


def _train_shared(rank: int, world: int, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = _shared_state()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, checkpoint="full",
                         pipeline=False)
    return run_compiled(pm, (*inputs, *targets), ref)


def test_blocks_reading_state_written_after_them_match_single_device() -> None:
    ref = reference(_shared_state)
    check(run_ranks(_train_shared, 2, ref), ref)


MODELS = {"cnn": build_blocks_cnn, "counted": _counted}
PIPELINES = [("cnn", "1f1b", 2, 1, "full"), ("cnn", "zbv", 4, 2, "selective"), ("counted", "1f1b", 2, 1, "full")]


def _train_pipelined(rank: int, world: int, case: tuple[str, str, int, int, str], ref: Reference) -> dict[str, Any]:
    model_name, schedule, micro_batches, virtual, policy = case
    model, inputs, loss_fn, targets = MODELS[model_name]()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pipeline = autopar.Pipeline(axis="pp", schedule=schedule, micro_batches=micro_batches, virtual_stages=virtual)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, pipeline=pipeline,
                         checkpoint=policy)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses, grads = [], {}
    for i in range(STEPS):
        losses.append(pm.step(*inputs, *targets).to_local().item())
        if i == 0:
            layout = pm.state_dict()
            grads = {k: DTensor.from_local(p.grad, pm.stage_mesh, layout[k].placements, run_check=False).full_tensor()
                     for k, p in pm.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    state = {k: v.full_tensor() for k, v in pm.state_dict().items()}
    return {"losses": losses, "held": sorted(state), "checkpoint": pm.plan.memory.checkpoint,
            "grad_mismatches": mismatches({k: ref.grads[k] for k in grads}, grads),
            "state_mismatches": mismatches({k: ref.state[k] for k in state}, state)}


@pytest.mark.parametrize("case", PIPELINES, ids=lambda c: "-".join(map(str, c)))
def test_checkpointed_state_in_pipeline_stages_matches_single_device(case: tuple[str, str, int, int, str]) -> None:
    """Micro-batches normalize on their own: the reference accumulates gradients over them."""
    ref = reference_accumulated(MODELS[case[0]], case[2])
    results = run_ranks(_train_pipelined, 2, case, ref)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref.losses, rel=ref.tolerance[0], abs=ref.tolerance[1]), f"rank {rank}"
        assert r["grad_mismatches"] == [] and r["state_mismatches"] == [], (rank, r)
        assert r["checkpoint"] == case[4]
    assert {k for r in results for k in r["held"]} == set(ref.state)  # every tensor on some stage
