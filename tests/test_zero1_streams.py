"""ZeRO-1's streams at the runtime (``autopar.runtime.zero1``), by hand-made buckets on 2 ranks:
a reduce-scattered stream beside a stream the step only all-gathers (a parameter whose
gradient is already whole on every rank), padded parameters, rows that start and end inside
parameters, and an all-gather bucket spanning both streams."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.cost.buckets import shard_buckets
from autopar.cost.zero1 import ALL_GATHER, REDUCE_SCATTER, chunk_elements, shard_bucket_cap
from autopar.runtime.forked import run_ranks
from autopar.runtime.zero1 import ZeroOneShards

SHAPES = {"a": (3, 3), "b": (5,), "c": (2, 2)}
"""a and c reduce-scattered (a pads 9 elements to 10), b all-gathered only (5 to 6)."""


def _grad(name: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s own gradient of ``name`` (b's is whole: alike on every rank)."""
    g = torch.Generator().manual_seed(10 * (0 if name == "b" else rank + 1) + len(name) + ord(name))
    return torch.randn(SHAPES[name], generator=g)


def _rank(rank: int, world: int, cap_bytes: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    params = {n: nn.Parameter(torch.randn(shape)) for n, shape in SHAPES.items()}
    before = {n: p.detach().clone() for n, p in params.items()}
    scattered = [("c", chunk_elements(4, world)), ("a", chunk_elements(9, world))]
    cap = shard_bucket_cap(cap_bytes, 4, world)
    buckets = (shard_buckets(REDUCE_SCATTER, 0, world, [scattered], 4, cap) +
               shard_buckets(ALL_GATHER, 0, world, [scattered, [("b", chunk_elements(5, world))]], 4, cap))
    shards = ZeroOneShards(buckets, params, mesh)
    for name, p in params.items():
        p.grad = _grad(name, rank)
    grads = shards.reduce_scatter()
    # .grad now views the step's gradient buffer, which the streams no longer hold: zero_grad frees it
    released = all(s.grads is None for s in shards.streams.values()) and \
        all(params[n].grad._base is not None for n in ("a", "c")) and params["b"].grad._base is None
    want = {n: _grad(n, 0) if n == "b" else sum(_grad(n, r) for r in range(world)) for n in SHAPES}
    reduced = {n: g is None or torch.equal(g, want[n].reshape(-1)[shards.chunks[n].lo:shards.chunks[n].hi])
               for n, g in grads.items()}
    with torch.no_grad():
        for chunk in shards.chunks.values():
            chunk.view().add_(100.0 * (rank + 1))  # the owner's mark on its elements
    shards.all_gather()
    gathered = {}
    for name, p in params.items():
        chunk, mark = shards.chunks[name], torch.zeros(p.numel())
        for r in range(world):
            lo, hi = chunk.owned(r)
            mark[lo:hi] = 100.0 * (r + 1)
        gathered[name] = torch.equal(p.detach(), before[name] + mark.view(p.shape))
    owned = {n: [c.owned(r) for r in range(world)] for n, c in shards.chunks.items()}
    return {"reduced": reduced, "gathered": gathered, "owned": owned, "buckets": len(buckets), "released": released,
            "scattered": sorted(n for n, p in params.items() if id(p) in shards.scattered)}


def test_streams_reduce_scatter_and_all_gather_exactly() -> None:
    """Each rank's elements of each parameter get the summed gradient (b: its own, whole), and
    after the all-gather every parameter holds every owner's update; the rows partition
    every parameter, in one bucket per kind or in buckets of 2 columns (one spanning both
    all-gathered streams)."""
    for cap_bytes, count in ((1 << 20, 2), (16, 4 + 5)):
        results = run_ranks(_rank, 2, cap_bytes)
        for r in results:
            assert all(r["reduced"].values()) and all(r["gathered"].values()), r
            assert r["scattered"] == ["a", "c"] and r["buckets"] == count and r["released"]
        for name, numel in (("a", 9), ("b", 5), ("c", 4)):
            spans = results[0]["owned"][name]
            assert spans[0][0] == 0 and spans[-1][1] == numel and spans[0][1] == spans[1][0], spans


def _replaced_rank(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    params = {"a": nn.Parameter(torch.randn(3, 3))}
    buckets = [b for kind in (REDUCE_SCATTER, ALL_GATHER)
               for b in shard_buckets(kind, 0, world, [[("a", chunk_elements(9, world))]], 4, 1 << 20)]
    shards = ZeroOneShards(buckets, params, mesh)
    params["a"].data = params["a"].detach().clone()  # as module.to would
    try:
        shards.reduce_scatter()
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_a_parameter_whose_storage_was_replaced_is_an_error() -> None:
    """The all-gather writes the stream's buffer: a parameter no longer viewing it would keep
    its old values silently, so the step refuses, before its collectives."""
    assert all("no longer views" in message for message in run_ranks(_replaced_rank, 2))
