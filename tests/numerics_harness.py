"""What every numerics test does: run a step on one device and compiled on forked gloo ranks,
and compare loss, every gradient (whole tensors), parameters and buffers after AdamW steps,
replicas bit for bit, and the collectives that ran against the plan's list.

fp32 to rtol 1e-4 / atol 1e-5 (bf16 looser, see ``TOLERANCE``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import autopar
from autopar.runtime.forked import run_ranks
from autopar.runtime.ops import DATA_DEPENDENT, CollectiveLog
from examples import gpt, llama

RTOL, ATOL, LR, STEPS = 1e-4, 1e-5, 1e-3, 3
# bf16 keeps 8 bits of mantissa: another summation order changes a sum by ~2^-8 relative, and
# an Adam step (lr 1e-3, about lr per element) can round either way at a parameter's scale.
TOLERANCE = {torch.float32: (RTOL, ATOL), torch.bfloat16: (2e-2, 4e-3), torch.int64: (0.0, 0.0)}
# Adam divides by sqrt(v) + eps: a gradient element near eps=1e-8 (fp32 rounding noise of a
# summation order) turns into an update of lr * O(1) that differs between any two summation
# orders. eps=1e-6 keeps those elements' updates below the tolerance; real gradients are far
# larger than both.
EPS = 1e-6
TP_PLANS = {"gpt": gpt.TP_PLAN, "llama": llama.TP_PLAN}
"""The examples' Megatron TP plans, by model name (``constraints=`` on a tp axis)."""


@dataclass
class Reference:
    """One device's run of the steps."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    """First step's gradient of every parameter that got one (frozen, unused ones: none)."""
    state: dict[str, torch.Tensor]
    """Parameters and buffers after the steps."""
    compute_dtype: torch.dtype | None = None
    """A mixed-precision run (``mixed_reference``): fp32 masters and gradients that went
    through ``compute_dtype`` arithmetic, so every float is compared at its tolerance."""

    @property
    def tolerance(self) -> tuple[float, float]:
        if self.compute_dtype is not None:
            return TOLERANCE[self.compute_dtype]
        floats = [t for t in self.state.values() if t.is_floating_point()]
        return TOLERANCE[floats[0].dtype] if floats else TOLERANCE[torch.float32]


def reference(build: Callable[[], Any], steps: int = STEPS, seed: int | None = None,
              torch_generator: bool = False) -> Reference:
    """``build() -> (model, inputs, loss_fn, targets[, kwargs])`` run ``steps`` AdamW steps on one
    device (random ops drawing from the stream compiled modules draw from by default,
    ``autopar.random.stream(seed)``, when ``seed`` is given; with ``torch_generator``, from
    the default generator seeded ``seed``: ``compile(random_stream='torch')``'s); with
    ``loss_fn=None`` the model's output is the loss, or has it as ``.loss`` (a HF model given labels)."""
    return reference_accumulated(build, 1, steps, seed, torch_generator)


def reference_accumulated(build: Callable[[], Any], micro_batches: int, steps: int = STEPS,
                          seed: int | None = None, torch_generator: bool = False) -> Reference:
    """``reference`` as single-device gradient accumulation: each step runs the batch as
    ``micro_batches`` consecutive blocks of rows, each loss weighted 1/m (a mean over a fixed
    number of elements per micro-batch), random ops drawing micro-batch after micro-batch."""
    model, inputs, loss_fn, targets, *rest = build()
    kwargs: dict[str, Any] = rest[0] if rest else {}
    assert micro_batches == 1 or not kwargs, "keyword inputs are not cut into micro-batches here"
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    if seed is not None:
        torch.manual_seed(seed)
    draws = autopar.random.stream(seed) if seed is not None and not torch_generator else contextlib.nullcontext()
    pieces = [(inputs, targets)] if micro_batches == 1 else list(zip(
        zip(*(i.chunk(micro_batches) for i in inputs)), zip(*(t.chunk(micro_batches) for t in targets))))
    losses, grads = [], {}
    for step in range(steps):
        total = 0.0
        for x, t in pieces:
            with draws:
                out = model(*x, **kwargs)
                loss = loss_fn(out, *t) if loss_fn is not None else getattr(out, "loss", out)  # HF: its own loss
            loss = loss / micro_batches if micro_batches > 1 else loss
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return Reference(losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()})


def mixed_reference(build: Callable[[], Any], dtype: torch.dtype = torch.bfloat16, steps: int = STEPS) -> Reference:
    """One device running the step as mixed precision does (FSDP2's ``MixedPrecisionPolicy``
    without sharding): fp32 master parameters stepped by AdamW, the model's forward run on
    ``dtype`` casts of them (floating buffers and model inputs in ``dtype`` too), the loss
    returned in fp32. The same module code on the same dtypes as the compiled program, so
    only summation orders differ (autocast would instead keep softmax, norms and the loss in
    fp32: other arithmetic, not comparable op by op)."""
    model, inputs, loss_fn, targets = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    buffers = {k: cast(b) for k, b in model.named_buffers()}
    losses, grads = [], {}
    for step in range(steps):
        params = {k: cast(p) for k, p in model.named_parameters()}
        out = torch.func.functional_call(model, {**params, **buffers}, tuple(cast(x) for x in inputs))
        loss = (loss_fn(out, *targets) if loss_fn is not None else out).float()
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    state = {k: (buffers[k] if k in buffers else v).detach().clone() for k, v in model.state_dict().items()}
    return Reference(losses, grads, state, compute_dtype=dtype)


def mismatches(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor],
               floats: tuple[float, float] | None = None) -> list[str]:
    """Names whose whole tensors differ beyond the tolerance of their dtype (``floats`` for
    every floating tensor, when given), or are missing."""
    out = []
    for k, want in ref.items():
        tolerance = floats if floats is not None and want.is_floating_point() else TOLERANCE.get(want.dtype,
                                                                                                (RTOL, ATOL))
        if k not in got:
            out.append(f"{k}: missing")
        elif want.dtype != got[k].dtype:
            out.append(f"{k}: {got[k].dtype}, not {want.dtype}")
        elif not torch.allclose(want, got[k], *tolerance):
            out.append(f"{k}: max |diff| {(want.double() - got[k].double()).abs().max().item():.3g}")
    return out


Packed = tuple[list[int], bytes]
"""A whole fp32 tensor as (shape, bytes): ranks return results without tensors."""


def pack(t: torch.Tensor) -> Packed:
    return list(t.shape), t.detach().to(torch.float32).contiguous().numpy().tobytes()


def unpack(packed: Packed) -> torch.Tensor:
    shape, raw = packed
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


def diverged_replicas(pm: autopar.ParallelModule) -> list[str]:
    """Parameters and buffers whose copies along a replicated mesh dim differ in any bit."""
    mesh = pm.device_mesh
    diverged = []
    for name, value in pm.state_dict().items():
        raw = value.to_local().detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha1(raw).hexdigest()
        for dim, placement in enumerate(value.placements):
            if placement.is_replicate():
                digests: list[Any] = [None] * mesh.size(dim)
                dist.all_gather_object(digests, digest, group=mesh.get_group(dim))
                if len(set(digests)) > 1:
                    diverged.append(f"{name} along {mesh.mesh_dim_names[dim]}")
    return diverged


def run_compiled(pm: autopar.ParallelModule, args: tuple[Any, ...], ref: Reference, steps: int = STEPS,
                 kwargs: dict[str, Any] | None = None, step: bool = False) -> dict[str, Any]:
    """``pm(*args, **kwargs)`` (or with ``step``, ``pm.step(...)``, which runs backward itself)
    for ``steps`` AdamW steps on this rank, compared with ``ref``."""
    mesh = pm.device_mesh
    log = CollectiveLog()
    pm.attach_log(log)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)  # the plan's offloading, if any
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    ran: list[tuple[str, str, int, int]] = []
    regathered: list[tuple[str, tuple[str, str, int, int]]] = []
    for i in range(steps):
        loss = pm.step(*args, **(kwargs or {})) if step else pm(*args, **(kwargs or {}))
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),) * mesh.ndim
        if step:
            assert not loss.requires_grad, "pm.step returns the loss detached"
        else:
            loss.backward()
        if i == 0:
            regathered = list(log.regathers)
            state = pm.state_dict()
            grads = {k: DTensor.from_local(_reduced_zero1(pm, k, p), mesh, state[k].placements,
                                           run_check=False).full_tensor()
                     for k, p in pm.named_parameters() if p.grad is not None}
        losses.append(loss.full_tensor().item())
        opt.step()
        if i == 0:  # the optimizer's own collectives (ZeRO-1 buckets) are the step's too
            ran = list(log.entries)
        opt.zero_grad()
    # the optimizer registered the shards, so its state is as small as they are
    adam_shapes = {k: (tuple(p.shape), tuple(opt.state[p]["exp_avg"].shape))
                   for k, p in pm.named_parameters() if p in opt.state}
    state = {k: v.full_tensor() for k, v in pm.state_dict().items() if k in ref.state}
    names = mesh.mesh_dim_names
    recomputed = [e for e in ran if e[0] == "recompute"]  # also checked against the blocks' forward collectives
    floats = ref.tolerance if ref.compute_dtype is not None else None
    return {"losses": losses, "grad_mismatches": mismatches(ref.grads, grads, floats),
            "state_mismatches": mismatches(ref.state, state, floats), "with_grad": sorted(grads),
            "frozen": sorted(k for k, p in pm.named_parameters() if not p.requires_grad),
            "diverged": diverged_replicas(pm),
            "ran": sorted(Counter((p, k, names[d], b) for p, k, d, b in ran).items()),
            "regathered": sorted(Counter((fqn, p, k, names[d], b) for fqn, (p, k, d, b) in regathered).items()),
            "regather_planned": sorted(pm.plan.memory.regather), "adam_shapes": adam_shapes,
            "recomputed": sorted(Counter((p, k, names[d], b) for p, k, d, b in recomputed).items()),
            "planned": sorted(planned_counts(pm.plan).items())}


def _reduced_zero1(pm: autopar.ParallelModule, fqn: str, param: torch.Tensor) -> torch.Tensor:
    """A parameter's local gradient as every rank would hold it reduced: a ZeRO-1 parameter
    the step reduce-scatters has this rank's own in ``.grad`` until then, so it is summed here
    over its ZeRO-1 axis (what the runtime's reduce-scatter sums, as a whole)."""
    grad = param.grad
    assert grad is not None
    if id(param) not in pm.zero1.scattered:
        return grad
    summed = grad.clone()
    axis = pm.plan.memory.zero1[fqn]
    dist.all_reduce(summed, group=pm.device_mesh.get_group(axis))
    return summed


def planned_counts(plan: Any) -> Counter:
    """(phase, kind, axis, bytes) -> how many times the plan runs it in a step; bytes that depend on
    the data (an expert-parallel layer's rows) as the runtime logs them, ``DATA_DEPENDENT``."""
    counts: Counter = Counter()
    for c in plan.collectives:
        counts[(c.phase, c.kind, c.axis, DATA_DEPENDENT if c.data_dependent else c.bytes)] += c.count
    return counts


def run_checked(train_on_rank: Callable[..., dict[str, Any]], mesh_shape: tuple[int, ...], case: Any,
                ref: Reference) -> list[dict[str, Any]]:
    """``train_on_rank(rank, world, case, ref)`` on forked ranks, one per mesh device, each
    result ``check``ed against ``ref``; the results, for a test's own assertions."""
    results = run_ranks(train_on_rank, math.prod(mesh_shape), case, ref)
    check(results, ref)
    return results


def check(results: list[dict[str, Any]], ref: Reference) -> None:
    """Every rank matched one device, kept its replicas identical and ran what was planned."""
    rtol, atol = ref.tolerance
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref.losses, rel=rtol, abs=atol), f"rank {rank}"
        assert result["with_grad"] == sorted(ref.grads), f"rank {rank}: gradients of other parameters"
        assert result["grad_mismatches"] == [], f"rank {rank}: {result['grad_mismatches']}"
        assert result["state_mismatches"] == [], f"rank {rank}: {result['state_mismatches']}"
        assert result["diverged"] == [], f"rank {rank}: replicas differ bitwise: {result['diverged']}"
        assert result["ran"] == result["planned"], f"rank {rank}: executed collectives differ from the plan"
        stray = {fqn for (fqn, *_), _ in result["regathered"]} - set(result["regather_planned"])
        assert not stray, f"rank {rank}: gathered again in backward without being planned so: {sorted(stray)}"
        assert all(p == "backward" and k == "all_gather" for (_, p, k, *_), _ in result["regathered"])


def compile_gpt(mesh_spec: str, **options: Any) -> tuple[autopar.ParallelModule, torch.Tensor, torch.Tensor]:
    """The GPT example compiled on ``"2x2"`` (dp x tp, Megatron TP pinned: sharded and strided
    parameters) or ``"4"`` (dp only); ``options`` go to ``autopar.compile``. Returns the
    module, its tokens and targets (for checkpoint round trips across meshes)."""
    model, (tokens,), loss_fn, (targets,) = gpt.build()
    if mesh_spec == "2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        options = {"constraints": gpt.TP_PLAN, **options}
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=loss_fn, example_targets=(targets,),
                         **{"pipeline": False, **options})
    return pm, tokens, targets
