"""Checkpoints of a ParallelModule: its ``state_dict()`` is DTensors under the model's own
keys, so ``torch.distributed.checkpoint`` saves each rank's shards and loads them back into
a module compiled for any mesh (DCP reshards on load).

DCP stores each rank's shard as one contiguous chunk of the global tensor. A strided
shard (the interleaved qkv of a fused projection) is several chunks per rank, so those
tensors go through DCP as the plain shard of the same dim: one all-gather per strided
tensor on save and on load, a transient of that one tensor, and a checkpoint identical
to the one a plain layout writes (loadable on any mesh and plan).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from autopar.rules.strategy import is_strided

from autopar.runtime.module import ParallelModule


def save(pm: ParallelModule, path: str | Path) -> None:
    """Every rank writes its shards under ``path`` (a directory)."""
    dcp.save(_contiguous_chunks(pm.state_dict()), checkpoint_id=str(path))


def load(pm: ParallelModule, path: str | Path) -> None:
    """Load a checkpoint saved from any mesh into ``pm``'s shards, in place."""
    state = _contiguous_chunks(pm.state_dict())
    dcp.load(state, checkpoint_id=str(path))
    pm.load_state_dict(state)  # redistributes back to the module's own (strided) placements


def _contiguous_chunks(state: dict[str, object]) -> dict[str, object]:
    """The state dict with strided shards redistributed to plain shards of the same dim."""
    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor) and any(is_strided(p) for p in value.placements):
            plain = tuple(Shard(p.dim) if is_strided(p) else p for p in value.placements)
            value = value.redistribute(value.device_mesh, plain)
        out[key] = value
    return out


def full_state_dict(pm: ParallelModule, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict (plain tensors), on rank 0 only by default (others get {}).

    Every rank must call it: the tensors are gathered with collectives.
    """
    out = {}
    keep = not rank0_only or dist.get_rank() == 0
    for key, value in pm.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[key] = full.detach().clone()
    return out
