"""Checkpoints of a ParallelModule and its optimizer with ``torch.distributed.checkpoint``.

The checkpoint holds the module's ``state_dict()`` (DTensors under the model's own keys)
at its top level, and, when an optimizer is passed, its state under ``"optimizer"``:
``{"state": {fqn: {"exp_avg": DTensor, "step": tensor, ...}}, "param_groups": [...]}``,
keyed by parameter FQN (torch's ``get_optimizer_state_dict`` layout) and placed like the
parameter. DCP reshards on load, so a module compiled for any mesh and plan, or a plain
single-device module (``load_single_device``), loads it.

A ``PipelinedModule`` is saved and loaded the same way, into the same layout: each rank
writes (and reads) only its stages' tensors, DTensors on its stage mesh under the model's
FQNs, so a checkpoint moves between pipelined and non-pipelined meshes. Only the
optimizer's param groups (hyperparameters and the FQNs they hold: no tensors) are merged
over the ranks, so that the checkpoint's groups name every parameter, not one rank's.

DCP stores each rank's shard as one contiguous chunk of the global tensor. A strided
shard (the interleaved qkv of a fused projection) is several chunks per rank, so those
tensors go through DCP as the plain shard of the same dim: one all-gather per strided
tensor on save and on load, a transient of that one tensor, and a checkpoint identical
to the one a plain layout writes (loadable on any mesh and plan).

How the files are written and checked is ``checkpoint_files``'s: a save commits once every
rank has written, and a load refuses a checkpoint no save completed and (``strict``) keys
that differ from the model's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from autopar.errors import InputError
from autopar.rules.strategy import is_strided

from autopar.runtime import checkpoint_files as files
from autopar.errors import CheckpointError
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline import PipelinedModule

OPTIMIZER = "optimizer"
"""Key of the optimizer's state in a checkpoint (the model's keys sit beside it)."""

Compiled = ParallelModule | PipelinedModule
"""What ``save`` and ``load`` take: a module whose ``state_dict()`` holds DTensors."""


def save(pm: Compiled, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Every rank writes its shards of ``pm`` (and of ``optimizer``'s state) under ``path``.

    ``optimizer`` is any torch optimizer over ``pm.parameters()``: per-parameter state
    tensors of the parameter's local shape are saved as shards of the parameter's global
    shape, 0-d ones (Adam's ``step``) as they are. An optimizer that has not stepped yet is
    given zero state by a step with lr 0 (torch's ``get_optimizer_state_dict`` does that).

    The save commits once every rank has written (``checkpoint_files``): a failure on any
    rank raises ``CheckpointError`` on every rank and leaves a checkpoint already at ``path``
    as it was.
    """
    state: dict[str, Any] = dict(pm.state_dict())
    if optimizer is not None:
        osd = _map_state(_optimizer_state(pm, optimizer), _sharded(pm))
        state[OPTIMIZER] = {**osd, "param_groups": _shared_param_groups(osd["param_groups"])}
    files.save(_map_leaves(state, _plain_chunks), Path(path))


def load(pm: Compiled, path: str | Path, optimizer: torch.optim.Optimizer | None = None, strict: bool = True) -> None:
    """Load a checkpoint saved from any mesh into ``pm``'s shards (and ``optimizer``), in place.

    The optimizer's state and param groups (lr, betas, ...) are the checkpoint's, matched
    to parameters by FQN, so the plan and the order of parameters may differ from the saving run.
    A checkpoint no save completed is refused, and so (``strict``) are keys of the checkpoint
    the model lacks or the reverse (the optimizer's keys when one is passed), by name, on every
    rank; ``strict=False`` loads the keys both hold and leaves the others as they are.
    """
    path = Path(path)
    files.refuse_incomplete(path, agree=True)
    original: dict[str, Any] = dict(pm.state_dict())
    if optimizer is not None:
        original[OPTIMIZER] = _map_state(_optimizer_state(pm, optimizer), _sharded(pm))
    state = _map_leaves(original, _template)
    files.put_back(state, original, files.load(state, path, strict, _skipped(optimizer)))
    own = {k: v for k, v in state.items() if k != OPTIMIZER}
    pm.load_state_dict(own)  # redistributes back to the module's own (strided) placements
    if optimizer is not None:
        layout = _layout(pm)
        own = _map_state(state[OPTIMIZER], lambda fqn, t: _to_local(layout[fqn], t))
        set_optimizer_state_dict(pm, optimizer, own)


def load_single_device(model: nn.Module, path: str | Path, optimizer: torch.optim.Optimizer | None = None,
                       strict: bool = True) -> None:
    """Load a checkpoint into a plain module (and an optimizer over ``model.parameters()``)
    in one process, without autopar's plan or a process group: DCP reads every shard of
    each tensor into the module's whole tensors. Continue training on one device from there.
    Incomplete checkpoints and (``strict``) keys that differ are refused as by ``load``.
    """
    path = Path(path)
    files.refuse_incomplete(path, agree=False)
    state: dict[str, Any] = dict(model.state_dict())
    if optimizer is not None:
        state[OPTIMIZER] = _optimizer_state(model, optimizer)
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        files.load(state, path, strict, _skipped(optimizer))  # into the model's own tensors: the rest stays
    model.load_state_dict({k: v for k, v in state.items() if k != OPTIMIZER})
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[OPTIMIZER])


def _skipped(optimizer: torch.optim.Optimizer | None) -> tuple[str, ...]:
    """Checkpoint keys a load leaves out of its strictness: the optimizer's, when none is loaded."""
    return () if optimizer is not None else (f"{OPTIMIZER}.",)


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s FQN-keyed state dict; a fresh optimizer gets its zero state first.

    torch creates that state by a step with lr 0 on zero gradients, and skips it when a
    gradient is already there (a backward before the first step), which would leave no
    state to save or to load into: gradients are set aside for that step and put back.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    if not optimizer.state:
        for p in params:
            p.grad = None
    try:
        return get_optimizer_state_dict(model, optimizer)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _map_state(osd: dict[str, Any], fn: Callable[[str, torch.Tensor], Any]) -> dict[str, Any]:
    """``osd`` (FQN-keyed optimizer state dict) with every per-parameter tensor ``t`` of
    parameter ``fqn`` replaced by ``fn(fqn, t)``; param groups are kept as they are."""
    state = {fqn: {name: fn(fqn, value) if isinstance(value, torch.Tensor) else value
                   for name, value in entries.items()}
             for fqn, entries in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]}


def _shared_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's param groups merged by position: group i holds the FQNs of every rank's
    group i, with their (equal) hyperparameters. Ranks holding other parameters (pipeline
    stages) have other FQNs in their groups, and DCP keeps one rank's copy of a non-tensor
    value: merged, that copy names every parameter. Only names and numbers move."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return groups
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, groups)
    merged: list[dict[str, Any]] = []
    for rank, rank_groups in enumerate(everyone):
        for i, group in enumerate(rank_groups):
            if i == len(merged):
                merged.append({**group, "params": []})
            settings = {k: v for k, v in group.items() if k != "params"}
            if not _same(settings, {k: v for k, v in merged[i].items() if k != "params"}):
                raise InputError(f"optimizer param group {i} has other hyperparameters on rank {rank} than on the "
                                 f"ranks before it ({settings}): a checkpoint holds one value per group")
            seen = set(merged[i]["params"])
            merged[i]["params"] += [fqn for fqn in group["params"] if fqn not in seen]
    return merged


def _same(a: Any, b: Any) -> bool:
    """Equal hyperparameters (a tensor lr compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


Layout = tuple[DeviceMesh, tuple[Placement, ...]]


def _layout(pm: Compiled) -> dict[str, Layout]:
    """Each parameter's and buffer's mesh and placements, as its ``state_dict()`` DTensor has
    them (the device mesh of a ParallelModule, the stage mesh of a PipelinedModule)."""
    return {fqn: (v.device_mesh, tuple(v.placements)) for fqn, v in pm.state_dict().items()}


def _sharded(pm: Compiled) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A function making parameter ``fqn``'s optimizer state tensor a DTensor placed like the parameter."""
    params = dict(pm.named_parameters())
    layout = _layout(pm)

    def wrap(fqn: str, value: torch.Tensor) -> torch.Tensor:
        local = params[fqn]
        if value.shape == local.shape:
            return DTensor.from_local(value, *layout[fqn], run_check=False)
        if value.dim() == 0:
            return value  # a scalar such as Adam's step: the same on every rank, saved once
        raise InputError(f"optimizer state of {fqn} has shape {tuple(value.shape)}, neither the parameter's "
                         f"local shape {tuple(local.shape)} nor a scalar: its global shape is unknown")

    return wrap


def _plain(value: DTensor) -> tuple[Any, ...]:
    return tuple(Shard(p.dim) if is_strided(p) else p for p in value.placements)


def _map_leaves(state: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """The nested state dict (fresh dicts) with every value that is not a dict replaced by ``fn(value)``."""
    return {key: _map_leaves(value, fn) if isinstance(value, dict) else fn(value) for key, value in state.items()}


def _plain_chunks(value: Any) -> Any:
    """A strided shard redistributed to the plain shard of the same dim (anything else as it is)."""
    if isinstance(value, DTensor) and any(is_strided(p) for p in value.placements):
        return value.redistribute(value.device_mesh, _plain(value))
    return value


def _template(value: Any) -> Any:
    """What DCP loads ``value``'s checkpointed data into: a plain-sharded DTensor of the same
    global shape for a strided one (no collective: its values are about to be overwritten,
    and a strided shard has the same local shape as the plain shard of its dim)."""
    if isinstance(value, DTensor) and any(is_strided(p) for p in value.placements):
        return DTensor.from_local(torch.empty_like(value.to_local()), value.device_mesh, _plain(value),
                                  run_check=False, shape=value.shape, stride=value.stride())
    return value


def _to_local(layout: Layout, value: torch.Tensor) -> torch.Tensor:
    """A loaded optimizer state tensor as this rank's shard in its parameter's ``layout``."""
    if isinstance(value, DTensor):
        return value.redistribute(*layout).to_local()
    return value


def full_state_dict(pm: ParallelModule, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict (plain tensors), on rank 0 only by default (others get {}).

    Every rank must call it: the tensors are gathered with collectives. A PipelinedModule is
    refused: rank 0 holds its own stages only (``save`` then ``load_single_device`` gives the
    whole model in one process).
    """
    if isinstance(pm, PipelinedModule):
        raise InputError("full_state_dict gathers one mesh's shards, but a pipelined module's ranks hold different "
                         "stages: checkpoint.save(pm, path) then checkpoint.load_single_device(model, path)")
    out = {}
    keep = not rank0_only or dist.get_rank() == 0
    for key, value in pm.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            out[key] = full.detach().clone()
    return out


__all__ = ["OPTIMIZER", "CheckpointError", "Compiled", "full_state_dict", "load", "load_single_device", "save"]
