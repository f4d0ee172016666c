"""What ``autopar.plan`` does with what a new user hands it: the default memory limit leaves
headroom, wrong argument types and outputs are named, and splits it could not make are said."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import autopar
from autopar.memory import scenarios
from autopar.config import PlanConfig
from autopar.search.problem import Place, Problems, Step
from autopar.search.problem import scenarios as search_scenarios
from autopar.hardware import GiB, PROFILES
from autopar.mesh import parse_mesh_spec
from autopar.solver.ilp import solve
from examples import gpt


@pytest.mark.slow
def test_default_memory_limit_leaves_headroom_for_what_the_plan_does_not_count() -> None:
    model, inputs, loss_fn, targets = gpt.build()
    step = dict(loss_fn=loss_fn, example_targets=targets)
    h100 = autopar.plan(model, autopar.Mesh({"dp": 2}, "h100"), inputs, **{"pipeline": False, **step})
    # 80 GiB less the CUDA context (0.4 GB), NCCL's buffers (2 x 1.06 GB) and 10% fragmentation
    assert h100.memory_limit_bytes == pytest.approx((80 * GiB - 0.4e9 - 2.12e9) * 0.9)
    assert "limit 69.89 GiB" in str(h100)
    whole = autopar.plan(model, autopar.Mesh({"dp": 2}, "h100"), inputs, memory_headroom=0.0,
                         **{"pipeline": False, **step})
    assert whole.memory_limit_bytes == 80 * GiB
    given = autopar.plan(model, autopar.Mesh({"dp": 2}, "h100"), inputs, memory_limit=3 * GiB,
                         **{"pipeline": False, **step})
    assert given.memory_limit_bytes == 3 * GiB

    # A device whose whole memory just holds the leanest plan: by default the plan must not use it all.
    problems = Problems(Step(model=model, example_inputs=inputs, **step), PlanConfig())
    place = Place(mesh=autopar.Mesh({"dp": 2}, "cpu"))
    leanest = min(solve(p.graph, p.folding, p.ctx, None, minimize_memory=True).memory_bytes  # micro-batches, ...
                  for p in (problems.under(place, s, math.inf)
                            for s in scenarios.leanest(search_scenarios(problems.at(place)))))
    tight = dataclasses.replace(PROFILES["cpu"], memory_bytes=int(leanest / 0.95))
    with pytest.raises(autopar.MemoryLimitError, match=r"\(the limit is the cpu's .* less a headroom of 10%"):
        autopar.plan(model, autopar.Mesh({"dp": 2}, tight), inputs, **{"pipeline": False, **step})
    fits = autopar.plan(model, autopar.Mesh({"dp": 2}, tight), inputs, memory_headroom=0.0,
                        **{"pipeline": False, **step})
    assert fits.predicted.peak_memory_bytes <= tight.memory_bytes


@pytest.mark.parametrize("kwargs,message", [
    ({"memory_limit": -1.0}, "memory_limit must be a positive number"),
    ({"memory_limit": 0}, "memory_limit must be a positive number"),
    ({"memory_headroom": 1.0}, r"headroom is a fraction of device memory in \[0, 1\)"),
    ({"memory_headroom": -0.1}, r"headroom is a fraction"),
    ({"memory_limit": GiB, "memory_headroom": 0.1}, "not both"),
    ({"regather_blocks": 1}, r"regather_blocks=1 needs ZeRO-3 pinned"),
    ({"regather_blocks": 1, "zero": {"dp": 2}}, r"regather_blocks=1 needs ZeRO-3 pinned"),
    ({"regather_blocks": 0, "zero": {"dp": 3}}, "regather_blocks must be a positive whole number"),
], ids=["negative-limit", "zero-limit", "headroom-1", "negative-headroom", "limit-and-headroom", "regather-no-zero",
        "regather-zero2", "regather-0"])
def test_bad_memory_limits_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(autopar.InputError, match=message):
        autopar.plan(nn.Linear(8, 8), autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 8),),
                     loss_fn=lambda out: out.sum(), **{"pipeline": False, **kwargs})


class _Output:
    """What a Hugging Face model returns when called without labels: logits, ``loss=None``."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.loss = logits, None


class _NoLabels(nn.Linear):
    def forward(self, x: torch.Tensor) -> _Output:  # type: ignore[override]
        return _Output(super().forward(x))


@pytest.mark.parametrize("model,message", [
    (nn.Linear(8, 8), r"returned a torch.float32 tensor of shape \(4, 8\); pass loss_fn"),
    (_NoLabels(8, 8), r"returned _Output whose .loss is None \(a Hugging Face model computes it only when "
                      r"called with labels=...\)"),
], ids=["logits", "hf-output-without-labels"])
def test_a_model_output_that_is_not_a_loss_is_described(model: nn.Module, message: str) -> None:
    with pytest.raises(autopar.CaptureError, match=message) as info:
        autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 8),), pipeline=False)
    assert "FakeTensor" not in str(info.value)


@pytest.mark.parametrize("args,message", [
    (("model", (torch.randn(4, 8),)), r"the model must be a torch.nn.Module, got 'model' \(str\)"),
    ((nn.Linear(8, 8), torch.randn(4, 8)), r"example_inputs must be a tuple \(write \(x,\) for one tensor\), "
                                           r"got a torch.float32 tensor of shape \(4, 8\)"),
    ((nn.Linear(8, 8), ([torch.randn(4, 8), object()],)), r"example_inputs\[0\]\[1\] is object"),
], ids=["model-is-a-string", "bare-tensor-inputs", "object-inside-a-list"])
def test_wrong_argument_types_are_named_before_tracing(args: tuple, message: str) -> None:
    with pytest.raises(autopar.InputTypeError, match=message) as info:
        autopar.plan(args[0], autopar.Mesh({"dp": 2}, "cpu"), args[1], loss_fn=lambda out: out.sum(), pipeline=False)
    assert isinstance(info.value, TypeError)  # as Python's own type errors


@pytest.mark.parametrize("kwargs,message", [
    ({"bucket_bytes": 0}, r"bucket_bytes must be a positive whole number of bytes, a multiple of 8 .*got 0"),
    ({"bucket_bytes": -4}, r"bucket_bytes must be a positive .*got -4"),
    ({"bucket_bytes": 12}, r"bucket_bytes must be .* a multiple of 8 .*got 12"),
    ({"bucket_bytes": 1024.0}, r"bucket_bytes must be .*got 1024.0"),
    ({"solver_time_limit_s": 0}, r"solver_time_limit_s must be a positive number of seconds, got 0"),
    ({"solver_time_limit_s": -1.0}, r"solver_time_limit_s must be a positive .*got -1.0"),
    ({"solver_time_limit_s": float("nan")}, r"solver_time_limit_s must be a positive .*got nan"),
], ids=["bucket-0", "bucket-negative", "bucket-not-aligned", "bucket-float", "time-0", "time-negative", "time-nan"])
def test_bad_bucket_sizes_and_solver_time_limits_are_refused_before_capture(
        kwargs: dict, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """They failed as a ZeroDivisionError, a wrong 'no plan satisfies the pins', or only after the solve."""
    def no_capture(*args: object, **kw: object) -> None:
        raise AssertionError("captured before checking the options")

    monkeypatch.setattr("autopar.search.problem.capture", no_capture)
    with pytest.raises(autopar.InputError, match=message):
        autopar.plan(nn.Linear(8, 8), autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 8),),
                     loss_fn=lambda out: out.sum(), **{"pipeline": False, **kwargs})


def _plan_linear(**kwargs: object) -> autopar.Plan:
    return autopar.plan(nn.Linear(8, 8), autopar.Mesh({"dp": 2}, "cpu"), (torch.randn(4, 8),),
                        **{"loss_fn": lambda out: out.sum(), **kwargs}, pipeline=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("call,error,message", [
    (lambda: autopar.Mesh({"dp": 0}), ValueError, "sizes must be positive"),
    (lambda: parse_mesh_spec("dp=2,dp=4"), ValueError, "named twice"),
    (lambda: autopar.Mesh({"dp": 2}, "tpu9"), ValueError, "unknown hardware 'tpu9'"),
    (lambda: _plan_linear(precision="fp8"), ValueError, "unknown precision 'fp8'"),
    (lambda: autopar.plan(nn.Linear(8, 8), None, (torch.randn(4, 8),), pipeline=False), TypeError,
                          "mesh must be an autopar.Mesh"),
    (lambda: _plan_linear(data_axes=("tp",)), ValueError, r"data_axes \('tp',\) names 'tp', not an axis of the mesh"),
    (lambda: _plan_linear(constraints={"": ColwiseParallel()}), ValueError, r"mesh axis 'tp' \(constraint_axis=\), not an axis of the mesh"),
    (lambda: _plan_linear(constraints={"nothing": ColwiseParallel()}, constraint_axis="dp"), ValueError,
     "matches no module"),
    (lambda: _plan_linear(memory_limit=1.0), ValueError, "no plan fits the memory limit"),
    (lambda: _plan_linear(solver_time_limit_s=1e-9), RuntimeError, "no plan within its time limit"),
    (lambda: _plan_linear(loss_fn=None), RuntimeError, "pass loss_fn"),
], ids=["mesh-size", "mesh-spec", "hardware", "precision", "mesh-type", "data-axis",
        "constraint-axis", "constraint-pattern", "memory-limit", "solver-time-limit", "capture"])
def test_what_the_user_hands_in_is_refused_with_an_input_error(call: Any, error: type, message: str) -> None:
    """One base for every user-facing input error (the command line exits 2 on exactly these),
    each still the builtin type callers caught before."""
    with pytest.raises(autopar.InputError, match=message) as info:
        call()
    assert isinstance(info.value, error)


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("model,inputs,kwargs,error,message", [
    (nn.Linear(8, 8), (torch.randn(4, 8),), {"zero": 3}, autopar.InputTypeError,
     r"zero must be a dict of data axis -> ZeRO stage, such as \{'dp': 3\}, got 3"),
    (nn.Linear(8, 8), (torch.randn(4, 8),), {"data_axes": "dp"}, autopar.InputTypeError,
     r"data_axes must be a tuple of axis names \(write \('dp',\)\), got 'dp'"),
    (nn.Linear(8, 8), (torch.randn(4, 8),), {"data_axes": ("dp",), "expert_axes": "dp"}, autopar.InputTypeError,
     r"expert_axes must be a tuple of axis names \(write \('dp',\)\)"),
    (nn.Linear(8, 8), (torch.randn(4, 8, dtype=torch.float64),), {}, autopar.InputError,
     r"example_inputs\[0\] is a torch.float64 tensor of shape \(4, 8\), but the model's parameters are "
     r"torch.float32"),
    (_TwoBlocks(), (torch.randn(4, 8),), {"checkpoint": "full", "checkpoint_blocks": 100}, autopar.InputError,
     "checkpoint_blocks=100 pins the first 100 repeated blocks, but the model has 2: pass at most 2"),
    (nn.Linear(8, 8), (torch.randn(4, 8),), {"zero": {"dp": 3}, "regather_blocks": 1}, autopar.InputError,
     "regather_blocks=1 pins the first 1 repeated blocks, but the model has 0: leave regather_blocks out"),
    (_TwoBlocks(), (torch.randn(4, 8),), {"zero": 3, "pipeline": autopar.Pipeline(axis="dp")},
     autopar.InputTypeError, "zero must be a dict"),
], ids=["zero-int", "data-axes-string", "expert-axes-string", "float64-input", "checkpoint-blocks-beyond",
        "regather-blocks-beyond", "pipeline-zero-int"])
def test_options_of_the_wrong_kind_are_refused_by_name(model: nn.Module, inputs: tuple, kwargs: dict,
                                                       error: type, message: str) -> None:
    """Each was accepted silently (a string of axis names read as its letters, a float64 input traced
    into float32 matmuls, more blocks than the model has read as all) or raised an AttributeError."""
    with pytest.raises(error, match=message):
        autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=lambda out: out.sum(),
                     **{"pipeline": False, **kwargs})
