"""Golden plans: the printed plan and every node's placements for the examples.

Compared exactly; refresh with ``AUTOPAR_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py``
and review the diff like code.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

import autopar
from autopar.result.plan import Plan
from autopar.result.table import render_text
from examples import gpt, llama
from tests.planning import assert_one_price

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
        times = f" x{c.count}" if c.count > 1 else ""
        lines.append(f"  {c.phase} {c.kind} @{c.axis} {c.bytes} B{times}  {c.tensor} -> {c.consumer or '(grad sync)'}")
    return "\n".join(lines) + "\n"


def check_by_hand(plan: Plan) -> None:
    """What a golden plan prints, recomputed without autopar's cost code: the ILP objective is
    the predicted step time; each axis's gradient-bucket bytes are the local fp32 gradients of
    the parameters reduced there (from their printed shapes and placements); each axis's
    bytes sent follow the ring formulas (2(n-1)/n M for all-reduce, (n-1)/n M otherwise)."""
    assert_one_price(plan)
    axes = plan.mesh["axes"]
    sizes = list(axes.values())
    local = {}
    for n in plan.nodes:
        if n.op == "parameter":
            shards = math.prod(size for size, p in zip(sizes, re.findall(r"S\([^)]*\)|R|P", n.outputs[0]))
                               if p.startswith("S"))
            local[n.name] = math.prod(n.shapes[0]) // shards * 4
    for dim, axis in enumerate(axes):
        params = {p for b in plan.grad_buckets if b.mesh_dim == dim for p in b.params}
        buckets = [c for c in plan.collectives if c.consumer == "" and c.axis == axis]
        assert sum(c.bytes for c in buckets) == sum(local[p] for p in params)
        assert len(buckets) == math.ceil(sum(local[p] for p in params) / 2**20 / 25)
        n = axes[axis]
        sent = sum((2 if c.kind == "all_reduce" else 1) * (n - 1) / n * c.bytes * c.count for c in plan.collectives
                   if c.axis == axis)
        assert plan.predicted.comm_bytes[axis] == pytest.approx(sent)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_golden_plan(model_name: str, mesh_name: str) -> None:
    model, inputs, loss_fn, targets = MODELS[model_name]()
    plan = autopar.plan(model, autopar.Mesh(MESHES[mesh_name], "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets, pipeline=False)
    check_by_hand(plan)
    compare_golden(GOLDEN / f"plan_{model_name}_{mesh_name}.txt", dump(plan))


def compare_golden(path: Path, text: str) -> None:
    """``text`` equals the golden file (rewritten instead with AUTOPAR_UPDATE_GOLDEN=1)."""
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with AUTOPAR_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()


MEMORY_CASES = {
    "gpt_dp2_zero3_full_m2": ("gpt", {"dp": 2}, {"zero": {"dp": 3}, "checkpoint": "full", "micro_batches": 2}),
    "llama_dp2xtp2_zero2_selective": ("llama", {"dp": 2, "tp": 2}, {"zero": {"dp": 2}, "checkpoint": "selective"}),
}
"""Plans with pinned memory choices: micro-batches, checkpointing, ZeRO stages."""


def check_memory_by_hand(plan: Plan) -> None:
    """What the memory choices must show in a plan's collectives, checked without the cost code:
    the program's collectives run once per micro-batch and gradient buckets once; every forward
    collective feeding an op of a checkpointed block runs again as 'recompute'; a parameter
    gathered again in backward (an all-gather in the backward phase of a parameter's tensor)
    is listed in ``memory.regather``, and only ZeRO-3 lists any."""
    memory = plan.memory
    for c in plan.collectives:
        assert c.count == (1 if c.consumer == "" else memory.micro_batches), c
    module = {n.name: n.module for n in plan.nodes}
    in_block = {n for n, m in module.items() if any(m == b or m.startswith(b + ".") for b in memory.checkpoint_blocks)}
    key = lambda c: (c.kind, c.axis, c.bytes, c.tensor, c.consumer)  # noqa: E731
    # a group's collective (``cost.groups``) names its members' tensors and consumers, comma-separated
    inside = lambda c: all(name in in_block for name in c.consumer.split(","))  # noqa: E731
    recomputed = sorted(key(c) for c in plan.collectives if c.phase == "recompute")
    forward_in_blocks = sorted(key(c) for c in plan.collectives if c.phase == "forward" and inside(c))
    assert recomputed == forward_in_blocks
    params = {n.name for n in plan.nodes if n.op == "parameter"}
    regathered = {t for c in plan.collectives if c.phase == "backward" and c.kind == "all_gather" and not inside(c)
                  for t in c.tensor.split(",") if t in params}
    assert len(regathered) == len(memory.regather) and (not regathered or 3 in memory.zero.values())


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_golden_memory_plan(case: str) -> None:
    model_name, axes, pins = MEMORY_CASES[case]
    model, inputs, loss_fn, targets = MODELS[model_name]()
    plan = autopar.plan(model, autopar.Mesh(axes, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=False, **pins)
    check_by_hand(plan)
    check_memory_by_hand(plan)
    compare_golden(GOLDEN / f"plan_{case}.txt", dump(plan))
