"""Collective costs (alpha-beta per mesh axis) and the collectives a reshard needs.

Ring algorithms (REFERENCE.md): all-reduce 2(n-1)a + 2(n-1)/n M/b; all-gather and
reduce-scatter (n-1)a + (n-1)/n M/b with M the gathered size; all-to-all
(n-1)a + (n-1)/n M/b with M the bytes a device holds. A ring step's send to the next rank
(``rules.ring.SEND_RECV``, ring attention): a + M/b, M the bytes sent (``point_to_point_time``).
b is the bus bandwidth the profile measured for that collective on that link
(``link_bandwidth``), else the link's bandwidth x ``network_efficiency``; with a the per-call
cost, the bus bandwidth this reaches by message size, (bytes / M) / time, is what nccl-tests
measure (``bus_bandwidth``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate

from autopar.capture.graph import TensorMeta
from autopar.cost.precision import Precision
from autopar.mesh import Mesh

from autopar.rules.redistribute import ALL_GATHER, ALL_REDUCE, COLLECTIVES, REDUCE_SCATTER, redistribute_steps
from autopar.rules.ring import SEND_RECV
from autopar.rules.strategy import is_partial, local_numel, shard_dim

_REPLICATE, _PARTIAL = Replicate(), Partial()
"""Placements are immutable: gradient placements reuse one of each (edge pricing asks ~40,000 times)."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective on one mesh dimension; ``nbytes`` is the M of the formulas."""

    kind: str
    mesh_dim: int
    nbytes: int
    bucketed: bool = False
    """Gradient synchronization: one bucket of gradients fused into one all-reduce (as DDP
    does), run after (or overlapping) backward rather than on an edge."""
    grouped: bool = False
    """A parameter's gather, gather again or gradient reduce-scatter run in one collective with
    the others of its group (``cost.groups``: its reader's block, as FSDP2 per module): the call's
    fixed cost (``call_time``) is the group's, paid once per group, so its own price is its
    transfer alone (``collective_time``), and the copy into or out of the group's buffer
    (``copy_time``)."""
    reordered: bool = False
    """An all-gather along a dim other than 0, or a reduce-scatter into one: the runtime's
    collective moves rank-major pieces, put in order after it (before it) by one copy."""


def call_time(kind: str, mesh_dim: int, mesh: Mesh) -> float:
    """What one collective costs whatever its size: the call's fixed cost and the alpha terms,
    2(n-1) ring steps for all-reduce, one for a ring step's send, n-1 otherwise (0 on a mesh
    dim of size 1)."""
    n = mesh.shape[mesh_dim]
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if kind == ALL_REDUCE else 1 if kind == SEND_RECV else n - 1
    return mesh.hardware.collective_overhead + steps * mesh.link(mesh_dim).latency


def transfer_time(call: CollectiveCall, mesh: Mesh) -> float:
    """The bandwidth term of one collective: linear in ``nbytes``, so per-tensor shares of a
    bucket add up to the bucket's; with the local copies of its bytes (``copy_time``, and on a
    zig-zag axis ``zigzag_reorder_time``, linear too)."""
    return (bytes_moved(call, mesh) / link_bandwidth(call.kind, call.mesh_dim, mesh) + zigzag_reorder_time(call, mesh)
            + copy_time(call, mesh))


def copy_time(call: CollectiveCall, mesh: Mesh) -> float:
    """The copies of M bytes the runtime makes around one collective, each read and written at
    memory bandwidth: a ``reordered`` all-gather's pieces put in order; a grouped all-gather's
    output copied out of the group's flat buffer (``runtime.grouped``); a
    ``reordered`` reduce-scatter's chunks laid out rank-major, which for a grouped one is the
    copy into the group's buffer, made for every member (``runtime.grouped``)."""
    if call.kind == ALL_GATHER:
        copies = int(call.grouped) + int(call.reordered)
    elif call.kind == REDUCE_SCATTER:
        copies = int(call.grouped or call.reordered)
    else:
        return 0.0
    if not copies or mesh.shape[call.mesh_dim] == 1:
        return 0.0
    hw = mesh.hardware
    return copies * 2 * call.nbytes / (hw.memory_bandwidth * hw.memory_efficiency)


def link_bandwidth(kind: str, mesh_dim: int, mesh: Mesh) -> float:
    """Bytes/s of collective ``kind``'s bandwidth term along ``mesh_dim``: the profile's measured
    bus bandwidth of that kind over the axis's link (across nodes, over the NICs of the group's
    devices in each node: ``HardwareProfile.bus_bandwidth_of``), else the link's."""
    link = mesh.link(mesh_dim)
    measured = mesh.hardware.bus_bandwidth_of(kind, link.intra_node, link.ranks_per_node)
    return link.bandwidth if measured is None else measured


def bus_bandwidth(kind: str, nbytes: float, mesh_dim: int, mesh: Mesh) -> float:
    """The bus bandwidth (nccl-tests' busbw: bytes moved per device over the time) one collective
    of M = ``nbytes`` reaches along ``mesh_dim``, as this module prices it."""
    call = CollectiveCall(kind, mesh_dim, int(nbytes))
    time = point_to_point_time(nbytes, mesh_dim, mesh) if kind == SEND_RECV else collective_time(call, mesh)
    return bytes_moved(call, mesh) / time if time > 0 else math.inf


def collective_time(call: CollectiveCall, mesh: Mesh) -> float:
    """Alpha-beta time of one collective, after the call's fixed cost
    (``collective_overhead``: its launch and the wait for the slowest rank, added even where
    the host dispatches ahead, so a bucket's time splits linearly into a per-call part,
    ``call_time``, and per-gradient transfers, ``transfer_time``); a ``grouped`` call's
    transfer alone (its group pays the call once). Priced once per mesh (``Mesh.priced``)."""
    found = mesh.priced.get(call)
    if found is None:
        found = mesh.priced[call] = _collective_time(call, mesh)
    return found


def _collective_time(call: CollectiveCall, mesh: Mesh) -> float:
    if mesh.shape[call.mesh_dim] == 1:
        return 0.0
    if call.grouped:  # the group's one call pays it (``cost.groups``)
        return transfer_time(call, mesh)
    return call_time(call.kind, call.mesh_dim, mesh) + transfer_time(call, mesh)


def zigzag_reorder_time(call: CollectiveCall, mesh: Mesh) -> float:
    """On a zig-zag axis (``Mesh.zigzag``) an all-gather's pieces are put back in order after
    it, and a reduce-scatter's or all-to-all's input is put in rank order before it
    (``runtime.ops.Comm``): one copy of M bytes, read and written at memory bandwidth."""
    if not mesh.zigzag or call.kind in (ALL_REDUCE, SEND_RECV) or mesh.names[call.mesh_dim] not in mesh.zigzag:
        return 0.0
    hw = mesh.hardware
    return 2 * call.nbytes / (hw.memory_bandwidth * hw.memory_efficiency)


def point_to_point_time(nbytes: float, mesh_dim: int, mesh: Mesh) -> float:
    """Alpha-beta time of one send of ``nbytes`` to a neighbour along ``mesh_dim`` (a pipeline's
    activations or gradients): the call's fixed cost, one latency and the bytes over the link."""
    return (mesh.hardware.collective_overhead + mesh.link(mesh_dim).latency
            + nbytes / link_bandwidth(SEND_RECV, mesh_dim, mesh))


def bytes_moved(call: CollectiveCall, mesh: Mesh) -> float:
    """Bytes one device sends over its link for this collective (for the plan's comm_bytes)."""
    n = mesh.shape[call.mesh_dim]
    if call.kind == SEND_RECV:  # all of it, to the next rank
        return float(call.nbytes) if n > 1 else 0.0
    factor = 2 if call.kind == ALL_REDUCE else 1
    return factor * (n - 1) / n * call.nbytes


def reshard(meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh: Mesh,
            precision: Precision) -> list[CollectiveCall]:
    """The collectives of ``redistribute_steps(src, dst)``, sized at their step.

    M is the gathered size for all-gather, the size before scattering for reduce-scatter,
    and the local size for all-reduce and all-to-all. Slices and zeroing are free.
    """
    return list(_reshard(meta, tuple(src), tuple(dst), mesh.shape, precision))


@functools.lru_cache(maxsize=65536)
def _reshard(meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh_shape: tuple[int, ...],
             precision: Precision) -> tuple[CollectiveCall, ...]:
    """``reshard``, cached on everything it reads (a mesh only by its shape): edge pricing asks
    for the same tensor's reshard under many consumer splits and gradient placements."""
    calls = []
    for step in redistribute_steps(src, dst):
        if step.kind not in COLLECTIVES or mesh_shape[step.mesh_dim] == 1:  # one rank: nothing to exchange
            continue
        placements = step.before
        if step.kind == ALL_GATHER:
            placements = placements[:step.mesh_dim] + (Replicate(),) + placements[step.mesh_dim + 1:]
        nbytes = precision.tensor_bytes(meta, local_numel(meta, placements, mesh_shape))
        reordered = step.src_dim != 0 if step.kind == ALL_GATHER else step.kind == REDUCE_SCATTER and step.dst_dim != 0
        calls.append(CollectiveCall(step.kind, step.mesh_dim, nbytes, reordered=reordered))
    return tuple(calls)


def grad_placement_at_consumer(required: Placement, consumer_active: bool) -> Placement:
    """Placement of the gradient a consumer sends back for an input it took as ``required``.

    A sharded input gets a sharded gradient; a Partial input a replicated one (d sum/dx_i = 1);
    a replicated input of an op split along this mesh dim gets a Partial gradient (each rank
    saw only its part of the uses).
    """
    if shard_dim(required) is not None:
        return required
    if is_partial(required):
        return _REPLICATE
    return _PARTIAL if consumer_active else _REPLICATE


def grad_placement_at_producer(produced: Placement) -> Placement:
    """Placement the producer's backward wants its output gradient in."""
    return produced if shard_dim(produced) is not None else _REPLICATE
