"""The predicted step as a timeline (``autopar.result.trace``, ``plan.to_chrome_trace``,
``autopar plan --trace``): laid out from the plan's own figures, it ends at the predicted
step time, its waited collectives add up to the exposed communication and the rest to the
hidden; a tiny plan's spans are checked by hand. A pipelined plan is drawn per pp rank, from
the simulation its step time comes from."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.hardware import PROFILES
from autopar.result.spans import BESIDE, COMPUTE, WAITED
from autopar.result.trace import timeline
from autopar.result.trace_pipeline import pipeline_timeline
from examples import gpt, llama
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
                        example_targets=(torch.randn(64, d),), data_axes=("dp",), pipeline=False, **memory)
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
    assert main(["plan", "examples/gpt.py:build", "--mesh", "dp=2,tp=2", "--no-pipeline", "--trace", str(path)]) == 0
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


def _pipelined(schedule: str, mesh: dict[str, int], micro_batches: int = 4, **options: object) -> autopar.Plan:
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4))
    pipeline = autopar.Pipeline(axis="pp", schedule=schedule, micro_batches=micro_batches,
                                virtual_stages=2 if schedule in ("interleaved_1f1b", "zbv") else 1)
    return autopar.plan(model, autopar.Mesh(mesh, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=pipeline, **options)


def _by_track(events: list[dict], pid: int) -> dict[str, list[dict]]:
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
             and e["pid"] == pid}
    out: dict[str, list[dict]] = {}
    for e in sorted((e for e in events if e["ph"] == "X" and e["pid"] == pid), key=lambda e: e["ts"]):
        out.setdefault(names[e["tid"]], []).append(e)
    return out


@pytest.mark.parametrize("schedule, mesh, options", [
    ("1f1b", {"pp": 2, "dp": 2}, {"data_axes": ("dp",)}),
    ("zbv", {"pp": 2}, {}),
    ("interleaved_1f1b", {"pp": 2, "tp": 2}, {}),
])
def test_pipelined_trace_per_pp_rank(tmp_path: Path, schedule: str, mesh: dict[str, int], options: dict) -> None:
    """One process per pp rank: its stages' actions in the schedule's order with a bubble in every
    idle gap until it drains, its sends on point-to-point tracks, then its gradient buckets (the
    last stage's rank: and the summed loss's all-reduce), the wait for the loss and its update; the
    slowest rank's last span ends at the step time."""
    plan = _pipelined(schedule, mesh, **options)
    pipe = plan.pipeline
    path = tmp_path / "step.json"
    plan.to_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    per = math.prod(pipe.stage_mesh.values())
    assert sorted(procs) == list(range(pipe.size))
    for r, name in procs.items():
        ranks = f"rank {r}" if per == 1 else f"ranks {r * per}-{(r + 1) * per - 1}"
        assert name.startswith(f"pp rank {r} ({ranks} of the mesh; stages ")
    ends = []
    for r in range(pipe.size):
        tracks = _by_track(events, r)
        compute = tracks["compute"]
        sync = tracks.get("communication (waited for)", [])
        clock = sorted(compute + sync, key=lambda e: e["ts"])
        for a, b in zip(clock, clock[1:]):  # one bar after another, no gap left unexplained until the update
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], rel=1e-9, abs=1e-6)
        assert compute[0]["ts"] == 0 and compute[-1]["name"] == "optimizer step"
        assert compute[-1]["dur"] == pytest.approx(pipe.update_per_rank_s[r] * 1e6, rel=1e-9)
        mine = [s for s in pipe.stages if s.rank == r]
        forward = [e for e in compute if e["name"].startswith("F stage")]
        assert len(forward) == len(mine) * pipe.micro_batches
        assert sum(e["dur"] for e in forward) == pytest.approx(pipe.micro_batches * sum(s.forward_s for s in mine)
                                                               * 1e6)
        backward = sum(e["dur"] for e in compute if e["name"][:2] in ("B ", "I ", "W "))
        assert backward == pytest.approx(pipe.micro_batches * sum(s.backward_s for s in mine) * 1e6)
        waits = {"optimizer step", "bubble", f"waiting for the loss from pp rank {pipe.stages[-1].rank}"}
        assert all(e["name"] in waits or e["name"][:2] in ("F ", "B ", "I ", "W ") for e in compute)
        for track, bars in tracks.items():
            if track.startswith("point-to-point to pp rank"):
                assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in zip(bars, bars[1:]))
        loss_s = pipe.loss_s if r == pipe.stages[-1].rank else 0.0
        assert sum(e["dur"] for e in sync) == pytest.approx((pipe.grad_sync_per_rank_s[r] + loss_s) * 1e6, rel=1e-9)
        ends.append(max(e["ts"] + e["dur"] for bars in tracks.values() for e in bars))
    assert max(ends) == pytest.approx(plan.predicted.step_time_s * 1e6, rel=1e-9)
    assert any(e["name"] == "bubble" for e in events if e["ph"] == "X")
    if "dp" in mesh:
        bars = [e for e in events if e["ph"] == "X"]
        assert all(pipe.grad_sync_per_rank_s) and any(e["cat"] == "backward" and "buckets" in e["name"] for e in bars)


def test_pipelined_trace_sends_and_kinds() -> None:
    """ZB-V runs input and weight gradients apart (I, W) and hands values between the two stages
    of its middle rank in memory; 1F1B runs whole backwards (B) and sends every activation and
    gradient across its one cut."""
    zbv = pipeline_timeline(_pipelined("zbv", {"pp": 2}))
    names = {s.name.split(" ")[0] for spans in zbv for s in spans if s.track == COMPUTE}
    assert {"F", "I", "W"} <= names and "B" not in names
    sends = [s for spans in zbv for s in spans if s.track.startswith("point-to-point")]
    assert not [s for s in sends if s.args["stage"] == 1 and s.phase == "forward"]  # stage 1 -> 2 on rank 1
    one = _pipelined("1f1b", {"pp": 2})
    spans = pipeline_timeline(one)
    assert {s.name.split(" ")[0] for s in spans[0] if s.track == COMPUTE} == {"F", "B", "bubble", "optimizer"}
    assert len([s for s in spans[0] if s.track == "point-to-point to pp rank 1"]) == one.pipeline.micro_batches
    assert len([s for s in spans[1] if s.track == "point-to-point to pp rank 0"]) == one.pipeline.micro_batches


def test_pipelined_trace_tied_weight() -> None:
    """A weight tied between the first and the last stage: after its buckets each pp rank waits
    for the other (on ``compute``), then all-reduces its gradient with it (on the waited track, the
    plan's seconds), then updates; no gap is left unexplained and the step ends at the prediction."""
    model, inputs, loss_fn, targets = gpt.build(gpt.GPTConfig(vocab_size=64, max_seq_len=16, hidden=32, heads=2))
    model.lm_head.weight = model.wte.weight
    plan = autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets, data_axes=("dp",),
                        pipeline=autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=2))
    (weight,) = plan.pipeline.tied
    ends = []
    for r, spans in enumerate(pipeline_timeline(plan)):
        tied = [s for s in spans if s.name.startswith("tied weights")]
        assert [(s.track, s.args["weights"]) for s in tied] == [(WAITED, ["wte.weight"])]
        assert tied[0].seconds == pytest.approx(weight.time_s, rel=1e-9)
        clock = sorted((s for s in spans if s.track in (COMPUTE, WAITED)), key=lambda s: s.start_s)
        for a, b in zip(clock, clock[1:]):
            assert b.start_s == pytest.approx(a.start_s + a.seconds, rel=1e-9, abs=1e-12), (a.name, b.name)
        ends.append(clock[-1].start_s + clock[-1].seconds)
    waits = [s for spans in pipeline_timeline(plan) for s in spans if s.name.startswith("waiting for the pp ranks")]
    assert len(waits) == 1  # the rank whose pipeline drained first waits for the other
    assert max(ends) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
