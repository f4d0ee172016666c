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
                                        redistribute_steps, strided_join, strided_take, zigzag_join, zigzag_order,
                                        zigzag_take)
from autopar.rules.strategy import P, R, S, Placements, divides, placement_str, shard_dim, strided

Coord = tuple[int, ...]


def run_steps(locals_: dict[Coord, torch.Tensor], steps: tuple[Step, ...], mesh: tuple[int, ...],
              zigzag: frozenset[int] = frozenset()) -> dict[Coord, torch.Tensor]:
    for step in steps:
        i, n = step.mesh_dim, mesh[step.mesh_dim]
        if i in zigzag:  # as runtime.ops.Comm runs them on a zig-zag mesh dim
            locals_ = _zigzag_step(locals_, step, i, n)
            continue
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


def _zigzag_step(locals_: dict[Coord, torch.Tensor], step: Step, i: int, n: int) -> dict[Coord, torch.Tensor]:
    new = {}
    for c, x in locals_.items():
        group = [locals_[c[:i] + (j,) + c[i + 1:]] for j in range(n)]
        if step.kind == SLICE:
            new[c] = zigzag_take(x, step.dst_dim, step.factor, n, c[i])
        elif step.kind == ZERO:
            new[c] = x if c[i] == 0 else torch.zeros_like(x)
        elif step.kind == ALL_REDUCE:
            new[c] = sum(group)
        elif step.kind == ALL_GATHER:
            new[c] = zigzag_join(torch.cat(group, step.src_dim), step.src_dim, step.factor, n)
        elif step.kind == REDUCE_SCATTER:
            new[c] = zigzag_order(sum(group), step.dst_dim, n).chunk(n, step.dst_dim)[c[i]]
        elif step.kind == ALL_TO_ALL:
            sent = [zigzag_order(g, step.dst_dim, n).chunk(n, step.dst_dim)[c[i]] for g in group]
            new[c] = zigzag_join(torch.cat(sent, step.src_dim), step.src_dim, 1, n)
        else:
            raise ValueError(step.kind)
    return new


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


@pytest.mark.sweep
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


@pytest.mark.parametrize(("mesh", "zigzag", "choices"), [
    ((2, 2), {1}, [R, P, S(0), S(1), strided(0, 2)]),
    ((3, 2), {0}, [R, P, S(0), S(1), strided(1, 2)]),
    ((2, 2), {0, 1}, [R, P, S(0), S(1)]),
], ids=["2x2-inner", "3x2-outer", "2x2-both"])
def test_zigzag_shards_redistribute_consistently(mesh: tuple[int, ...], zigzag: set[int], choices: list) -> None:
    """On zig-zag mesh dims (``Mesh.zigzag``) every pair of placements, each made from the whole
    tensor by the runtime's steps, goes to the other and back to the whole tensor unchanged;
    a plain zig-zag shard holds chunks i and 2n-1-i of 2n."""
    x = torch.randn(24, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    chunks = tuple(2 * n if d in zigzag else n for d, n in enumerate(mesh))
    meta = TensorMeta(tuple(x.shape), torch.float64)
    placements = [p for p in itertools.product(choices, repeat=len(mesh)) if divides(meta, p, chunks)]
    whole = {c: x for c in itertools.product(*(range(n) for n in mesh))}
    replicated = (R,) * len(mesh)
    wrong = []
    for src, dst in itertools.product(placements, repeat=2):
        start = run_steps(whole, redistribute_steps(replicated, src), mesh, frozenset(zigzag))
        moved = run_steps(start, redistribute_steps(src, dst), mesh, frozenset(zigzag))
        back = run_steps(moved, redistribute_steps(dst, replicated), mesh, frozenset(zigzag))
        if any(not torch.allclose(t, x) for t in back.values()):
            wrong.append(f"{placement_str(src)} -> {placement_str(dst)}")
    assert len(placements) > 10 and not wrong, f"{len(wrong)} of {len(placements) ** 2} wrong, e.g. {wrong[:5]}"
    d = min(zigzag)
    sliced = run_steps(whole, redistribute_steps(replicated, tuple(S(1) if k == d else R for k in range(len(mesh)))),
                       mesh, frozenset(zigzag))
    c = 48 // (2 * mesh[d])
    for coordinate, local in sliced.items():
        i = coordinate[d]
        assert torch.equal(local, torch.cat([x[:, i * c:(i + 1) * c], x[:, (2 * mesh[d] - 1 - i) * c:][:, :c]], 1))
