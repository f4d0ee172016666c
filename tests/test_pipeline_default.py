"""Pipelines searched by default (``config.settled``): with nothing pinned, ``plan`` takes the depth out
of the mesh's first axis as ``Pipeline(from_axis=...)`` does; ``pipeline=False`` plans none; where another
option rules a pipeline out the default stands down and the account says why. Planning only, no ranks
(compile's side: tests/test_numerics_pipeline.py ``test_compile_chooses_the_depth_plan_chooses``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autopar
from autopar.config import PlanConfig, settled
from test_numerics_pipeline import _Stack  # four residual MLP blocks and a head

PINS = {"zero": {"dp": 0}, "offload": False}
"""As tests/test_pipeline_depth.py's: under a tight limit only pipelines fit."""
KiB = 1024


def _plan(mesh: dict[str, int], model: nn.Module | None = None, **options: Any) -> autopar.Plan:
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    options = {"loss_fn": nn.functional.mse_loss, **options}
    return autopar.plan(model or _Stack(), autopar.Mesh(mesh, "cpu"), (x,), example_targets=(y,), **options)


def _unsearched(plan: autopar.Plan) -> list[str]:
    return [r.detail for r in plan.account if r.level == "depth" and r.outcome == "not searched"]


def test_the_default_searches_the_depth_out_of_the_first_axis() -> None:
    """Nothing pinned is ``Pipeline(from_axis=<first axis>)``: the same plan, every depth in its notes (planned,
    or pruned where none of its pipelines can beat the plan without one)."""
    default = _plan({"dp": 4})
    asked = _plan({"dp": 4}, pipeline=autopar.Pipeline(from_axis="dp"))
    assert default.plan_hash() == asked.plan_hash() and default.notes == asked.notes
    assert default.notes[-1].startswith("pipeline depth search: 3 depths tried")
    depths = {r.item: r.outcome for r in default.account if r.level == "depth" and r.outcome in ("planned", "pruned")}
    assert depths.keys() == {"pp=1", "pp=2", "pp=4"} and depths["pp=1"] == "planned"


def test_the_default_search_is_deterministic() -> None:
    """Every depth, schedule and count searched, the same plan to the byte on every run."""
    a, b = (_plan({"dp": 4}, memory_limit=256 * KiB, **PINS).to_json() for _ in range(2))
    a.pop("timings"), b.pop("timings")
    assert a == b


def test_a_tight_limit_gets_a_pipeline_by_default() -> None:
    """Below the unpipelined step's least memory only a pipeline fits: the default finds it."""
    plan = _plan({"dp": 4}, memory_limit=256 * KiB, **PINS)
    assert plan.pipeline is not None and plan.predicted.peak_memory_bytes <= 256 * KiB
    asked = _plan({"dp": 4}, memory_limit=256 * KiB, pipeline=autopar.Pipeline(from_axis="dp"), **PINS)
    assert plan.plan_hash() == asked.plan_hash()


@pytest.mark.parametrize("off", [False, None])
def test_pipeline_false_plans_none(off: bool | None) -> None:
    plan = _plan({"dp": 4}, pipeline=off)
    assert plan.pipeline is None and not any(r.level == "depth" for r in plan.account)
    assert not any(n.startswith("pipeline depth search") for n in plan.notes)
    with pytest.raises(autopar.MemoryLimitError):
        _plan({"dp": 4}, memory_limit=256 * KiB, pipeline=off, **PINS)


@pytest.mark.parametrize("options, why", [
    ({"micro_batches": 2}, "micro_batches=2 with a pipeline"),
    ({"offload": True}, "does not yet offload"),
    ({"zero": {"dp": 1}}, "ZeRO-1"),
    ({"train": False}, "a forward-only step"),
])
def test_options_a_pipeline_cannot_run_beside_leave_it_unsearched(options: dict[str, Any], why: str) -> None:
    """What a pinned pipeline refuses as an error, the default takes as its reason to search none."""
    plan = _plan({"dp": 4}, **options)
    assert plan.pipeline is None and len(_unsearched(plan)) == 1 and why in _unsearched(plan)[0]


def _two_losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss no weight per micro-batch splits exactly (a mean plus a function of another mean, as an MoE's
    load-balancing term is)."""
    return nn.functional.mse_loss(out, y) + out.mean().pow(2)


def test_a_loss_micro_batches_do_not_split_plans_the_whole_batch() -> None:
    """Every pipeline runs micro-batches: for such a loss the default searches none, and no micro-batch count,
    saying why; a pinned pipeline or micro-batch count is refused at planning (not at the ranks' build)."""
    plan = _plan({"dp": 4}, loss_fn=_two_losses)
    assert plan.pipeline is None and plan.memory.micro_batches == 1
    why = _unsearched(plan)[0]
    assert "not a weighted sum of its micro-batches' losses" in why and "aten.add" in why
    with pytest.raises(autopar.MemoryLimitError):  # where only a pipeline fits (the case above)
        _plan({"dp": 4}, loss_fn=_two_losses, memory_limit=256 * KiB, **PINS)
    for pinned in ({"pipeline": autopar.Pipeline(from_axis="dp")}, {"micro_batches": 2, "pipeline": False}):
        with pytest.raises(autopar.InputError, match="not a weighted sum of its micro-batches' losses"):
            _plan({"dp": 4}, loss_fn=_two_losses, **pinned)


def test_a_first_axis_of_one_rank_or_a_pp_axis_leaves_it_unsearched() -> None:
    assert "one rank" in _unsearched(_plan({"dp": 1, "tp": 2}))[0]
    assert "names a 'pp' axis" in _unsearched(_plan({"pp": 2, "dp": 2}))[0]


def test_a_model_without_repeated_blocks_plans_as_before() -> None:
    """Nothing to cut into stages: the unpipelined plan, no depth note, the account saying why."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    plan = _plan({"dp": 2}, model)
    off = _plan({"dp": 2}, model, pipeline=False)
    assert plan.plan_hash() == off.plan_hash() and plan.notes == off.notes
    assert any(r.outcome == "pruned" and "no repeated blocks" in r.detail for r in plan.account)


def test_settled_spells_the_default_out() -> None:
    mesh = autopar.Mesh({"dp": 4, "tp": 2}, "cpu")
    config, why = settled(PlanConfig(), mesh)
    assert config.pipeline == autopar.Pipeline(from_axis="dp") and why == ""
    assert settled(PlanConfig(pipeline=False), mesh) == (PlanConfig(pipeline=None), "")
    pinned = autopar.Pipeline(axis="pp", schedule="gpipe")
    assert settled(PlanConfig(pipeline=pinned), mesh)[0].pipeline is pinned


def test_a_wrong_kind_of_pipeline_is_refused() -> None:
    with pytest.raises(autopar.InputTypeError, match="Pipeline"):
        _plan({"dp": 4}, pipeline="pp")
