"""Checkpoints of a ParallelModule: its ``state_dict()`` is DTensors under the model's own
keys, so ``torch.distributed.checkpoint`` saves each rank's shards and loads them back into
a module compiled for any mesh (DCP reshards on load)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from autopar.runtime.module import ParallelModule


def save(pm: ParallelModule, path: str | Path) -> None:
    """Every rank writes its shards under ``path`` (a directory)."""
    dcp.save(pm.state_dict(), checkpoint_id=str(path))


def load(pm: ParallelModule, path: str | Path) -> None:
    """Load a checkpoint saved from any mesh into ``pm``'s shards, in place."""
    state = pm.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    pm.load_state_dict(state)


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
