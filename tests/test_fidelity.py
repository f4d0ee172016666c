"""benchmarks/fidelity.py, calibrate_gpu.py and gpu_check.py at tiny sizes on the CPU (issue 31):
each published-run row is planned pinned and compared, a calibration writes a profile that
load_profile reads back and plans with, and the one-GPU check runs its compiled and eager steps
on a one-rank gloo group (in a process of its own, as a user runs it: a process group's threads
left in this one would be forked into every later test's ranks, which can hang there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar
from autopar.hardware import load_profile
from benchmarks import calibrate_gpu, fidelity, step_terms, titan_llama
from benchmarks.fidelity_runs import MegatronRun, TitanRun
from examples import gpt

TINY_TITAN = titan_llama.TitanConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_multiplier=1.0, multiple_of=32,
                                     vocab=256, seq=32)


def test_a_titan_row_is_planned_pinned_with_a_band_and_reserved_memory() -> None:
    run = TitanRun(name="tiny titan", config=TINY_TITAN, axes={"dp": 8}, batch=16, measured_tps=1e6,
                   measured_gib=1.0, checkpoint="selective")
    row = fidelity.titan_row(run, plan_float8=False)
    assert row.predicted is not None and row.band is not None and row.band[0] <= row.predicted <= row.band[1]
    assert row.error == pytest.approx(row.predicted / 1e6 - 1) and row.eager and row.fits
    assert row.predicted_gib is not None and row.predicted_gib > 0


def test_a_titan_rows_step_terms_add_up_to_its_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    """``--terms``: the predicted step split by what runs sums to the step the row's prediction is
    made of (tokens per GPU = local tokens / step)."""
    run = TitanRun(name="tiny titan", config=TINY_TITAN, axes={"dp": 8}, batch=16, measured_tps=1e6,
                   measured_gib=1.0, checkpoint="selective_op")
    row = fidelity.titan_row(run, plan_float8=False)
    step_s = sum(row.terms[f] for f in step_terms.FAMILIES)
    assert row.predicted == pytest.approx(2 * TINY_TITAN.seq / step_s, rel=1e-9)
    assert all(row.terms[f] >= 0 for f in step_terms.FAMILIES) and row.terms["matmul"] > 0
    assert row.terms["attention"] > 0 and row.terms["optimizer"] > 0
    fidelity.report([row], terms=True)
    assert "matmul" in capsys.readouterr().out
    assert step_terms.family("aten.linear.default") == "matmul"
    assert step_terms.family("aten.scaled_dot_product_attention.default") == "attention"
    assert step_terms.family("aten.mul.Tensor") == "memory-bound"


def test_a_float8_row_is_listed_and_left_out() -> None:
    run = TitanRun(name="tiny float8", config=TINY_TITAN, axes={"dp": 8}, batch=16, measured_tps=1.0,
                   measured_gib=1.0, checkpoint="full", float8=True, eager=False)
    row = fidelity.titan_row(run, plan_float8=False)
    assert row.excluded.startswith("float8") and row.predicted is None and row.error is None


@pytest.mark.parametrize("tp, pp, zero3", [(2, 2, False), (1, 1, True)])
def test_a_megatron_row_prices_its_published_layout(tp: int, pp: int, zero3: bool) -> None:
    run = MegatronRun(name="tiny megatron", table="1", layers=4, hidden=64, heads=4, gpus=8, batch=16, tp=tp, pp=pp,
                      micro_batch=1 if pp > 1 else 2, measured_tflops=1.0, zero3=zero3, seq=32, vocab=256)
    row = fidelity.megatron_row(run)
    assert row.predicted is not None and row.predicted > 0 and row.fits
    assert (", ZeRO-3" in row.config) == zero3


def test_the_report_summarises_eager_rows(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [fidelity.Row(name="a", unit="u", config="c", measured=100.0, predicted=110.0, eager=True),
            fidelity.Row(name="b", unit="u", config="c", measured=100.0, predicted=130.0)]
    summary = fidelity.report(rows)
    assert summary["eager_within_tolerance"] is True and summary["mean_abs_error"] == pytest.approx(0.2)
    assert "a +10.0%" in capsys.readouterr().out


def test_calibration_writes_a_profile_load_profile_plans_with(tmp_path: Path) -> None:
    out = tmp_path / "measured.json"
    assert calibrate_gpu.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.name == "cpu-measured" and "calibrate_gpu.py on cpu" in profile.source
    assert profile.matmul_curve("bf16") is not None and len(profile.attention_efficiency) == 4
    assert json.loads(out.read_text())["base"] == "cpu"
    model, inputs, loss_fn, targets = gpt.build()
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, profile), inputs, loss_fn=loss_fn, example_targets=targets)
    assert plan.predicted.step_time_s > 0


def test_gpu_check_runs_compiled_and_eager_steps_on_one_rank(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--tiny", "--steps", "1",
                           "--warmup", "0", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["autopar"]["step_s"] > 0 and result["eager"]["step_s"] > 0
    assert result["autopar"]["predicted_step_s"] > 0 and result["profile"] == "cpu"


def test_a_zero3_row_autopar_cannot_shard_is_left_out() -> None:
    """dp=5 divides no dim of a width-64 model: autopar keeps the parameters replicated (DeepSpeed
    would pad), so the row is not the published layout and is listed, not compared."""
    run = MegatronRun(name="tiny zero3", table="2", layers=2, hidden=64, heads=4, gpus=5, batch=10, tp=1, pp=1,
                      micro_batch=2, measured_tflops=1.0, zero3=True, seq=32, vocab=256)
    row = fidelity.megatron_row(run)
    assert row.excluded.startswith("autopar cannot shard it on dp=5") and row.predicted is None
