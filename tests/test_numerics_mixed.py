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
from numerics_harness import TP_PLANS, Reference, mixed_reference, reference, run_checked, run_compiled

pytestmark = pytest.mark.slow

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
                         **case.kwargs, pipeline=False)
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



def _hf_llama(dtype: torch.dtype = torch.float32) -> Any:
    from examples import hf_models
    model, inputs, loss_fn, targets = hf_models.build_llama_step(batch=2, seq=16)
    return model.to(dtype), inputs, loss_fn, targets


def train_hf_on_rank(rank: int, world: int, dtype: torch.dtype, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, inputs, loss_fn, targets = _hf_llama(dtype)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, precision="bf16",
                         data_axes=("dp",), pipeline=False)
    return run_compiled(pm, (*inputs, *targets), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["mixed", "bf16-model"])
def test_hf_llama_bf16_prices_its_fp32_loss(dtype: torch.dtype) -> None:
    """HF's causal-LM loss is computed from ``logits.float()``: an fp32 scalar in a bf16 program
    (mixed precision, or a bf16 model), all-reduced at 4 bytes. The plan prices each float at
    the dtype the captured graph gives it (``Precision.captured_as_run``), so its loss
    all-reduce is the 4 bytes that run, not the 2 of the compute width."""
    pytest.importorskip("transformers")
    if dtype == torch.float32:
        ref = mixed_reference(_hf_llama)
    else:
        ref = reference(lambda: _hf_llama(dtype))
    results = run_checked(train_hf_on_rank, (2,), dtype, ref)
    assert (("forward", "all_reduce", "dp", 4), 1) in results[0]["planned"], results[0]["planned"]
