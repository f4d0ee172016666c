"""Price a parameter whose optimizer state (and fp32 master weights) live in host memory
(``MemoryPlan.offload``; the runtime is ``autopar.runtime.offload``).

Per offloaded parameter with ``n`` elements on this device (its local shard), device
weights and gradients of ``w`` bytes per element (2 for bf16, 4 for fp32):

- device memory: ``n * 2w`` (weights and gradient; no master copy, no Adam m and v).
- step time: the device -> host copy of the gradient and the host -> device copy of the
  updated weights over the host link, one after the other (the runtime copies every
  gradient, waits, steps, then copies weights back),
  ``2 * n * w / host_link_bandwidth + 2 * op_overhead`` (one ``copy_`` call each way);
  then the host optimizer's update,
  ``n * (HOST_UPDATE_BYTES + cast) / host_memory_bandwidth + host_optimizer_param_overhead``,
  where ``HOST_UPDATE_BYTES`` = 28 is what Adam in fp32 must move per element (master
  weights, m and v each read and written: 24; the fp32 gradient read: 4) and ``cast`` =
  ``2 * (w + 4)`` when the device dtype is not fp32 (the runtime casts the bf16 gradient up
  and the fp32 weights down on the host: read one width, write the other, each way).
- host memory (not in a device's budget; for display): master, m and v (12 bytes), the
  fp32 gradient buffer (4) and, under bf16, a staging buffer in the device dtype (w).

The step neither overlaps backward (the runtime copies after it) nor the next forward;
ZeRO-Offload's overlap and one-step delayed update are not modelled because they are not run.
Figures (``host_link_bandwidth``, ``host_memory_bandwidth``, ``host_optimizer_param_overhead``)
and their sources are in ``autopar/hardware.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.graph import TensorMeta
from autopar.cost.precision import Precision
from autopar.errors import InputError
from autopar.hardware import HardwareProfile
from autopar.mesh import Mesh
from autopar.rules.strategy import Placements, local_numel

MASTER_BYTES = 4
"""Bytes per element of the host master weights, gradient buffer and Adam m and v (fp32)."""
HOST_UPDATE_BYTES = 6 * MASTER_BYTES + MASTER_BYTES
"""Bytes fp32 Adam reads and writes per element: master, m, v read and written, gradient read."""
HOST_STATE_BYTES = 3 * MASTER_BYTES
"""Host bytes per element the optimizer keeps: master weights, m, v."""


@dataclass(frozen=True)
class OffloadCost:
    """One offloaded parameter's share of a training step, on one device."""

    device_bytes: float
    """Bytes it keeps in device memory: weights and gradient."""
    host_bytes: float
    """Bytes it keeps in host memory: master weights, optimizer state, gradient buffers."""
    transfer_s: float
    """Seconds of its gradient copied to the host and its weights copied back."""
    update_s: float
    """Seconds of its update by the host optimizer."""

    @property
    def time_s(self) -> float:
        return self.transfer_s + self.update_s


def offloaded_parameter(meta: TensorMeta, placements: Placements, mesh: Mesh, precision: Precision) -> OffloadCost:
    """The cost of keeping ``meta``'s optimizer state on the host, stored as ``placements``
    (the formulas are in the module docstring)."""
    numel = local_numel(meta, placements, mesh.shape)
    width = precision.master_bytes_per_param  # the registered parameter (fp32 also in mixed precision: the program casts)
    return OffloadCost(device_bytes=float(numel * 2 * width),
                       host_bytes=float(numel * host_bytes_per_element(width)),
                       transfer_s=transfer_time(numel, width, mesh.hardware),
                       update_s=host_update_time(numel, width, mesh.hardware))


def host_bytes_per_element(width: int) -> int:
    """Host memory per element: master, m, v, the fp32 gradient and, for a device dtype
    other than fp32, a staging buffer of that width."""
    return HOST_STATE_BYTES + MASTER_BYTES + (width if width != MASTER_BYTES else 0)


def transfer_time(numel: int, width: int, hw: HardwareProfile) -> float:
    """Gradient to the host, then weights back, ``numel * width`` bytes each way."""
    link = _known(hw.host_link_bandwidth, "host_link_bandwidth", hw)
    return 2 * (numel * width / link + hw.op_overhead)


def host_update_time(numel: int, width: int, hw: HardwareProfile) -> float:
    """The host optimizer's update of ``numel`` elements (and the dtype casts around it)."""
    bandwidth = _known(hw.host_memory_bandwidth, "host_memory_bandwidth", hw)
    cast = 2 * (width + MASTER_BYTES) if width != MASTER_BYTES else 0
    return numel * (HOST_UPDATE_BYTES + cast) / bandwidth + hw.host_optimizer_param_overhead


def _known(value: float, name: str, hw: HardwareProfile) -> float:
    if value <= 0:
        raise InputError(f"hardware profile {hw.name!r} has no {name}: offloading to the host cannot be priced")
    return value
