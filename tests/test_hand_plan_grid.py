"""benchmarks/hand_plan_grid.py on a tiny GPT and a tiny grid: every grid point is priced by
autopar's own functions, points over the memory limit are skipped, and autopar's plan is no
slower than the best grid plan. Planning only, no ranks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import autopar
from autopar.capture import reuse_captures
from benchmarks.grid_pricing import Grid, GridResult, Point, Shape, build, pins, price_grid, price_point
from benchmarks.hand_plan_grid import autopar_plan
from examples import gpt

pytestmark = pytest.mark.slow

TINY = Shape(name="tiny GPT", config=gpt.GPTConfig(layers=4), devices=8, hardware="a100", batch=16)
GRID = Grid(tps=(2,), bs=(1, 2), vs=(2,), pps=(2,), checkpoints=("none",))


@pytest.fixture(scope="module")
def grid() -> GridResult:
    model, tokens = build(TINY)
    with reuse_captures():  # as the benchmark prices it
        return price_grid(TINY, model, tokens, GRID)


def test_a_grid_point_is_autopars_plan_of_it_pinned(grid: GridResult) -> None:
    """Each priced point's step time and peak are ``autopar.plan``'s of the same configuration pinned."""
    model, tokens = build(TINY)
    assert {(p.schedule, p.v) for p in grid.priced} == {("1f1b", 1), ("interleaved_1f1b", 2)}
    for p in grid.priced:
        if p.b != 1:
            continue
        plan = autopar.plan(model, autopar.Mesh({"pp": p.pp, "dp": p.dp, "tp": p.tp}, hardware="a100"), (tokens,),
                            pipeline=autopar.Pipeline(axis="pp", schedule=p.schedule, micro_batches=p.m,
                                                      virtual_stages=p.v), **pins(TINY, tokens, p))
        assert plan.predicted.step_time_s == pytest.approx(p.step_s, rel=1e-9)
        assert plan.predicted.peak_memory_bytes / 2**30 == pytest.approx(p.peak_gib, rel=1e-9)


def test_points_over_the_limit_are_skipped(grid: GridResult) -> None:
    """Under a limit between the grid's leanest and largest peak, the points above it are counted and
    left out, and no point is lost: each b is priced unless a smaller b had nothing that fit."""
    peaks = sorted(p.peak_gib for p in grid.priced)
    assert len(grid.priced) == 2 * 2 * 2 and grid.unfit == 0  # sp x b x (1f1b, interleaved v2)
    limit = (peaks[0] + peaks[-1]) / 2 * 2**30
    model, tokens = build(TINY)
    tight = price_grid(replace(TINY, memory_limit=limit), model, tokens, GRID)
    assert tight.unfit > 0 and all(p.peak_gib * 2**30 <= limit for p in tight.priced)
    assert len(tight.priced) + tight.unfit + 2 * tight.pruned_b == len(grid.priced)


def test_the_state_bound_prunes_without_planning() -> None:
    model, tokens = build(TINY)
    tiny_limit = replace(TINY, memory_limit=1.0)
    result = price_grid(tiny_limit, model, tokens, GRID)
    assert result.pruned_state == 1 and result.stage_plans == 0 and not result.priced


def test_autopar_is_no_slower_than_the_best_grid_plan(grid: GridResult) -> None:
    model, tokens = build(TINY)
    auto = autopar_plan(model, TINY.devices, TINY, tokens, (2,))
    assert grid.best is not None and auto.step_s is not None
    assert auto.step_s <= grid.best.step_s


def test_the_published_point_prices_alone() -> None:
    """A point outside the grid (Megatron's published configuration) is priced the same way."""
    model, tokens = build(TINY)
    point = Point(tp=2, pp=2, dp=2, sp=False, b=1, m=8, schedule="1f1b", v=1, checkpoint="full")
    priced = price_point(TINY, model, tokens, point)
    assert priced.key() == point.key() and priced.fits and math.isfinite(priced.step_s)
