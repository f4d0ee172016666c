"""The predicted step as a timeline (``autopar.solver.trace``, ``plan.to_chrome_trace``,
``autopar plan --trace``): laid out from the plan's own figures, it ends at the predicted
step time, its waited collectives add up to the exposed communication and the rest to the
hidden; a tiny plan's spans are checked by hand."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.hardware import PROFILES
from autopar.solver.trace import BESIDE, COMPUTE, WAITED, timeline
from examples import gpt
from tiny_models import Stack


def _check_sums(plan: autopar.Plan) -> list:
    spans = timeline(plan)
    pred = plan.predicted
    end = max(s.start_s + s.seconds for s in spans if s.track != BESIDE)
    assert end == pytest.approx(pred.step_time_s, rel=1e-9)
    assert sum(s.seconds for s in spans if s.track == COMPUTE) == pytest.approx(pred.compute_time_s, rel=1e-9)
    assert sum(s.seconds for s in spans if s.track == WAITED) == pytest.approx(pred.comm_time_s, rel=1e-9, abs=1e-15)
    assert sum(s.seconds for s in spans if s.track == BESIDE) == pytest.approx(pred.hidden_comm_time_s, rel=1e-9,
                                                                             abs=1e-15)
    on_clock = sorted((s for s in spans if s.track != BESIDE), key=lambda s: s.start_s)
    for a, b in zip(on_clock, on_clock[1:]):  # compute and waited collectives never overlap
        assert b.start_s == pytest.approx(a.start_s + a.seconds, rel=1e-9, abs=1e-15)
    return spans


@pytest.mark.parametrize("memory", [dict(zero={"dp": 3}), dict(zero={"dp": 3}, micro_batches=2),
                                    dict(zero={"dp": 0}), dict(zero={"dp": 1})])
def test_timeline_adds_up_to_the_prediction(memory: dict) -> None:
    """ZeRO-3 windows (with and without micro-batches), DDP's buckets beside backward,
    ZeRO-1's optimizer-step collectives."""
    hw = dataclasses.replace(PROFILES["h100"], grad_sync_overlap=0.05)  # partly hidden windows
    d = 256
    plan = autopar.plan(Stack(d), autopar.Mesh({"dp": 2}, hardware=hw), (torch.randn(64, d),), loss_fn=F.mse_loss,
                        example_targets=(torch.randn(64, d),), data_axes=("dp",), **memory)
    spans = _check_sums(plan)
    micro_batches = memory.get("micro_batches", 1)
    forward = [s for s in spans if s.track == COMPUTE and s.phase == "forward"]
    assert {s.args["micro_batch"] for s in forward} == set(range(micro_batches))
    if memory["zero"]["dp"] == 3:  # some windowed gather runs partly beside compute, partly waited
        assert any(s.track == BESIDE for s in spans) and any(s.track == WAITED for s in spans)
    if memory["zero"]["dp"] == 1:
        assert [s.phase for s in spans if s.track == WAITED][-2:] == ["optimizer", "optimizer"]


def test_one_linear_by_hand() -> None:
    """One linear on dp=2, replicated weight (DDP): forward, backward, the one gradient
    bucket (an all-reduce of the weight's gradient, wholly after backward when nothing
    overlaps) and the update: four spans back to back, in that order."""
    hw = dataclasses.replace(PROFILES["h100"], grad_sync_overlap=0.0)
    model = nn.Linear(64, 64, bias=False)
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, hardware=hw), (torch.randn(8, 64),), loss_fn=F.mse_loss,
                        example_targets=(torch.randn(8, 64),), data_axes=("dp",), zero={"dp": 0})
    spans = _check_sums(plan)
    linear = next(n for n in plan.nodes if n.op == "aten.linear.default")
    bucket = next(c for c in plan.collectives if c.consumer == "")
    assert bucket.kind == "all_reduce" and bucket.bytes == 64 * 64 * 4  # fp32 gradients (h100: bf16 compute)
    ops = [(s.track, s.phase, s.args.get("node")) for s in spans if s.args.get("node") in (linear.name, None)
           or s.track != COMPUTE]
    assert ops[0] == (COMPUTE, "forward", linear.name) and (COMPUTE, "backward", linear.name) in ops
    assert ops[-2][0] == WAITED and ops[-2][1] == "backward" and ops[-1] == (COMPUTE, "optimizer", None)
    assert spans[-1].seconds == pytest.approx(sum(n.update_s for n in plan.nodes), rel=1e-12)


def test_chrome_trace_file_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autopar.cli.main import main
    path = tmp_path / "step.json"
    assert main(["plan", "examples/gpt.py:build", "--mesh", "dp=2,tp=2", "--trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"compute", "communication (waited for)", "communication (beside compute)"} <= names
    assert any("ranks 0-3" in n for n in names)
    bars = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert bars and all(e["dur"] > 0 and e["ts"] >= 0 for e in bars)
    model, inputs, loss_fn, targets = gpt.build()
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}), inputs, loss_fn=loss_fn, example_targets=targets)
    end_us = max(e["ts"] + e["dur"] for e in bars if e["tid"] != 2)
    assert end_us == pytest.approx(plan.predicted.step_time_s * 1e6, rel=1e-6)
    assert "wrote the predicted step" in capsys.readouterr().out
