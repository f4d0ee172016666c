"""Logical device mesh with named axes, and the link each axis runs over."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autopar.errors import InputError, InputTypeError
from autopar.hardware import HardwareProfile, get_profile

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class AxisLink:
    """Alpha-beta parameters of the link one mesh axis communicates over."""

    bandwidth: float
    """Achievable per-direction bandwidth per device, bytes/s (efficiency applied)."""
    latency: float
    """Seconds per collective step."""
    intra_node: bool
    """True when every group along this axis sits inside one node (NVLink)."""
    ranks_per_node: int = 1
    """Devices of one group along this axis that share a node: the axis's whole size inside a
    node; across nodes, those the node holds of it (a flat data axis over 8-device nodes: 8; an
    axis outside an 8-wide inner axis: 1). A group's traffic across nodes spreads over that
    many NICs (``HardwareProfile.bus_bandwidth_of``)."""


@dataclass(frozen=True, init=False)
class Mesh:
    """A named device mesh used for planning; needs no processes.

    Axes are listed outermost first: ranks are laid out row-major, so the last axis
    holds neighbouring ranks. An axis runs inside a node when the devices it spans,
    together with all axes inside it, fit in ``devices_per_node``. ``Mesh(devices=N)`` (no axes)
    leaves the axes to the planner (``open``; ``search.layout``).
    """

    axes: dict[str, int]
    """Axis name -> number of devices along it, outermost first."""
    hardware: HardwareProfile
    """Profile of every device (a name such as "h100" is looked up)."""
    devices_per_node: int
    """Devices sharing one fast interconnect (NVLink domain)."""
    zigzag: frozenset[str]
    """Axes whose shards are zig-zag: a dim split n ways on one is cut into 2n chunks and rank
    i holds chunks i and 2n-1-i, so a causal attention split on its query rows there gives
    every rank the same work (``problem.zigzag`` says which may be, the planner keeps the faster
    layout; ``rules.redistribute.zigzag_take`` cuts them)."""
    open: bool
    """The planner chooses the axes (``Mesh(devices=N)``): ``axes`` is then one "dp" axis of every
    device until ``search.layout`` lays them out."""
    _shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _links: tuple[AxisLink, ...] = field(init=False, repr=False, compare=False)
    priced: dict[object, float] = field(init=False, repr=False, compare=False)
    """Prices of this mesh's collectives by call (``cost.collectives.collective_time``): a function of the
    fields above alone, which pricing the ILP's edges asks for again and again."""

    def __init__(self, axes: dict[str, int] | None = None, hardware: str | HardwareProfile = "h100",
                 devices_per_node: int = 8, zigzag: frozenset[str] | tuple[str, ...] = (), *,
                 devices: int | None = None) -> None:
        object.__setattr__(self, "open", axes is None)
        if axes is None:
            axes = {"dp": _device_count(devices)}
        elif devices is not None:
            raise InputError(f"pass a mesh's axes or its number of devices (the axes then the planner's), not both: "
                             f"axes={axes!r}, devices={devices!r}")
        if not isinstance(axes, dict):
            raise InputTypeError(f"a mesh's axes are a dict of axis name -> size, such as {{'dp': 2, 'tp': 4}}, "
                                 f"got {type(axes).__name__} {axes!r}")
        if not axes:
            raise InputError("a mesh needs at least one axis")
        for name, size in axes.items():
            if not isinstance(name, str) or not name:
                raise InputError(f"mesh axis names must be non-empty strings, got {name!r}")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise InputError(f"mesh axis {name!r} has size {size!r}; sizes must be positive ints")
        if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int) or devices_per_node < 1:
            raise InputError(f"devices_per_node must be a positive int, got {devices_per_node!r}")
        object.__setattr__(self, "axes", dict(axes))
        object.__setattr__(self, "hardware", get_profile(hardware))
        object.__setattr__(self, "devices_per_node", devices_per_node)
        stray = sorted(set(zigzag) - set(axes))
        if stray:
            raise InputError(f"zig-zag axes {stray} are not axes of the mesh ({list(axes)})")
        object.__setattr__(self, "zigzag", frozenset(zigzag))
        # Derived once (equality stays on the fields above): pricing asks for the shape and
        # links hundreds of thousands of times per plan.
        object.__setattr__(self, "_shape", tuple(self.axes.values()))
        object.__setattr__(self, "_links", tuple(self._make_link(d) for d in range(len(self._shape))))
        object.__setattr__(self, "priced", {})

    @classmethod
    def from_device_mesh(cls, device_mesh: "DeviceMesh", hardware: str | HardwareProfile | None = None,
                         devices_per_node: int = 8) -> "Mesh":
        """A planning mesh with the shape and axis names of a torch DeviceMesh; a 1-D one without axis names
        (``init_device_mesh("cuda", (64,))``) leaves its axes to the planner (``open``)."""
        if hardware is None:
            hardware = "cpu" if device_mesh.device_type == "cpu" else "h100"
        if device_mesh.mesh_dim_names is None and device_mesh.ndim == 1:
            return cls(None, hardware, devices_per_node, devices=device_mesh.size())
        names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(device_mesh.ndim))
        return cls(dict(zip(names, device_mesh.shape)), hardware, devices_per_node)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def with_zigzag(self, axes: frozenset[str] | tuple[str, ...]) -> "Mesh":
        """This mesh with shards on ``axes`` zig-zag (and on no other)."""
        return Mesh(self.axes, self.hardware, self.devices_per_node, axes)

    @property
    def chunks(self) -> tuple[int, ...]:
        """Chunks a dim split on each axis is cut into: the axis's size, twice it when zig-zag
        (what a split dim's size must divide by)."""
        return tuple(2 * n if name in self.zigzag and n > 1 else n for name, n in self.axes.items())

    def zigzag_dims(self) -> frozenset[int]:
        """Indices of the zig-zag axes."""
        return frozenset(i for i, name in enumerate(self.axes) if name in self.zigzag)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def link(self, dim: int) -> AxisLink:
        """The link mesh dimension ``dim`` communicates over."""
        return self._links[dim]

    def _make_link(self, dim: int) -> AxisLink:
        span = math.prod(self.shape[dim:])
        hw = self.hardware
        if span <= self.devices_per_node:
            return AxisLink(hw.intra_node_bandwidth * hw.network_efficiency, hw.intra_node_latency, True,
                            self.shape[dim])
        inner = math.prod(self.shape[dim + 1:])
        per_node = max(1, min(self.shape[dim], self.devices_per_node // inner))
        return AxisLink(hw.inter_node_bandwidth * hw.network_efficiency, hw.inter_node_latency, False, per_node)

    def describe(self) -> str:
        if self.open:
            return f"{self.size} devices, axes open"
        return " x ".join(f"{n}={s}" for n, s in self.axes.items())

    def to_json(self) -> dict:
        out = {"axes": dict(self.axes), "hardware": self.hardware.name, "devices_per_node": self.devices_per_node}
        out = {**out, "zigzag": sorted(self.zigzag)} if self.zigzag else out
        return {**out, "open": True} if self.open else out

    def laid_out(self, axes: dict[str, int]) -> "Mesh":
        """This mesh's devices on ``axes`` (as many devices), its hardware and nodes kept."""
        assert math.prod(axes.values()) == self.size
        return Mesh(axes, self.hardware, self.devices_per_node)


def _device_count(devices: object) -> int:
    if devices is None:
        raise InputError("a mesh needs its axes, such as Mesh({'dp': 8, 'tp': 8}), or its number of devices, "
                         "Mesh(devices=64), the axes then the planner's")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise InputError(f"devices must be a positive int, got {devices!r}")
    return devices


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """Parse ``"dp=2,tp=4"`` into ``{"dp": 2, "tp": 4}``."""
    axes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, size = part.strip().partition("=")
        name = name.strip()
        if not sep or not name or not re.fullmatch(r"[0-9]+", size.strip()):  # not isdigit: '²' is a digit
            raise InputError(f"bad mesh spec {spec!r}: expected name=size[,name=size...]")
        if name in axes:
            raise InputError(f"bad mesh spec {spec!r}: axis {name!r} is named twice")
        axes[name] = int(size)
    return axes
