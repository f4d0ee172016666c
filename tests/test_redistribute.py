"""Redistribution steps move every placement to every other one correctly.

For every (src, dst) pair of placements on small meshes (Replicate, Partial, Shard and
strided shards of two tensor dims), the steps ``redistribute_steps`` lists are simulated
in one process on every rank's local tensor (collectives as the sums and concatenations
they are; strided reorders with the runtime's own helpers), and the result reassembled by
``sharding_sim`` (DTensor's conventions, strided shards cut by DTensor itself) must be the
original tensor, with the local shapes the plan assumes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from sharding_sim import assemble, distribute

from autopar.capture.graph import TensorMeta
from autopar.rules.redistribute import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, SLICE, ZERO, Step,
                                        redistribute_steps, strided_join, strided_take)
from autopar.rules.strategy import P, R, S, Placements, divides, placement_str, shard_dim, strided

Coord = tuple[int, ...]


def run_steps(locals_: dict[Coord, torch.Tensor], steps: tuple[Step, ...], mesh: tuple[int, ...]
              ) -> dict[Coord, torch.Tensor]:
    for step in steps:
        i, n = step.mesh_dim, mesh[step.mesh_dim]
        new = {}
        for c, x in locals_.items():
            group = [locals_[c[:i] + (j,) + c[i + 1:]] for j in range(n)]
            if step.kind == SLICE:
                size = x.shape[step.dst_dim] // n
                new[c] = (strided_take(x, step.dst_dim, step.factor, n, c[i]) if step.factor > 1
                          else x.narrow(step.dst_dim, c[i] * size, size))
            elif step.kind == ZERO:
                new[c] = x if c[i] == 0 else torch.zeros_like(x)
            elif step.kind == ALL_REDUCE:
                new[c] = sum(group)
            elif step.kind == ALL_GATHER:
                out = torch.cat(group, step.src_dim)
                new[c] = strided_join(out, step.src_dim, step.factor, n) if step.factor > 1 else out
            elif step.kind == REDUCE_SCATTER:
                new[c] = sum(group).chunk(n, step.dst_dim)[c[i]]
            elif step.kind == ALL_TO_ALL:
                new[c] = torch.cat([g.chunk(n, step.dst_dim)[c[i]] for g in group], step.src_dim)
            else:
                raise ValueError(step.kind)
        locals_ = new
    return locals_


def wrong_pairs(mesh: tuple[int, ...], choices: list, shape: tuple[int, ...]) -> tuple[list[str], int]:
    gen = torch.Generator().manual_seed(0)
    meta = TensorMeta(shape, torch.float64)
    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    placements: list[Placements] = [p for p in itertools.product(choices, repeat=len(mesh)) if divides(meta, p, mesh)]
    wrong = []
    for src in placements:
        start = distribute(x, src, mesh, gen)
        for dst in placements:
            locals_ = run_steps(dict(start), redistribute_steps(src, dst), mesh)
            expected_shape = list(shape)
            for p, n in zip(dst, mesh):
                if shard_dim(p) is not None:
                    expected_shape[shard_dim(p)] //= n
            if any(list(t.shape) != expected_shape for t in locals_.values()) or \
                    not torch.allclose(assemble(locals_, dst, mesh), x):
                wrong.append(f"{placement_str(src)} -> {placement_str(dst)}")
    return wrong, len(placements) ** 2


@pytest.mark.parametrize(("mesh", "choices"), [
    ((2, 2), [R, P, S(0), S(1), strided(0, 2), strided(1, 3)]),
    ((2, 3), [R, P, S(0), S(1), strided(1, 2)]),
    ((2, 2, 2), [R, P, S(0), S(1), strided(1, 3)]),
], ids=["2x2", "2x3", "2x2x2"])
def test_every_pair_of_placements_redistributes_correctly(mesh: tuple[int, ...], choices: list) -> None:
    wrong, pairs = wrong_pairs(mesh, choices, (24, 36))
    assert pairs > 100
    assert not wrong, f"{len(wrong)} of {pairs} wrong, e.g. {wrong[:5]}"


def test_reduce_scatter_never_lands_inside_an_outer_slice() -> None:
    """'RP' -> 'S(0)S(0)': the outer mesh dim's slice must stay outermost (DTensor's nesting)."""
    kinds = [s.kind for s in redistribute_steps((R, P), (S(0), S(0)))]
    assert REDUCE_SCATTER not in kinds
    wrong, _ = wrong_pairs((2, 2), [R, P, S(0)], (8, 4))
    assert not wrong
