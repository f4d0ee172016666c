"""A pipelined step's tied weights (``pipeline.tied``): the gradient of a weight several pp ranks
hold, summed between them once the pipeline has drained and the buckets are reduced, so that
every copy takes the same optimizer step and the copies stay equal.

One all-reduce per weight, in the plan's order, among the ranks holding it at this rank's place
on the stage mesh (they hold the same shard of it): the pipeline axis's own group when they are
all its ranks, else a group of those ranks, made once for the module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.ops import CollectiveLog
from autopar.pipeline.tied import TiedWeight


class TiedGradients:
    """The all-reduces of this rank's tied weights' gradients (built on every rank alike: making
    a process group is a call of every rank)."""

    def __init__(self, tied: list[TiedWeight], mesh: DeviceMesh, axis: str, params: dict[str, nn.Parameter]) -> None:
        me = mesh.get_local_rank(axis)
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for weight in tied:
            ranks = tuple(weight.ranks)
            if ranks not in groups:
                groups[ranks] = _group(mesh, axis, ranks)
        self._mine = [(weight, params[weight.node], groups[tuple(weight.ranks)], weight.stages[weight.ranks.index(me)])
                      for weight in tied if me in weight.ranks]

    def reduce(self, log: CollectiveLog | None) -> None:
        """Sum each tied weight's gradient with its other copies' (in fp32 at least, as the
        buckets reduce); a copy that got no gradient (its stages' reads sent none) adds zeros
        and takes the sum, as the others do."""
        for weight, param, group, stage in self._mine:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dtype = torch.promote_types(param.grad.dtype, torch.float32)
            flat = param.grad if param.grad.dtype == dtype else param.grad.to(dtype)
            if log is not None:
                log.transfers.append(("all_reduce", stage, flat.numel() * flat.element_size()))
            dist.all_reduce(flat, group=group)
            if flat is not param.grad:
                param.grad.copy_(flat)


def _group(mesh: DeviceMesh, axis: str, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The group of pp coordinates ``ranks`` at this rank's place on the other axes: the axis's
    group when they are all of it, else one of the groups made for every place (every rank
    makes them all, in one order), with the axis group's timeout; None on a rank outside them."""
    dim = mesh.mesh_dim_names.index(axis)
    if len(ranks) == mesh.size(dim):
        return mesh.get_group(axis)
    places = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim))  # a row per place on the other axes
    axis_group = mesh.get_group(axis)
    timeout = axis_group._get_backend(torch.device(mesh.device_type)).options._timeout  # no public getter
    mine, _ = dist.new_subgroups_by_enumeration([[int(row[r]) for r in ranks] for row in places], timeout=timeout)
    return mine
