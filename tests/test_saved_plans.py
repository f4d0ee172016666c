"""Plans kept and run: ``Plan.from_json(plan.to_json())`` is the plan, ``search.replay`` makes a saved plan
again for its step without searching (refusing one made for another step or mesh, saying what differs),
and ``autopar.compile(..., plan=..., pipeline=False)`` runs it on ranks with no ILP solved."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.result.plan import Plan
from autopar.runtime.forked import run_ranks
from autopar.search.replay import replay
from examples import gpt, llama
from tests.planning import problems

GPT = gpt.GPTConfig(layers=2)


def _gpt(**options: Any) -> tuple[autopar.Plan, tuple[Any, ...]]:
    built = gpt.build(GPT)
    model, inputs, loss_fn, targets = built
    return autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets, **options), built


def _through_json(plan: Plan) -> Plan:
    return Plan.from_json(json.loads(json.dumps(plan.to_json())))


@pytest.mark.parametrize("options", [{}, {"zero": {"dp": 3}, "checkpoint": "full", "micro_batches": 2}],
                         ids=["free", "pinned"])
def test_a_plan_read_back_from_its_json_is_the_plan(options: dict[str, Any]) -> None:
    plan, _ = _gpt(**options)
    again = _through_json(plan)
    assert again == plan
    assert again.plan_hash() == plan.plan_hash() and str(again) == str(plan)
    assert again.source is not None and again.source.choice


def test_a_pipelined_plan_round_trips_and_is_made_again_without_searching() -> None:
    """A pipeline whose schedule and micro-batches the planner chose, read back from JSON and replayed:
    the same plan, its stages cut where the search cut them."""
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4), batch=8)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, "cpu")
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=autopar.Pipeline(axis="pp", schedule="1f1b"))
    assert plan.pipeline is not None
    again = _through_json(plan)
    assert again == plan
    made = replay(problems(model, inputs, loss_fn=loss_fn, example_targets=targets), mesh, again)
    assert made.plan.plan_hash() == plan.plan_hash()
    assert [s.blocks for s in made.plan.pipeline.stages] == [s.blocks for s in plan.pipeline.stages]
    assert made.plan.pipeline.stage_of == plan.pipeline.stage_of != {}  # what the runtime cuts by: not in the JSON


def test_a_plan_for_another_step_or_mesh_is_refused_with_what_differs() -> None:
    plan, (model, inputs, loss_fn, targets) = _gpt(pipeline=False)  # a pipeline's mesh has its pp axis too
    wider = gpt.build(gpt.GPTConfig(layers=2, hidden=GPT.hidden * 2))
    with pytest.raises(autopar.InputError, match="made for another step"):
        replay(problems(wider[0], wider[1], loss_fn=wider[2], example_targets=wider[3]),
               autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), plan)
    with pytest.raises(autopar.InputError, match=r"made for a mesh \{'dp': 2, 'tp': 2\}; this mesh is \{'dp': 4\}"):
        replay(problems(model, inputs, loss_fn=loss_fn, example_targets=targets), autopar.Mesh({"dp": 4}, "cpu"),
               plan)
    with pytest.raises(autopar.InputError, match="made for the mesh"):  # other hardware: other prices, other plan
        replay(problems(model, inputs, loss_fn=loss_fn, example_targets=targets),
               autopar.Mesh({"dp": 2, "tp": 2}, "h100"), plan)


def _run_saved(rank: int, world: int, saved: dict[str, Any]) -> dict[str, Any]:
    from autopar.capture import export
    from autopar.search import ilp

    solves, traces = [], []
    real, trace = ilp.solve_ilp, export._captured

    def counted(*args: Any, **kwargs: Any) -> Any:
        solves.append(1)
        return real(*args, **kwargs)

    def traced(*args: Any, **kwargs: Any) -> Any:
        traces.append(1)
        return trace(*args, **kwargs)
    ilp.solve_ilp, export._captured = counted, traced  # this forked process only
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, inputs, loss_fn, targets = gpt.build(GPT)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, plan=saved, pipeline=False)
    out: dict[str, Any] = {"solves": len(solves), "hash": pm.plan.plan_hash(), "notes": pm.plan.notes,
                           "loss": pm(*inputs, *targets).full_tensor().item(), "traces": len(traces)}
    # the model compiled again in this process: its capture is kept (``capture.kept``), the plan the same
    again = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, plan=saved, pipeline=False)
    out.update(traces_again=len(traces) - out["traces"], hash_again=again.plan.plan_hash(),
               loss_again=again(*inputs, *targets).full_tensor().item())
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with pytest.raises(autopar.InputError, match="the plan runs on a mesh") as info:
        autopar.compile(model, other, inputs, loss_fn=loss_fn, example_targets=targets, plan=saved, pipeline=False)
    out["refused"] = str(info.value)
    return out


def test_compile_runs_a_saved_plan_without_solving() -> None:
    """The CLI's ``--json`` (``Plan.to_json``) handed to ``compile``: no rank solves an ILP, every rank runs
    the saved plan (its notes as saved), the loss is the single device's; compiled again in the process,
    the model is not traced again and runs alike; on another mesh it is refused."""
    plan, (model, inputs, loss_fn, targets) = _gpt(pipeline=False)  # a module called as pm(...), not pm.step
    saved = json.loads(json.dumps(plan.to_json()))
    results = run_ranks(_run_saved, 4, saved)
    assert [r["solves"] for r in results] == [0] * 4
    assert {r["hash"] for r in results} == {r["hash_again"] for r in results} == {plan.plan_hash()}
    assert [(r["traces"], r["traces_again"]) for r in results] == [(1, 0)] * 4
    assert all(r["loss_again"] == r["loss"] for r in results)
    assert all(r["notes"] == plan.notes for r in results)
    expected = loss_fn(model(*inputs), *targets).item()
    assert [r["loss"] for r in results] == pytest.approx([expected] * 4, rel=1e-5)
    assert all("{'dp': 2, 'tp': 2}" in r["refused"] for r in results)


def test_an_infinite_memory_limit_survives_json() -> None:
    plan, _ = _gpt(memory_limit=math.inf)
    assert _through_json(plan).memory_limit_bytes == math.inf
