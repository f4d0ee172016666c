"""This rank's shards of parameters and buffers: sliced from real weights, or initialized
module by module for a model built on the meta device."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from autopar.errors import InputError
from autopar.rules.redistribute import strided_take
from autopar.rules.strategy import shard_dim, split_factor


def local_shard(full: torch.Tensor, placements: tuple[Placement, ...], mesh: DeviceMesh) -> torch.Tensor:
    """This rank's block of ``full`` (mesh dim 0 outermost, as DTensor lays shards out)."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = full
    for dim, p in enumerate(placements):
        d = shard_dim(p)
        if d is None:
            continue
        if split_factor(p) > 1:
            local = strided_take(local, d, split_factor(p), mesh.size(dim), coordinate[dim])
        else:
            size = local.shape[d] // mesh.size(dim)
            local = local.narrow(d, coordinate[dim] * size, size)
    return local


InitFn = Callable[[nn.Module], None]
"""Initializes a module's own parameters and buffers in place, like ``reset_parameters``."""


class ShardInitializer:
    """Local shards of a model's tensors: sliced from real weights, or initialized for a
    model built on the meta device.

    A meta module is initialized one module at a time: its own tensors (not its
    children's) are created on the mesh's device, seeded from ``seed`` and the module's
    path, initialized by ``reset_parameters`` (or ``init_fn``), sliced to this rank's shards
    and released. Every rank draws the same values whatever the mesh, so a checkpoint or a
    single-device run seeded the same way agrees; the transient peak is one module's own
    tensors (an embedding table, a linear layer), never the whole model.
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, init_fn: InitFn | None, seed: int = 0) -> None:
        self.model = model
        self.mesh = mesh
        self.init_fn = init_fn
        self.seed = seed
        self._initialized: dict[str, dict[str, torch.Tensor]] = {}

    def local(self, fqn: str, tensor: torch.Tensor, placements: tuple[Placement, ...]) -> torch.Tensor:
        device = torch.device(self.mesh.device_type)
        if not tensor.is_meta:
            return local_shard(tensor.detach(), placements, self.mesh).to(device).clone()
        module_path, _, leaf = fqn.rpartition(".")
        full = self._init_module(module_path)[leaf]
        return local_shard(full, placements, self.mesh).clone()

    def _init_module(self, path: str) -> dict[str, torch.Tensor]:
        if path in self._initialized:
            return self._initialized[path]
        owner = self.model.get_submodule(path) if path else self.model
        init = self.init_fn or getattr(owner, "reset_parameters", None)
        if init is None:
            raise InputError(f"{path or 'the model'} ({type(owner).__name__}) is on the meta device and has no "
                             "reset_parameters; pass init_fn= to autopar.compile")
        owner.to_empty(device=torch.device(self.mesh.device_type), recurse=False)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.seed + zlib.crc32(path.encode()))
            init(owner) if self.init_fn is not None else init()  # type: ignore[misc]
        own = {name: t.detach() for name, t in [*owner.named_parameters(recurse=False),
                                                 *owner.named_buffers(recurse=False)]}
        self._initialized[path] = own
        return own

    def release(self) -> None:
        """Put initialized modules back on meta: only the shards stay allocated."""
        for path in self._initialized:
            owner = self.model.get_submodule(path) if path else self.model
            owner.to_empty(device=torch.device("meta"), recurse=False)
        self._initialized.clear()


def initialize_like_compile(model: nn.Module, init_fn: InitFn | None = None, seed: int = 0,
                            device: str = "cpu") -> nn.Module:
    """Initialize a meta-device model on one device exactly as ``autopar.compile`` does
    shard by shard (same seeds, module by module): a single-device twin for checks."""
    for path, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if not any(t.is_meta for _, t in own):
            continue
        init = init_fn or getattr(module, "reset_parameters", None)
        if init is None:
            raise InputError(f"{path or 'the model'} ({type(module).__name__}) has no reset_parameters; pass init_fn=")
        module.to_empty(device=torch.device(device), recurse=False)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed + zlib.crc32(path.encode()))
            init(module) if init_fn is not None else init()  # type: ignore[misc]
    return model
