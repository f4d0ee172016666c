"""Hardware profiles: the figures the cost model prices a plan with.

Every figure names its public source. Bandwidths are per device and per direction,
in bytes/s; latencies in seconds. ``*_efficiency`` factors scale peaks to what
well-tuned kernels and collectives reach in practice (MFU of large matmuls,
bus bandwidth of NCCL rings), so predicted step times are achievable, not peak.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


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
    """Device memory size, bytes: the default per-device memory limit."""
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
    overlapped_dispatch: bool = False
    """The host dispatches ahead of the device (CUDA streams): an op takes the longer of
    its work and its fixed cost, not their sum."""
    default_precision: str = "bf16"
    """Precision a plan uses unless told otherwise: 'bf16' (mixed) or 'fp32'."""

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_bf16 if precision == "bf16" else self.peak_flops_fp32


PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOPS bf16 dense,
    # 19.5 TFLOPS fp32, 2,039 GB/s HBM2e, NVLink 600 GB/s bidirectional (300 per
    # direction). Network: one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100
    # user guide) = 25 GB/s. Latencies: NCCL tests report ~5 us (NVLink) and
    # ~10 us (IB) per ring step for small messages.
    "a100": HardwareProfile(
        name="a100", peak_flops_bf16=312 * TFLOPS, peak_flops_fp32=19.5 * TFLOPS,
        memory_bandwidth=2039 * GB, memory_bytes=80 * GiB,
        intra_node_bandwidth=300 * GB, intra_node_latency=5e-6,
        inter_node_bandwidth=25 * GB, inter_node_latency=10e-6,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB): 989 TFLOPS bf16 dense,
    # 67 TFLOPS fp32, 3.35 TB/s HBM3, NVLink 900 GB/s bidirectional (450 per
    # direction). Network: one 400 Gb/s NDR ConnectX-7 per GPU (DGX H100) = 50 GB/s.
    "h100": HardwareProfile(
        name="h100", peak_flops_bf16=989 * TFLOPS, peak_flops_fp32=67 * TFLOPS,
        memory_bandwidth=3350 * GB, memory_bytes=80 * GiB,
        intra_node_bandwidth=450 * GB, intra_node_latency=5e-6,
        inter_node_bandwidth=50 * GB, inter_node_latency=10e-6,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM
    # (989 TFLOPS bf16 dense, 67 TFLOPS fp32), 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s bidirectional. Network as DGX H200: 400 Gb/s per GPU.
    "h200": HardwareProfile(
        name="h200", peak_flops_bf16=989 * TFLOPS, peak_flops_fp32=67 * TFLOPS,
        memory_bandwidth=4800 * GB, memory_bytes=141 * GB,
        intra_node_bandwidth=450 * GB, intra_node_latency=5e-6,
        inter_node_bandwidth=50 * GB, inter_node_latency=10e-6,
    ),
    # A CPU host running gloo over loopback, as in our CI: figures measured on the
    # 2-core development machine (torch.mm fp32 ~100 GFLOP/s across 2 cores, ~10 GB/s
    # memory copy). Collectives with 4 ranks sharing the 2 cores, as the tests and
    # benchmarks run them (``benchmarks/calibrate_collectives.py``, three runs): 530-730 us
    # per ring step and 0.60-0.66 GB/s effective, so 600 us and 1.3 GB/s at the 0.5
    # network efficiency. CPUs have no bf16 advantage, so plans there default to fp32.
    "cpu": HardwareProfile(
        name="cpu", peak_flops_bf16=100e9, peak_flops_fp32=100e9,
        memory_bandwidth=10 * GB, memory_bytes=24 * GiB,
        intra_node_bandwidth=1.3 * GB, intra_node_latency=600e-6,
        inter_node_bandwidth=1 * GB, inter_node_latency=800e-6,
        compute_efficiency=0.5, memory_efficiency=0.5, network_efficiency=0.5,
        default_precision="fp32",
    ),
}


def get_profile(hardware: str | HardwareProfile) -> HardwareProfile:
    """The profile named ``hardware``, or a clear error listing the known names."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    try:
        return PROFILES[hardware.lower()]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown hardware {hardware!r}; known profiles: {known}") from None
