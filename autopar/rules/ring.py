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


def step_pieces(q_positions: torch.Tensor, q_chunk: int, k_positions: torch.Tensor, k_chunk: int,
                causal: bool) -> list[Piece]:
    """The pieces the rank's rows compute against one key block (module docstring)."""
    if not causal:
        return [Piece(0, q_positions.numel(), 0, k_positions.numel(), FULL)]
    pieces = []
    for (qf, qc), (kf, kc) in itertools.product(runs(q_positions, q_chunk), runs(k_positions, k_chunk)):
        qs, ks = q_positions[qf:qf + qc], k_positions[kf:kf + kc]
        if int(ks[0]) > int(qs[-1]):
            continue
        if int(ks[-1]) <= int(qs[0]):
            pieces.append(Piece(qf, qc, kf, kc, FULL))
        elif qc == kc and bool(torch.equal(qs, ks)):
            pieces.append(Piece(qf, qc, kf, kc, DIAGONAL))
        else:
            pieces.append(Piece(qf, qc, kf, kc, MASKED))
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
    for picked in itertools.product(*(range(mesh_shape[d]) for d in splitting)):
        coordinate = [0] * len(mesh_shape)
        for d, c in zip(splitting, picked):
            coordinate[d] = c
        q_positions = query_positions(q_local, dim, q_placements, mesh_shape, tuple(coordinate), zigzag)
        for j in range(n):
            source = (coordinate[ring] - j) % n
            k_positions = block_positions(k_local, dim, kv_placements, mesh_shape, tuple(coordinate), ring, source,
                                          zigzag)
            pieces = step_pieces(q_positions, q_chunk, k_positions, k_chunk, causal)
            busiest[j] = max(busiest[j], sum(p.pairs() for p in pieces))
            most[j] = max(most[j], len(pieces))
    return tuple(zip(busiest, most))
