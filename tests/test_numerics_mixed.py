"""Mixed precision: an fp32 model compiled with ``precision="bf16"`` computes and
communicates in bf16, keeps fp32 master weights, gradients and AdamW state, and reduces
gradients in fp32; it trains to a single device running the same bf16 arithmetic on fp32
masters (``numerics_harness.mixed_reference``) within bf16 tolerances: loss, every
gradient, parameters after 3 AdamW steps. The collectives that ran, bytes included, are
the plan's: bf16 gathers and activations, fp32 gradient buckets and reduce-scatters.
Those bytes, not the tolerances, tell bf16 arithmetic from fp32: the losses of a bf16 and an
fp32 run differ by less than one bf16 ulp of the loss (0.03 at ~4.8)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autopar
from examples import gpt, llama
from numerics_harness import TP_PLANS, Reference, mixed_reference, run_compiled, run_checked

MODELS: dict[str, Callable[[], Any]] = {"gpt": gpt.build, "llama": llama.build}


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    kwargs: dict = field(default_factory=dict, hash=False)

    @property
    def id(self) -> str:
        extra = (f"-zero{self.kwargs['zero']['dp']}" if "zero" in self.kwargs else "") + \
            ("-checkpointed" if "checkpoint" in self.kwargs else "")
        return f"{self.model}-{'x'.join(map(str, self.mesh))}{extra}"


CASES = [Case(model, (2,), ("dp",)) for model in MODELS] + [
    Case(model, (2, 2), ("dp", "tp"), {"constraints": TP_PLANS[model], "data_axes": ("dp",)}) for model in MODELS] + [
    Case(model, (2,), ("dp",), {"zero": {"dp": 3}, "data_axes": ("dp",)}) for model in MODELS] + [
    # ZeRO-1: the fp32 masters are the parameters, Adam's state is fp32 chunks
    Case("gpt", (2,), ("dp",), {"zero": {"dp": 1}, "data_axes": ("dp",)})] + [
    # the casts inside a checkpointed block are recomputed in backward with it
    Case("llama", (2, 2), ("dp", "tp"), {"constraints": llama.TP_PLAN, "data_axes": ("dp",), "checkpoint": "full"})]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = MODELS[case.model]()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, precision="bf16",
                         **case.kwargs)
    result = run_compiled(pm, (*inputs, *targets), ref)
    opt = torch.optim.AdamW(pm.parameters())
    loss = pm(*inputs, *targets)
    loss.backward()
    opt.step()
    code = pm.program.code
    return {**result, "precision": pm.plan.precision, "loss_dtype": loss.dtype,
            "param_dtypes": {str(p.dtype) for p in pm.parameters()},
            "grad_dtypes": {str(p.grad.dtype) for p in pm.parameters() if p.grad is not None},
            "adam_dtypes": {str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim()},
            "casts": code.count("dtype = torch.bfloat16"), "fp32_reduce": code.count("grad_dtype = torch.float32")}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mixed_precision_matches_bf16_compute_on_fp32_masters(case: Case) -> None:
    ref = mixed_reference(MODELS[case.model])
    results = run_checked(train_on_rank, case.mesh, case, ref)
    for r in results:
        assert r["precision"] == "bf16" and r["loss_dtype"] == torch.float32
        assert r["param_dtypes"] == r["grad_dtypes"] == r["adam_dtypes"] == {"torch.float32"}
        assert r["casts"] > 0  # every parameter read through a bf16 cast
        if case.kwargs.get("zero") == {"dp": 3}:
            assert r["fp32_reduce"] > 0 and r["regathered"]  # gathered again in backward, from the master

