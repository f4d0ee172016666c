"""This rank's shards of parameters and buffers: sliced from real weights, or initialized
shard by shard for a model built on the meta device."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor import empty as dtensor_empty


def local_shard(full: torch.Tensor, placements: tuple[Placement, ...], mesh: DeviceMesh) -> torch.Tensor:
    """This rank's block of ``full`` (mesh dim 0 outermost, as DTensor lays shards out)."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = full
    for dim, p in enumerate(placements):
        if isinstance(p, Shard):
            size = local.shape[p.dim] // mesh.size(dim)
            local = local.narrow(p.dim, coordinate[dim] * size, size)
    return local


InitFn = Callable[[nn.Module], None]
"""Initializes a module's parameters in place (it may see DTensors), like ``reset_parameters``."""


def _owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    module_path, _, leaf = fqn.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), leaf


def materialize(model: nn.Module, fqn: str, tensor: torch.Tensor, placements: tuple[Placement, ...],
                mesh: DeviceMesh, init_fn: InitFn | None) -> torch.Tensor:
    """The local shard of parameter/buffer ``fqn`` as a new tensor on the mesh's device.

    A meta tensor is created as a DTensor of local shards only and initialized by its
    module's ``reset_parameters`` (or ``init_fn``); DTensor's random ops draw each shard
    as the matching block of the whole tensor, so no rank holds more than its shard.
    """
    device = torch.device(mesh.device_type)
    if not tensor.is_meta:
        return local_shard(tensor.detach(), placements, mesh).to(device).clone()
    owner, leaf = _owner(model, fqn)
    init = init_fn or getattr(owner, "reset_parameters", None)
    if init is None:
        raise ValueError(f"{fqn} is on the meta device and {type(owner).__name__} has no reset_parameters; "
                         "pass init_fn= to autopar.compile")
    dtensor = dtensor_empty(tuple(tensor.shape), dtype=tensor.dtype, device_mesh=mesh, placements=placements)
    original = getattr(owner, leaf)
    is_param = isinstance(original, nn.Parameter)
    setattr(owner, leaf, nn.Parameter(dtensor, requires_grad=original.requires_grad) if is_param else dtensor)
    try:
        with torch.no_grad():
            init(owner) if init_fn is not None else init()  # type: ignore[misc]
        value = getattr(owner, leaf)
        assert isinstance(value, DTensor)
        return value.to_local().detach().clone()
    finally:
        setattr(owner, leaf, original)
