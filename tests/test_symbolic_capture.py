"""A step captured once with its micro-batch size symbolic (``capture.symbolic``) and priced at
every size, and the pipeline search pricing micro-batch counts from one stage plan so
(``search.planned.repriced``, ``search.stage_plans.PipelineSearch.free_plans``); planning only, no ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import autopar
import autopar.capture.export
from autopar.capture import capture, reuse_captures
from autopar.capture.symbolic import SymbolicRefused
from autopar.cost.model import CostContext
from autopar.cost.precision import get_precision
from autopar.rules import DEFAULT_RULES
from autopar.problem.graph import build_plan_graph
from autopar.problem.nodes import PlanGraph
from autopar.api.planning import plan_step
from autopar.search import stage_plans
from autopar.search.planned import PlannedStep, repriced
from examples import llama, moe
from tests.planning import problem_at

pytestmark = pytest.mark.slow

MESH = autopar.Mesh({"dp": 2, "tp": 2}, "cpu")
BUILDS: dict[str, Callable[[int], tuple[Any, ...]]] = {
    "llama": lambda batch: llama.build(llama.LlamaConfig(layers=4), batch=batch),
    # its router computes (batch x seq) token counts: export names that arithmetic, shifting later nodes' names
    "moe": lambda batch: moe.build(batch=batch),
    # enough blocks to replicate: the first block makes that arithmetic, the others read it there
    "moe-replicated": lambda batch: moe.build(moe.MoEConfig(layers=4), batch=batch)}


def _graph(name: str, rows: int, symbolic: bool) -> PlanGraph:
    model, inputs, loss_fn, targets = _built(name)
    inputs, targets = tuple(t[:rows] for t in inputs), tuple(t[:rows] for t in targets)
    captured = capture(model, inputs, loss_fn=loss_fn, example_targets=targets, symbolic_batch=symbolic)
    ctx = CostContext(mesh=MESH, precision=get_precision("fp32", None), train=True)
    return build_plan_graph(captured, DEFAULT_RULES, ctx)


_BUILT: dict[str, tuple[Any, ...]] = {}


def _built(name: str) -> tuple[Any, ...]:
    """One model object per name (reuse_captures keys on it), with a batch of 8 to cut rows from."""
    return _BUILT.setdefault(name, BUILDS[name](8))


@pytest.mark.parametrize("name", BUILDS)
def test_a_symbolic_capture_at_each_size_is_that_size_captured(name: str) -> None:
    """One capture with the micro-batch symbolic, priced at 1, 2, 4, 6 and 8 rows, gives each node (by its place in
    graph order) the op, shapes, strategies and costs of the step captured at that size; the first projection's
    output is rows x seq x hidden fp32 values (counted by hand)."""
    model, (tokens,), _, _ = _built(name)
    exports: list[bool] = []
    real = torch.export.export

    def counted(*args: Any, **kwargs: Any) -> Any:
        exports.append(bool(kwargs.get("dynamic_shapes")))
        return real(*args, **kwargs)
    with reuse_captures(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "export", counted)
        for rows in (8, 4, 2, 6, 1):
            symbolic, concrete = _graph(name, rows, True), _graph(name, rows, False)
            assert len(symbolic.order) == len(concrete.order)
            for mine, theirs in zip(symbolic.order, concrete.order):
                a, b = symbolic.nodes[mine], concrete.nodes[theirs]
                assert (a.op, a.outputs, a.strategies, a.costs) == (b.op, b.outputs, b.strategies, b.costs), mine
            hidden = model.cfg.hidden
            assert concrete.nodes["linear"].costs[0].output_bytes == rows * tokens.shape[1] * hidden * 4
    assert exports.count(True) == 1 and exports.count(False) == 5  # one symbolic capture served every size


def test_blocks_reading_the_first_blocks_size_arithmetic_are_replicated() -> None:
    """The symbolic capture of blocks whose router computes (batch x seq) token counts traces 3 blocks and
    replicates the rest (the arithmetic, made in the first block and read by the others, runs before them);
    the test above finds it the concrete capture at each size."""
    model, inputs, loss_fn, targets = _built("moe-replicated")
    with reuse_captures():
        captured = capture(model, inputs, loss_fn=loss_fn, example_targets=targets, symbolic_batch=True)
    assert any("traced 3 of 4 blocks" in note for note in captured.notes), captured.notes


class _NoGradBlock(nn.Module):
    """A running mean updated under no_grad: export keeps the block as a higher-order op."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(y.mean(0) * 0.1)
        return y


class _Guarded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2 if x.shape[0] > 4 else self.lin(x)


@pytest.mark.parametrize("model, rows, why", [
    (_NoGradBlock(), 4, "higher-order subgraphs"),
    (_Guarded(), 8, "export could not keep the micro-batch symbolic"),
    (nn.Linear(8, 8), 1, "export specializes 1"),
], ids=["no-grad-block", "guard", "one-row"])
def test_what_cannot_be_captured_symbolic_says_why(model: nn.Module, rows: int, why: str) -> None:
    with pytest.raises(SymbolicRefused, match=why):
        capture(model, (torch.randn(rows, 8),), loss_fn=lambda y: y.sum(), symbolic_batch=True)


def _lm_loss(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """examples/moe.py's loss without its load-balancing term."""
    return torch.nn.functional.cross_entropy(output[0].flatten(0, 1), targets.flatten(0, 1))


@pytest.mark.parametrize("name", BUILDS)
def test_a_plan_repriced_at_its_own_size_is_the_plan(name: str) -> None:
    """The ILP's plan at 2 micro-batches priced again on the symbolic capture at that size predicts
    what the plan predicts (the same cost functions on the same shapes, nodes matched by place)."""
    model, inputs, loss_fn, targets = _built(name)
    if name.startswith("moe"):  # its load-balancing loss is no weighted sum of micro-batches' losses: refused
        loss_fn = _lm_loss
    options: dict[str, Any] = {"loss_fn": loss_fn, "example_targets": targets, "micro_batches": 2}
    step = plan_step(model, MESH, inputs, **options)
    again = repriced(problem_at(model, MESH, inputs, m=2, symbolic=True, **options), step)
    assert isinstance(again, PlannedStep)
    assert list(again.chosen.values()) == list(step.chosen.values())
    assert again.plan.predicted.step_time_s == pytest.approx(step.plan.predicted.step_time_s, rel=1e-12)
    assert again.plan.predicted.peak_memory_bytes == pytest.approx(step.plan.predicted.peak_memory_bytes, rel=1e-12)


def test_a_count_whose_micro_batch_cannot_take_the_plan_is_solved() -> None:
    """On pp=2 x tp=2, the m=2 plan splits the tokens on tp; at m=16 (one row) that split does not divide,
    so that count is solved, and the note says which strategy did not apply."""
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4), batch=16)
    plan = autopar.plan(model, autopar.Mesh({"pp": 2, "tp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets, pipeline=autopar.Pipeline(axis="pp"))
    note = next(n for n in plan.notes if n.startswith("pipeline search"))
    assert "m=16 (the strategies do not all apply there: flat_0 (input) has no strategy S(0)" in note, note


def _search(monkeypatch: pytest.MonkeyPatch, symbolic: bool) -> tuple[autopar.Plan, int]:
    solves = []
    real = stage_plans.search_context
    monkeypatch.setattr(stage_plans, "search_context", lambda *a, **k: solves.append(1) or real(*a, **k))
    if not symbolic:
        def refuse(*_: Any) -> Any:
            raise SymbolicRefused("refused by the test")
        monkeypatch.setattr(autopar.capture.export, "batch_shapes", refuse)
    model, inputs, loss_fn, targets = llama.build(llama.LlamaConfig(layers=4), batch=16)
    plan = autopar.plan(model, autopar.Mesh({"pp": 2}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=autopar.Pipeline(axis="pp"))
    return plan, len(solves)


def test_the_pipeline_search_prices_micro_batch_counts_without_solving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts 2, 4, 8 and 16 of a 16-row batch on pp=2: the ILP solved at the first count and at the one
    its repriced pipelines favour (4); m=8 and m=16 (micro-batches of one row) priced with the m=2 plan's
    strategies (the stage mesh's one axis has one rank: every placement there is whole, so each applies at
    every size). The same plan as solving every count."""
    plan, solves = _search(monkeypatch, symbolic=True)
    note = next(n for n in plan.notes if n.startswith("pipeline search"))
    assert ("m=4, 8, 16 priced with the m=2 stage plan's strategies on one capture with a symbolic micro-batch; "
            "the ILP solved at m=2 and m=4 (its priced pipeline fastest)" in note), note
    assert solves == 2
    with pytest.MonkeyPatch.context() as patch:
        every, all_solves = _search(patch, symbolic=False)
    assert all_solves == 4 and "every micro-batch count solved (no symbolic capture: refused by the test)" in \
        next(n for n in every.notes if n.startswith("pipeline search"))
    assert plan.plan_hash() == every.plan_hash()
