"""The hardware profile type: what one device of a cluster can do, as the cost model prices it.

Bandwidths are per device and per direction, in bytes/s; latencies in seconds. Peaks come from
datasheets; measured curves and efficiencies scale them to what kernels and collectives reach
(``autopar.hardware.gpus`` gives each figure's source).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InputError
from autopar.hardware.curve import Curve
from autopar.units import fmt_bytes

GB = 1e9
GiB = 2**30
TFLOPS = 1e12

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives a profile prices (``autopar.rules.redistribute``'s names and the ring's send)."""
ACROSS_NODES_PER_NIC = ("all_to_all", "send_recv")
"""Kinds whose traffic across nodes leaves through each rank's own NIC, however many ranks of
the group share a node (the others are reduced or gathered inside the node first)."""


@dataclass(frozen=True)
class BusBandwidth:
    """What one collective reaches (nccl-tests' bus bandwidth: ``algbw`` x its ring factor)."""

    kind: str
    """One of ``COLLECTIVE_KINDS``."""
    intra_node: float
    """Bytes/s at large messages among devices of one node (NVLink)."""
    per_nic: float
    """Bytes/s one device's NIC carries at large messages across nodes."""

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVE_KINDS:
            raise InputError(f"unknown collective {self.kind!r}; known: {', '.join(COLLECTIVE_KINDS)}")
        for name in ("intra_node", "per_nic"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InputError(f"{self.kind} {name} bus bandwidth must be positive bytes/s, got {value!r}")

    def across_nodes(self, ranks_per_node: int) -> float:
        """Bytes/s across nodes for a group holding ``ranks_per_node`` devices of each node: NCCL
        runs one ring per NIC, each crossing the node at another device, so a group spanning
        whole nodes has all of the node's NICs (up to NVLink's own rate); a group of one device
        per node has its own NIC. All-to-all and sends leave through each rank's NIC."""
        if self.kind in ACROSS_NODES_PER_NIC:
            return self.per_nic
        return min(self.intra_node, max(1, ranks_per_node) * self.per_nic)


@dataclass(frozen=True)
class AttentionCurve:
    """Fused attention's efficiency for one head dim, causal or not."""

    head_dim: int
    causal: bool
    by_keys: Curve
    """Fraction of bf16 peak (FLOPs as ``cost.compute.attention_flops`` counts them, forward
    and backward alike) by key length on the device."""


@dataclass(frozen=True, kw_only=True)
class AllocatorMargin:
    """Device memory a plan cannot use, beside the tensors it counts."""

    context_bytes: float
    """The CUDA context: the driver and the kernels loaded into it."""
    nccl_bytes: float
    """NCCL's buffers, for the communicators a step opens."""
    fragmentation: float
    """Fraction of the caching allocator's reserved memory not held by live tensors at the
    peak (1 - peak allocated / peak reserved)."""

    def __post_init__(self) -> None:
        if not 0 <= self.fragmentation < 1:
            raise InputError(f"allocator fragmentation is a fraction in [0, 1), got {self.fragmentation!r}")
        if self.context_bytes < 0 or self.nccl_bytes < 0:
            raise InputError("allocator context_bytes and nccl_bytes must be non-negative")

    def usable(self, memory_bytes: float) -> float:
        """Bytes of live tensors that fit: the device less context and NCCL, less fragmentation."""
        return max(0.0, memory_bytes - self.context_bytes - self.nccl_bytes) * (1 - self.fragmentation)

    def reserved(self, peak_bytes: float) -> float:
        """What the caching allocator reserves for a peak of ``peak_bytes`` live tensors
        (``torch.cuda.max_memory_reserved``, what torchtitan reports)."""
        return peak_bytes / (1 - self.fragmentation)


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What one device of a cluster can do."""

    name: str
    """Short name used on the command line (``--hardware h100``)."""
    peak_flops_bf16: float
    """Dense bf16 tensor-core FLOP/s."""
    peak_flops_fp32: float
    """Dense fp32 FLOP/s (not TF32)."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    memory_bytes: int
    """Device memory size, bytes (the default per-device limit is ``memory_limit()``)."""
    intra_node_bandwidth: float
    """Per-direction bandwidth between devices of one node (NVLink), bytes/s."""
    intra_node_latency: float
    """Latency of one collective step inside a node, seconds."""
    inter_node_bandwidth: float
    """Per-direction network bandwidth per device between nodes, bytes/s."""
    inter_node_latency: float
    """Latency of one collective step across nodes, seconds."""
    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s that large matmuls reach (MFU of good kernels)."""
    memory_efficiency: float = 0.8
    """Fraction of peak memory bandwidth that elementwise kernels reach."""
    network_efficiency: float = 0.8
    """Fraction of link bandwidth that ring collectives reach (bus bandwidth)."""
    op_overhead: float = 0.0
    """Fixed seconds of one kernel-running op in forward, whatever its size: framework
    dispatch (Python, PyTorch's dispatcher, autograd recording) and the kernel launch."""
    backward_op_overhead: float = 0.0
    """Fixed seconds of one op's backward: its autograd node and the kernels it launches."""
    collective_overhead: float = 0.0
    """Fixed seconds of one collective call besides its ring steps: dispatch and launch,
    and on CPUs gloo's handshake with the peers."""
    optimizer_param_overhead: float = 0.0
    """Fixed seconds the optimizer spends per parameter tensor and step."""
    optimizer_traffic: float = 2.0
    """Bytes Adam's update moves through device memory per byte of the state it steps (weights,
    gradient, the two moments; ``cost.model.parameter_cost``): 2 where each is read and written once
    (the update's passes over one tensor served from cache); more where each of the update's
    elementwise passes streams the state from memory (``hardware.profiles``)."""
    grad_sync_overlap: float = 0.0
    """Fraction of compute that communication issued beside it can hide behind (their own
    stream or thread): bucketed gradient all-reduces behind the last micro-batch's backward,
    and a repeated block's prefetched parameter gathers behind the neighbouring block's
    compute (``solver.overlap``); the step pays only what exceeds this much compute (0:
    none hidden)."""
    moe_imbalance: float = 1.3
    """Expert parallelism's load imbalance: the busiest rank of an expert axis receives this many
    times the mean number of (token, expert) pairs, so it sends and receives that many times the
    mean all-to-all bytes and computes that many times the mean expert FLOPs, and the step waits
    for it (``cost.moe``). Dropless routing bounds nothing; 1.2-1.5 is what early training
    typically shows with a load-balancing loss (1.0: priced at expectation). Set it per profile
    (``dataclasses.replace(profile, moe_imbalance=1.1)``)."""
    overlapped_dispatch: bool = False
    """The host dispatches ahead of the device (CUDA streams): an op takes the longer of
    its work and its fixed cost, not their sum."""
    host_link_bandwidth: float = 0.0
    """Per-direction bandwidth between one device and host memory (PCIe), bytes/s, as copies
    to and from pinned host buffers reach it (0: unknown, offloading is not priced)."""
    host_memory_bandwidth: float = 0.0
    """Bytes/s that one device's share of the host updates optimizer state at (torch's
    optimizer over host tensors, counted at the bytes the update must read and write;
    ``autopar.cost.offload``); 0: unknown."""
    host_optimizer_param_overhead: float = 64e-6
    """Fixed seconds a host optimizer step spends per parameter tensor: torch's optimizers
    loop over tensors on the CPU (no foreach default there). Measured on the cpu profile's
    machine (AdamW's per-tensor loop, ``optimizer_param_overhead`` below), the one figure we
    have for that loop; server cores run single-threaded Python at a similar speed."""
    default_precision: str = "bf16"
    """Precision a plan uses unless told otherwise: 'bf16' (mixed) or 'fp32'."""
    ring_attention: bool = False
    """autopar's runtime runs ring attention on this device (``runtime.ring``: around the CPU flash
    kernel; a GPU kernel path is not written yet), so the planner may choose it."""
    draw_kernel: bool = False
    """The counter stream's random draws run as one fused kernel each (``runtime.philox_triton``,
    CUDA); False: as eager torch integer ops over chunks held in cache (``runtime.philox_eager``).
    ``cost.draws`` prices the one that runs."""
    int_op_rate: float = 0.0
    """Elementwise integer operations per second of a draw's arithmetic: a fused kernel's 32-bit
    instructions (INT32 lanes x clock), or the element-ops of eager int64 torch ops on chunks in
    cache; 0: a quarter of ``peak_flops_fp32`` (FLOPs count an FMA as two; INT32 issues at half
    the FP32 rate or less on recent GPUs)."""
    int_op_overhead: float = 0.0
    """Fixed seconds of one eager integer op of a draw (no autograd, called from a dispatch mode:
    lighter than ``op_overhead``'s); 0: ``op_overhead``."""
    memory_headroom: float = 0.1
    """Fraction of ``memory_bytes`` the default memory limit leaves free for what a plan does
    not count (CUDA context, library workspaces, allocator fragmentation), where the profile
    prices no ``allocator`` margin; see the module docstring for the source of 10%."""
    matmul_efficiency: tuple[tuple[str, Curve], ...] = ()
    """Per precision ('bf16', 'fp32'): the fraction of that precision's peak a matmul reaches
    as a function of its FLOPs per call on one device (small calls fill few SMs and pay the
    kernel's fixed cost); a precision not listed runs at ``compute_efficiency``."""
    attention_efficiency: tuple[AttentionCurve, ...] = ()
    """Fused attention (SDPA's flash kernel) by head dim and causal mask: the fraction of bf16
    peak its forward and backward reach as a function of the key length; none listed, or fp32,
    runs at ``compute_efficiency``."""
    bus_bandwidth: tuple[BusBandwidth, ...] = ()
    """Per collective kind, the NCCL bus bandwidth it reaches at large messages inside a node
    and through each device's NIC across nodes (``bus_bandwidth_of``); a kind not listed runs at
    the link's bandwidth x ``network_efficiency``."""
    allocator: AllocatorMargin | None = None
    """What the device loses to the CUDA context, NCCL's buffers and the caching allocator's
    fragmentation (``memory_limit``); None: ``memory_headroom`` instead."""
    source: str = ""
    """Where the profile's figures come from, when not from this module (``load_profile``)."""

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_bf16 if precision == "bf16" else self.peak_flops_fp32

    def memory_limit(self, headroom: float | None = None) -> float:
        """Bytes a plan may use per device: ``memory_bytes`` less ``headroom`` where one is given
        or the profile prices no allocator margin (default: the profile's ``memory_headroom``),
        else what the ``allocator`` margin leaves (``AllocatorMargin.usable``)."""
        if headroom is None and self.allocator is not None:
            return self.allocator.usable(self.memory_bytes)
        headroom = self.memory_headroom if headroom is None else headroom
        if not 0 <= headroom < 1:
            raise InputError(f"memory headroom is a fraction of device memory in [0, 1), got {headroom!r}")
        return self.memory_bytes * (1 - headroom)

    def memory_limit_origin(self, headroom: float | None = None) -> str:
        """How ``memory_limit(headroom)`` is made, in words (for a memory-limit error)."""
        size = fmt_bytes(self.memory_bytes)
        if headroom is None and self.allocator is not None:
            a = self.allocator
            return (f"the {self.name}'s {size} less the CUDA context ({fmt_bytes(a.context_bytes)}), NCCL's buffers "
                    f"({fmt_bytes(a.nccl_bytes)}) and the caching allocator's fragmentation ({a.fragmentation:.0%})")
        fraction = self.memory_headroom if headroom is None else headroom
        return f"the {self.name}'s {size} less a headroom of {fraction:.0%}"

    def matmul_curve(self, precision: str) -> Curve | None:
        """The matmul efficiency curve of ``precision`` (None: ``compute_efficiency``)."""
        return next((c for p, c in self.matmul_efficiency if p == precision), None)

    def attention_curve(self, head_dim: int, causal: bool) -> Curve | None:
        """The attention curve for ``causal`` at the nearest measured head dim (None: none)."""
        curves = [c for c in self.attention_efficiency if c.causal == causal]
        if not curves:
            return None
        return min(curves, key=lambda c: (abs(c.head_dim - head_dim), c.head_dim)).by_keys

    def bus_bandwidth_of(self, kind: str, intra_node: bool, ranks_per_node: int = 1) -> float | None:
        """Bus bandwidth of ``kind`` at large messages over this link (None: not measured)."""
        found = next((b for b in self.bus_bandwidth if b.kind == kind), None)
        if found is None:
            return None
        return found.intra_node if intra_node else found.across_nodes(ranks_per_node)
