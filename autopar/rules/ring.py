"""Ring attention's schedule: which key block a rank holds at each ring step, and which (query
run, key run) pieces of it its rows attend to. Shared by the runtime (``runtime.ring``, which
runs exactly these pieces) and the cost model (``cost.ring``, which prices them), so the two
cannot disagree.

On a ring of n ranks (the mesh dim the keys are split on, ``rules.attention.ring_dim``), at
step j rank i holds the key/value block of rank (i - j) mod n. Positions are global: the
queries' from their placements, a block's from the keys' placements at its owner's
coordinate (zig-zag aware, ``rules.attention.query_positions``). A causal call cuts each side
into runs of consecutive positions (two per zig-zag chunk pair) and each (query run, key run)
pair is

- skipped when every key comes after every query (nothing attended);
- ``FULL`` when every key comes at or before every query (no causal mask: the whole rectangle);
- ``DIAGONAL`` when both runs are the same positions (the kernel's own ``is_causal``, which
  skips the masked half);
- ``MASKED`` otherwise (an explicit causal mask over the rectangle; with equal chunks on
  one ring it does not happen, but nested splits on other mesh dims can cut runs unevenly).

A non-causal call is one ``FULL`` piece per step.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch

from autopar.rules.attention import held_chunks, query_positions, runs
from autopar.rules.strategy import Placements, shard_dim

SEND_RECV = "send_recv"
"""The collective kind of one ring step's transfer: every rank sends a block to the next rank
on the ring and receives one from the previous (``runtime.ring``; priced as a point-to-point
send, ``cost.collectives``)."""
FULL, DIAGONAL, MASKED = "full", "diagonal", "masked"


class Piece(NamedTuple):
    q_first: int
    q_count: int
    k_first: int
    k_count: int
    mode: str
    """``FULL``, ``DIAGONAL`` or ``MASKED`` (module docstring)."""

    def pairs(self) -> int:
        """(query, key) pairs the kernel computes: half the square (with its diagonal) on the diagonal."""
        return self.q_count * (self.q_count + 1) // 2 if self.mode == DIAGONAL else self.q_count * self.k_count


def block_positions(local_keys: int, dim: int, kv_placements: Placements, mesh_shape: tuple[int, ...],
                    coordinate: tuple[int, ...], ring: int, source: int, zigzag: frozenset[int]) -> torch.Tensor:
    """Global positions of the key block rank ``source`` on mesh dim ``ring`` owns (the rest of
    ``coordinate`` this rank's: the keys are whole, or split alike, on the other mesh dims)."""
    owner = tuple(source if d == ring else c for d, c in enumerate(coordinate))
    return query_positions(local_keys, dim, kv_placements, mesh_shape, owner, zigzag)


class Run(NamedTuple):
    """Rows of consecutive global positions within one held chunk (``rules.attention.runs``)."""

    first: int
    rows: int
    position: int
    """The global position of row ``first``; row ``first + t`` is at ``position + t``."""


def position_runs(positions: torch.Tensor, chunk: int, causal: bool) -> tuple[Run, ...]:
    """``positions``'s runs (``rules.attention.runs``) with the global position each starts at; for a
    call that is not causal, all its rows as one (only their count matters)."""
    if not causal:
        return (Run(0, positions.numel(), 0),)
    return tuple(Run(a, n, int(positions[a])) for a, n in runs(positions, chunk))


def step_pieces(q_positions: torch.Tensor, q_chunk: int, k_positions: torch.Tensor, k_chunk: int,
                causal: bool) -> list[Piece]:
    """The pieces the rank's rows compute against one key block (module docstring)."""
    return run_pieces(position_runs(q_positions, q_chunk, causal), position_runs(k_positions, k_chunk, causal),
                      causal)


def run_pieces(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], causal: bool) -> list[Piece]:
    """``step_pieces`` of the rows' and the key block's runs: a run's positions are consecutive, so its
    first and last are known, and two runs hold the same positions when they start alike, as long."""
    if not causal:
        return [Piece(0, sum(r.rows for r in q_runs), 0, sum(r.rows for r in k_runs), FULL)]
    pieces = []
    for q, k in itertools.product(q_runs, k_runs):
        if k.position > q.position + q.rows - 1:
            continue
        if k.position + k.rows - 1 <= q.position:
            pieces.append(Piece(q.first, q.rows, k.first, k.rows, FULL))
        elif q.rows == k.rows and q.position == k.position:
            pieces.append(Piece(q.first, q.rows, k.first, k.rows, DIAGONAL))
        else:
            pieces.append(Piece(q.first, q.rows, k.first, k.rows, MASKED))
    return pieces


@functools.lru_cache(maxsize=1024)
def busiest_steps(length: int, dim: int, q_placements: Placements, kv_placements: Placements,
                  mesh_shape: tuple[int, ...], ring: int, causal: bool, zigzag: frozenset[int]
                  ) -> tuple[tuple[int, int], ...]:
    """Per ring step, the (query, key) pairs the busiest rank computes (the pieces' ``pairs``)
    and the most pieces a rank runs (each a kernel call and a merge): each step ends when the
    slowest rank has its next block, so the ring waits for the busiest rank step by step. A
    sequence of ``length`` split on ``dim``."""
    q_ways = math.prod(n for p, n in zip(q_placements, mesh_shape) if shard_dim(p) == dim)
    k_ways = math.prod(n for p, n in zip(kv_placements, mesh_shape) if shard_dim(p) == dim)
    q_local, k_local = length // q_ways, length // k_ways
    q_chunk = q_local // held_chunks(dim, q_placements, zigzag)
    k_chunk = k_local // held_chunks(dim, kv_placements, zigzag)
    splitting = [d for d, p in enumerate(q_placements) if shard_dim(p) == dim or d == ring]
    n = mesh_shape[ring]
    busiest, most = [0] * n, [0] * n
    blocks: dict[tuple[int, ...], tuple[Run, ...]] = {}  # owner -> its key block's runs, for every rank's steps
    for picked in itertools.product(*(range(mesh_shape[d]) for d in splitting)):
        coordinate = [0] * len(mesh_shape)
        for d, c in zip(splitting, picked):
            coordinate[d] = c
        q_runs = position_runs(query_positions(q_local, dim, q_placements, mesh_shape, tuple(coordinate), zigzag),
                               q_chunk, causal)
        for j in range(n):
            owner = tuple((coordinate[ring] - j) % n if d == ring else c for d, c in enumerate(coordinate))
            if owner not in blocks:
                blocks[owner] = position_runs(query_positions(k_local, dim, kv_placements, mesh_shape, owner, zigzag),
                                              k_chunk, causal)
            pieces = run_pieces(q_runs, blocks[owner], causal)
            busiest[j] = max(busiest[j], sum(p.pairs() for p in pieces))
            most[j] = max(most[j], len(pieces))
    return tuple(zip(busiest, most))
