"""Where a pipeline's stages start among the model's units (``pipeline.stages.block_units``):
balanced by predicted seconds, or as pinned (``Pipeline.stage_blocks``)."""

from __future__ import annotations

import functools

from autopar.errors import InputError


def balanced_cuts(weights: list[float], stages: int) -> list[int]:
    """Start index of each stage's first unit: ``stages`` contiguous non-empty groups of
    ``weights`` whose heaviest group is lightest (earliest cuts among equals)."""
    return list(_balanced_cuts(tuple(weights), stages))


@functools.lru_cache(maxsize=256)
def _balanced_cuts(weights: tuple[float, ...], stages: int) -> tuple[int, ...]:
    """``balanced_cuts``, once per weights and count: a pipeline search cuts one stage plan for each schedule,
    those of one count of stages alike, and the program is O(stages x units^2)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest group of the first i units in k groups; start[k][i]: its last group's start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    start = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] * (1 - 1e-12):
                    best[k][i], start[k][i] = cost, j
    cuts, i = [], n
    for k in range(stages, 0, -1):
        i = start[k][i]
        cuts.append(i)
    return tuple(cuts[::-1])


def pinned_cuts(stage_blocks: tuple[tuple[str, ...], ...], blocks: list[str], stages: int) -> list[int]:
    """Start index of each stage's first unit as ``Pipeline.stage_blocks`` pins them; refuses
    a pin that is not ``stages`` non-empty runs of the model's units in order, each once."""
    given = [list(units) for units in stage_blocks]
    if len(given) != stages or any(not units for units in given) or [u for g in given for u in g] != blocks:
        raise InputError(f"pipeline stage_blocks {[list(g) for g in given]} must cut this step's units {blocks} "
                         f"into {stages} non-empty runs, in order, each unit once")
    starts, at = [], 0
    for units in given:
        starts.append(at)
        at += len(units)
    return starts
