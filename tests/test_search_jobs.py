"""benchmarks/search_jobs.py on a tiny job: a row planned with nothing pinned and as the planner did
before pipelines were searched by default, its median run and verdict. Planning only, no ranks."""

from __future__ import annotations

import torch

from benchmarks.search_jobs import JOBS, Job, median_run, plan_job, verdict
from examples import gpt


def _tiny() -> tuple[torch.nn.Module, tuple[torch.Tensor], dict[str, object]]:
    model, inputs, loss_fn, targets = gpt.build()
    return model, inputs, {"loss_fn": loss_fn, "example_targets": targets}


TINY = Job("tiny", "tiny GPT, 4 cpus", _tiny, {"dp": 4}, "cpu", 60.0)


def test_a_job_is_planned_new_and_as_before() -> None:
    new, today = plan_job(TINY, today=False), plan_job(TINY, today=True)
    assert "error" not in new and "error" not in today
    assert new["step_s"] <= today["step_s"]  # the default searches what pipeline=False planned, and more
    assert verdict(TINY, new, today) == "PASS"
    assert verdict(TINY, {**new, "seconds": 61.0}, today) == "SLOW"
    assert verdict(TINY, new, {**today, "step_s": new["step_s"] / 1.02}) == "PASS WORSE"


def test_an_open_mesh_row_is_planned_beside_its_hand_layout() -> None:
    """A row whose axes the planner chooses (``Mesh(devices=4)``) is compared with its hand layout."""
    job = Job("tiny-open", "tiny GPT, 4 cpus, axes open", _tiny, 4, "cpu", 60.0, today_mesh={"dp": 4})
    new, today = plan_job(job, today=False), plan_job(job, today=True)
    assert "error" not in new and "error" not in today
    assert new["step_s"] <= today["step_s"] * (1 + 1e-9)  # the layouts searched include dp4


def test_median_run_and_rows() -> None:
    runs = [{"seconds": s, "step_s": 1.0} for s in (3.0, 1.0, 2.0, 9.0)]
    assert median_run(runs)["seconds"] == 2.0 and median_run(runs)["all_seconds"] == [3.0, 1.0, 2.0, 9.0]
    assert len({j.name for j in JOBS}) == len(JOBS) and all(j.target_s > 0 for j in JOBS)
