"""Golden plans: the printed plan and every node's placements for the examples.

Compared exactly; refresh with ``AUTOPAR_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py``
and review the diff like code.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import autopar
from autopar.solver.plan import Plan
from autopar.solver.report import render_text
from examples import gpt, llama

GOLDEN = Path(__file__).parent / "golden"
MODELS = {"gpt": gpt.build, "llama": llama.build}
MESHES = {"dp2": {"dp": 2}, "tp4": {"tp": 4}, "dp2xtp2": {"dp": 2, "tp": 2}}


def dump(plan: Plan) -> str:
    lines = [render_text(plan, width=110), "nodes (outputs <- inputs):"]
    for n in plan.nodes:
        mark = "  [fallback]" if n.fallback else ""
        lines.append(f"  {n.name}: {n.op} {' '.join(n.outputs)} <- {' '.join(n.inputs) or '-'}{mark}")
    lines.append("collectives:")
    for c in plan.collectives:
        lines.append(f"  {c.phase} {c.kind} @{c.axis} {c.bytes} B  {c.tensor} -> {c.consumer or '(grad sync)'}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_golden_plan(model_name: str, mesh_name: str) -> None:
    model, inputs, loss_fn, targets = MODELS[model_name]()
    plan = autopar.plan(model, autopar.Mesh(MESHES[mesh_name], "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets)
    text = dump(plan)
    path = GOLDEN / f"plan_{model_name}_{mesh_name}.txt"
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with AUTOPAR_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()
