"""How deep to pipeline (``autopar.search.depth``): ``Pipeline(from_axis=...)`` takes the
pp ranks out of the mesh's first axis, each depth planned and the fastest that fits chosen;
planning only, no ranks (compile's side: tests/test_numerics_pipeline.py)."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from torch import nn

import autopar
import autopar.api
from autopar.errors import InputError
from test_numerics_pipeline import _Stack  # four residual MLP blocks and a head

SEARCH = autopar.Pipeline(axis="pp", from_axis="dp")
PINS = {"zero": {"dp": 0}, "offload": False}
"""Parameters whole on dp and no offload: without a pipeline the step cannot shed model state,
so a limit below it leaves only pipelines (each pp rank holds its stages' state)."""
KiB = 1024


def _plan(mesh: dict[str, int], pipeline: autopar.Pipeline | None = SEARCH, **options: Any) -> autopar.Plan:
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    return autopar.plan(_Stack(), autopar.Mesh(mesh, "cpu"), (x,), loss_fn=nn.functional.mse_loss,
                        example_targets=(y,), pipeline=pipeline, **options)


def test_depths_and_carved_axes() -> None:
    assert SEARCH.depths({"dp": 12, "tp": 2}) == [1, 2, 3, 4, 6, 12]
    assert SEARCH.carved({"dp": 12, "tp": 2}, 4) == {"pp": 4, "dp": 3, "tp": 2}
    assert SEARCH.carved({"dp": 12, "tp": 2}, 12) == {"pp": 12, "dp": 1, "tp": 2}
    assert not SEARCH.pinned and not autopar.Pipeline(schedule="gpipe", micro_batches=2, virtual_stages=1,
                                                      from_axis="dp").pinned


@pytest.mark.parametrize("pipeline, mesh, message", [
    (autopar.Pipeline(axis="pp", from_axis="dp"), {"tp": 2, "dp": 2}, r"first \(outermost\) axis"),
    (autopar.Pipeline(axis="pp", from_axis="data"), {"dp": 2}, "not an axis of the mesh"),
    (autopar.Pipeline(axis="pp", from_axis="dp"), {"dp": 2, "pp": 2}, "already an axis"),
    (autopar.Pipeline(axis="pp", from_axis="dp"), {"dp": 1, "tp": 2}, "1 device"),
    (autopar.Pipeline(axis="pp", from_axis="dp", schedule="zbv", virtual_stages=3), {"dp": 2}, "virtual_stages"),
])
def test_bad_depth_searches_are_refused(pipeline: autopar.Pipeline, mesh: dict[str, int], message: str) -> None:
    with pytest.raises(InputError, match=message):
        _plan(mesh, pipeline)


def test_ample_memory_keeps_the_step_unpipelined() -> None:
    """With room to spare the 4-block stack runs fastest as plain data parallelism (a pipeline
    pays its bubble); the plan is the one ``plan`` gives without a pipeline, and the note lists
    every depth with its time, or why none of its pipelines was played out (each rank's wait for the
    first micro-batch and its own work are already slower)."""
    plan = _plan({"dp": 4})
    assert plan.pipeline is None
    assert plan.plan_hash() == _plan({"dp": 4}, None).plan_hash()
    note = plan.notes[-1]
    assert note.startswith("pipeline depth search: 3 depths tried, chosen no pipeline")
    assert "pp=1 " in note
    assert all(f"pp={k} " in note or f"pp={k}: no pipeline of it predicts less than" in note for k in (2, 4))


def test_a_tight_limit_chooses_the_fastest_fitting_depth() -> None:
    """Below the unpipelined step's least memory (its model state whole: ``PINS``) only pipelines
    fit; the chosen one is the plan of the pipeline search on the carved mesh, priced alike,
    and no depth that fits is faster."""
    limit = 256 * KiB
    plan = _plan({"dp": 4}, memory_limit=limit, **PINS)
    assert plan.pipeline is not None and plan.predicted.peak_memory_bytes <= limit
    depth = plan.pipeline.size
    carved = _plan({"pp": depth, "dp": 4 // depth}, autopar.Pipeline(axis="pp"), memory_limit=limit, **PINS)
    assert plan.plan_hash() == carved.plan_hash()
    assert plan.predicted.step_time_s == carved.predicted.step_time_s
    for other in {2, 4} - {depth}:
        try:
            rival = _plan({"pp": other, "dp": 4 // other}, autopar.Pipeline(axis="pp"), memory_limit=limit, **PINS)
        except autopar.MemoryLimitError:
            continue
        assert rival.predicted.step_time_s >= plan.predicted.step_time_s
    # the unpipelined step, planned after the pipelines that fit without the limit, seeks only a faster plan
    assert re.search(r"pp=1: no plan of \d+ memory scenarios fits and predicts less than", plan.notes[-1])


def test_an_unpipelined_step_that_does_not_fit_is_planned_after_the_pipelines() -> None:
    """Under a limit that no plan made without it fits, the pipeline depths are planned under it first and
    bound the unpipelined step's memory search, though its free plan is the fastest (its model state is
    every rank's, a stage's share on a pipeline's); the fastest plan that fits is chosen all the same."""
    plan = _plan({"dp": 4}, memory_limit=64 * KiB)
    depths = [r.item for r in plan.account if r.level == "depth"]
    assert depths == ["pp=2", "pp=4", "pp=1", "pp=1"]  # planned in this order, then the one chosen
    assert plan.pipeline is None and plan.predicted.peak_memory_bytes <= 64 * KiB
    for depth in (2, 4):
        try:
            rival = _plan({"pp": depth, "dp": 4 // depth}, autopar.Pipeline(axis="pp"), memory_limit=64 * KiB)
        except autopar.MemoryLimitError:
            continue
        assert rival.predicted.step_time_s >= plan.predicted.step_time_s


class _Counts:
    """Stands in for a depth's counts planned under the limit (``search.pipeline.Limited``): each count's
    fastest free pipeline and the plan it gives under the limit, planned only while faster than the cutoff."""

    def __init__(self, depth: int, counts: list[tuple[float, float]], log: list[tuple[int, float, float]]) -> None:
        self.depth, self.counts, self.log, self.fitting_s = depth, counts, log, math.inf

    @property
    def done(self) -> bool:
        return not self.counts

    @property
    def next_s(self) -> float:
        return self.counts[0][0] if self.counts else math.inf

    def step(self, cutoff_s: float) -> None:
        free_s, limited_s = self.counts.pop(0)
        if free_s >= cutoff_s:
            self.counts.clear()
            return
        self.log.append((self.depth, free_s, cutoff_s))
        self.fitting_s = min(self.fitting_s, limited_s)


def test_depths_none_of_whose_pipelines_fit_take_their_counts_fastest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline depths planned under the limit take their micro-batch counts together, the fastest free
    pipelines of any depth first: pp=4's first count, planned before pp=2's second, bounds it out (planned
    depth after depth, pp=2's second count was planned, bounded only by pp=2's first)."""
    from types import SimpleNamespace

    from autopar.search import depth
    from autopar.search.account import Account
    from autopar.search.memory import TIE
    log: list[tuple[int, float, float]] = []
    counts = {2: _Counts(2, [(1.0, 5.0), (2.5, 2.4)], log), 4: _Counts(4, [(1.1, 2.0)], log)}
    monkeypatch.setattr(depth, "start_limited", lambda problems, unlimited, cutoff_s: counts[unlimited.depth])
    monkeypatch.setattr(depth, "end_limited", lambda problems, at: at)
    ended: dict[int, float] = {}
    monkeypatch.setattr(depth, "_record", lambda problems, k, at, found, skipped: ended.update({k: at.fitting_s}))
    turns = {k: SimpleNamespace(depth=k, fastest_s=c.next_s) for k, c in counts.items()}
    depth._in_turns(SimpleNamespace(account=Account()), turns, [1, 2, 4], {}, {}, math.inf)  # type: ignore[arg-type]
    assert log == [(2, 1.0, math.inf), (4, 1.1, 5.0 * (1 + 2 * TIE))]  # pp=2's second count (2.5 s) not planned
    assert ended == {2: 5.0, 4: 2.0}


def test_nothing_fitting_says_why_for_each_depth() -> None:
    with pytest.raises(autopar.MemoryLimitError, match=r"no pipeline depth on dp=2 .*pp=1: .*pp=2: "):
        _plan({"dp": 2}, memory_limit=16 * KiB, **PINS)


def test_depths_share_their_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """One capture with a symbolic micro-batch prices every count at every depth (``capture.symbolic``,
    standing in for the concrete captures: ``Problems.stand_in``); the whole batch is captured concretely
    once for all depths (the mesh does not change the graph), and the plan found at its own size."""
    calls: list[int] = []
    symbolic: list[int] = []
    real = torch.export.export

    def counted(step: nn.Module, args: tuple[Any, ...], **kwargs: Any) -> Any:
        (symbolic if kwargs.get("dynamic_shapes") else calls).append(args[0].shape[0])
        return real(step, args, **kwargs)
    monkeypatch.setattr(torch.export, "export", counted)
    plan = _plan({"dp": 4})
    assert plan.source is not None
    assert sorted(calls) == sorted(set(calls))
    assert set(calls) == {8, 8 // plan.source.micro_batches}  # the whole batch, and the plan's micro-batch
    assert len(symbolic) == 1


def test_a_depth_outpaced_is_not_planned_under_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """When no pipeline planned without the limit fits and none beats the cutoff (the best plan of
    another depth), the stage mesh is not solved again under the limit: the search says so."""
    from autopar.search import stage_plans
    from autopar.search.memory import Pruned
    from autopar.search.pipeline import search_pipeline
    from tests.planning import problems
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    limits: list[float] = []
    real = stage_plans.StageMesh.plan

    def recorded(self: Any, m: int, limit: float, *args: Any) -> Any:
        limits.append(limit)
        return real(self, m, limit, *args)
    monkeypatch.setattr(stage_plans.StageMesh, "plan", recorded)
    store = problems(_Stack(), (x,), loss_fn=nn.functional.mse_loss, example_targets=(y,))
    found = search_pipeline(store, autopar.Pipeline(axis="pp"), autopar.Mesh({"pp": 2, "dp": 2}, "cpu"), 100 * KiB,
                            cutoff_s=1e-9)
    assert isinstance(found, Pruned) and "no faster" in found.reason
    assert limits and all(limit == float("inf") for limit in limits)  # the free stage plans only


def test_depths_beyond_the_units_are_not_planned() -> None:
    """The stack cuts into 6 units (head, 4 blocks, tail): 8 pp ranks are not planned."""
    plan = _plan({"dp": 8})
    assert "pp=8: more pp ranks than the 6 units" in plan.notes[-1]


def test_each_free_ilp_is_solved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a limit that binds, a stage plan's ILP without the memory row serves both its count's free
    pipelines and its memory search under the limit (``Problems.solved_free``): no free ILP twice."""
    from autopar.search import ilp, memory

    free: list[tuple[Any, ...]] = []
    real = ilp.solve

    def counted(problem: Any, memory_limit: float | None, **kwargs: Any) -> Any:
        if memory_limit is None and not any(kwargs.get(k) for k in ("minimize_memory", "relaxed", "fixed")):
            free.append((problem.ctx.mesh.describe(), problem.ctx.micro_batches, problem.scenario))
        return real(problem, memory_limit, **kwargs)
    for module in (ilp, memory):
        monkeypatch.setattr(module.ilp if module is memory else module, "solve", counted)
    plan = _plan({"dp": 4}, memory_limit=256 * KiB, **PINS)
    assert plan.pipeline is not None and free
    assert len(free) == len(set(free)), sorted(free, key=str)


def test_stage_plans_that_cannot_beat_another_depths_plan_are_not_solved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the seconds of a plan found elsewhere (another depth's), each count's stage plan is bounded by
    its LP relaxation before it is solved: p x the cutoff under it, no pipeline of that count beats the cutoff
    (a pipeline's ranks' work adds up to its stage plan's step). A cutoff nothing beats solves no stage plan
    and prunes the depth; a cutoff just above the fastest pipeline keeps it."""
    from autopar.search import ilp
    from autopar.search.memory import Pruned
    from autopar.search.pipeline import unlimited_pipelines
    from tests.planning import problems
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    solved: list[int] = []
    real = ilp.solve

    def counted(problem: Any, memory_limit: float | None, **kwargs: Any) -> Any:
        if not any(kwargs.get(k) for k in ("minimize_memory", "relaxed", "fixed")):
            solved.append(problem.ctx.micro_batches)
        return real(problem, memory_limit, **kwargs)
    monkeypatch.setattr(ilp, "solve", counted)

    def search(cutoff_s: float) -> Any:
        store = problems(_Stack(), (x,), loss_fn=nn.functional.mse_loss, example_targets=(y,))
        return unlimited_pipelines(store, autopar.Pipeline(axis="pp"), autopar.Mesh({"pp": 2, "dp": 2}, "cpu"),
                                   float("inf"), cutoff_s)
    bounded = search(1e-9)
    assert isinstance(bounded, Pruned) and bounded.bounded and not solved
    assert "micro-batch counts bounded" in bounded.reason
    free = search(float("inf"))
    kept = search(free.fastest_s * 1.001)
    assert not isinstance(kept, Pruned) and kept.fastest_s == free.fastest_s


def test_counts_beyond_the_first_are_solved_only_once_a_cutoff_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no pipeline of the counts first solved fits the limit, the depth's other counts' free stage plans
    (each bounding its count's plans under the limit) are solved in the depth search's second round, when
    the best plan that fits elsewhere is known: against a cutoff nothing beats, none of them is solved (each
    is bounded by its LP relaxation); with none, every count is."""
    from autopar.search import ilp
    from autopar.search.memory import Pruned
    from autopar.search.pipeline import limited_pipeline, unlimited_pipelines
    from tests.planning import problems
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randn(32, 8)
    solved: list[int] = []
    real = ilp.solve

    def counted(problem: Any, memory_limit: float | None, **kwargs: Any) -> Any:
        if memory_limit is None and not any(kwargs.get(k) for k in ("minimize_memory", "relaxed", "fixed")):
            solved.append(problem.ctx.micro_batches)
        return real(problem, memory_limit, **kwargs)
    monkeypatch.setattr(ilp, "solve", counted)

    def first_round() -> Any:
        store = problems(_Stack(), (x,), loss_fn=nn.functional.mse_loss, example_targets=(y,))
        found = unlimited_pipelines(store, autopar.Pipeline(axis="pp"), autopar.Mesh({"pp": 2, "dp": 2}, "cpu"),
                                    100 * KiB)
        assert not isinstance(found, Pruned) and found.none_fit
        return store, found
    store, unlimited = first_round()
    first = set(solved)
    assert first < set(unlimited.search.counts)  # some counts are left for the second round
    solved.clear()
    pruned = limited_pipeline(store, unlimited, cutoff_s=1e-9)
    assert isinstance(pruned, Pruned) and not solved
    assert set(unlimited.search.bounded) == set(unlimited.search.counts) - first
    store, unlimited = first_round()
    solved.clear()
    limited_pipeline(store, unlimited)
    assert set(unlimited.search.counts) - first <= set(solved)


def test_counts_a_bounded_count_divides_are_bounded_without_a_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a count's stage plan is bounded out, each count it divides is bounded out with no capture, LP or
    solve of its own (its free optimum is no less: ``PipelineSearch.free_plan``)."""
    from autopar.search import ilp
    from autopar.search.memory import Pruned
    from autopar.search.pipeline import limited_pipeline, unlimited_pipelines
    from tests.planning import problems
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randn(32, 8)
    asked: list[int] = []
    real = ilp.solve

    def counted(problem: Any, memory_limit: float | None, **kwargs: Any) -> Any:
        asked.append(problem.ctx.micro_batches)
        return real(problem, memory_limit, **kwargs)
    monkeypatch.setattr(ilp, "solve", counted)
    store = problems(_Stack(), (x,), loss_fn=nn.functional.mse_loss, example_targets=(y,))
    unlimited = unlimited_pipelines(store, autopar.Pipeline(axis="pp"), autopar.Mesh({"pp": 2, "dp": 2}, "cpu"),
                                    100 * KiB)
    assert not isinstance(unlimited, Pruned) and unlimited.none_fit
    asked.clear()
    assert isinstance(limited_pipeline(store, unlimited, cutoff_s=1e-9), Pruned)
    bounded = unlimited.search.bounded
    assert bounded == sorted(bounded) and len(bounded) >= 2
    assert asked == [bounded[0]]  # the first LP rules out the rest, each a multiple of it
    assert all(m % bounded[0] == 0 for m in bounded)
    reasons = [r.detail for r in store.account.rows if r.outcome == "bounded out"]
    assert any(f"no faster than m={bounded[0]}" in why for why in reasons)


@pytest.mark.parametrize("mesh", [{"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "tp": 2}])
def test_more_micro_batches_never_make_a_stage_plan_faster(mesh: dict[str, int]) -> None:
    """What bounding a count by a count dividing it rests on: the free stage plan's optimum does not fall as
    each micro-batch is cut into equal parts."""
    from autopar.search.stage_plans import StageMesh
    from tests.planning import problems
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randn(32, 8)
    store = problems(_Stack(), (x,), loss_fn=nn.functional.mse_loss, example_targets=(y,))
    stage = StageMesh(store, autopar.Pipeline(axis="pp"), autopar.Mesh(mesh, "cpu"))
    seconds = {m: stage.plan(m, float("inf")).plan.predicted.step_time_s for m in (2, 4, 8, 16)}
    for k in seconds:
        for m in seconds:
            if m > k and m % k == 0:
                assert seconds[m] >= seconds[k] * (1 - 1e-9), (k, m, seconds)
