"""The timeout of the process groups a compiled module runs on.

``init_process_group(timeout=)`` sets the world group's timeout, but the groups a
``DeviceMesh`` makes for its dims (``new_group`` with no timeout) keep torch's default, 30
minutes on gloo: a rank stuck in a collective on a mesh dim would hold its peers that long.
Every collective autopar runs is on a mesh dim's group, so each group of the mesh still at
torch's default takes the world group's timeout when the module is built: a stuck
collective is then an error on every rank of it within the user's timeout. A group made with
a timeout of its own (``init_device_mesh(backend_override=...)``) keeps it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout ``group``'s collectives wait for (its backend's, on the mesh's device type)."""
    device = torch.device("cpu") if torch.device("cpu") in group._device_types else group._device_types[0]
    return group._get_backend(device).options._timeout


def inherit_world_timeout(mesh: DeviceMesh) -> None:
    """Each group of ``mesh`` at torch's default timeout takes the world group's."""
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)
    timeout = group_timeout(world)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        default = c10d._get_default_timeout(dist.get_backend(group))
        if group is not world and group_timeout(group) == default != timeout:
            c10d._set_pg_timeout(timeout, group)
