"""Gradient buckets: parameters whose gradients are all-reduced together after backward.

Like DDP, gradients are fused into buckets of about ``cap`` bytes, filled in reverse
parameter order (the order backward produces them), one bucket per set of mesh dims.
The plan lists one all-reduce per bucket and mesh dim; the runtime runs exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket size."""


@dataclass(frozen=True)
class GradBucket:
    params: tuple[str, ...]
    """Parameter node names, in the order their gradients are packed."""
    mesh_dims: tuple[int, ...]
    """Mesh dims the bucket is all-reduced over, in order."""
    nbytes: int
    """Bytes of the packed gradients (local shards)."""


def gradient_buckets(params: list[tuple[str, int, frozenset[int]]], cap: int = DEFAULT_BUCKET_BYTES
                     ) -> list[GradBucket]:
    """``params``: (name, local gradient bytes, sync dims) in parameter order."""
    open_buckets: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    done: list[GradBucket] = []

    def close(dims: tuple[int, ...]) -> None:
        members = open_buckets.pop(dims)
        done.append(GradBucket(tuple(n for n, _ in members), dims, sum(b for _, b in members)))

    for name, nbytes, dims in reversed(params):
        if not dims:
            continue
        key = tuple(sorted(dims))
        members = open_buckets.setdefault(key, [])
        members.append((name, nbytes))
        if sum(b for _, b in members) >= cap:
            close(key)
    for key in list(open_buckets):
        close(key)
    return done
