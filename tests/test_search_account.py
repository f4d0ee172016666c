"""The search's account (``Plan.account``, ``autopar plan --verbose``) and its progress line: what each
level tried, what came of it and why."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.cli.main import main
from examples import gpt

MiB = 2**20


def _plan(**options: object) -> autopar.Plan:
    model, inputs, loss_fn, targets = gpt.build(batch=2)
    return autopar.plan(model, autopar.Mesh({"dp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        offload=False, pipeline=False, **options)


def test_a_plan_with_memory_to_spare_says_its_first_scenario_was_chosen() -> None:
    plan = _plan()
    memory = [r for r in plan.account if r.level == "memory"]
    assert [(r.outcome, r.seconds) for r in memory] == [("chosen", pytest.approx(plan.predicted.step_time_s))]
    assert [r.outcome for r in plan.account if r.level == "ilp"] == ["optimal"]


def test_a_memory_search_accounts_for_every_scenario_it_reached() -> None:
    """Under a binding limit: each scenario reached once, one chosen (the plan's), the others planned, pruned,
    bounded out or not fitting with why; every ILP listed with its size."""
    plan = _plan(memory_limit=9.3 * MiB)
    memory = [r for r in plan.account if r.level == "memory"]
    assert len({r.item for r in memory}) == len(memory) > 1
    chosen = [r for r in memory if r.outcome == "chosen"]
    assert len(chosen) == 1 and chosen[0].seconds == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert {r.outcome for r in memory} <= {"chosen", "planned", "pruned", "bounded out", "does not fit", "failed"}
    assert all(r.detail for r in memory if r.outcome != "chosen")
    ilps = [r for r in plan.account if r.level == "ilp"]
    assert len(ilps) > 1 and all("variables" in r.detail for r in ilps if not r.outcome.startswith("no plan"))
    assert autopar.Plan.from_json(json.loads(json.dumps(plan.to_json()))).account == plan.account


def test_progress_runs_the_same_search(capsys: pytest.CaptureFixture[str]) -> None:
    assert _plan(progress=True).plan_hash() == _plan().plan_hash()


def test_the_command_line_prints_the_account_with_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "examples/gpt.py:build", "--mesh", "dp=2", "--hardware", "cpu", "--verbose", "--width", "200"])
    out = capsys.readouterr().out
    assert code == 0 and "search account" in out and "chosen" in out
