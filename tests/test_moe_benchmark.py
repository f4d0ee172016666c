"""benchmarks/moe.py on a reduced MoE and a 4-device grid (ep, tp in {1, 2}; 2-D meshes: a 3-D one prices
~575k placement pairs, 20 s, which the benchmark itself pays): each grid point keeps its pinned expert
placements, and autopar's plan (on the same 4 devices) is no slower than any grid point priced. Planning
only, no ranks."""

from __future__ import annotations

import pytest

from benchmarks import moe as bench
from examples import moe

pytestmark = pytest.mark.slow

TINY = bench.Shape(name="tiny MoE", devices=4, batch=8, eps=(1, 2), tps=(1, 2), config=moe.MoEConfig(
    vocab_size=512, max_seq_len=128, hidden=512, heads=4, kv_heads=2, ffn_hidden=1024, layers=2, experts=8,
    top_k=2, capacity_factor=1.25, shared_expert=True))


@pytest.fixture(scope="module")
def grid() -> list[bench.Priced]:
    return bench.price_grid(TINY, bench.build(TINY), TINY.eps, TINY.tps)


def test_grid_points_keep_their_pinned_expert_placements(grid: list[bench.Priced]) -> None:
    """ep > 1: experts split by expert on ep; tp > 1: split on their ffn dim (w2's dim 1) on tp; else replicated."""
    assert {(p.ep, p.tp) for p in grid} == {(ep, tp) for ep in TINY.eps for tp in TINY.tps}
    for p in grid:
        for weight, ffn_dim in (("w1", 2), ("w2", 1), ("w3", 2)):
            part = next(s for s in p.experts.split("; ") if s.startswith(weight))
            assert ("ep:S(0)" in part) == (p.ep > 1), p
            assert (f"tp:S({ffn_dim})" in part) == (p.tp > 1), p
            assert ("dp:R" in part) == (p.dp > 1), p


def test_autopar_is_no_slower_than_every_grid_point(grid: list[bench.Priced]) -> None:
    auto = bench.autopar_plan(TINY, bench.build(TINY), (1, 2))
    assert auto.step_s is not None
    fitting = [p for p in grid if p.fits]
    assert fitting
    slower = [p for p in fitting if p.step_s < auto.step_s]
    assert not slower, (auto.step_s, slower)
