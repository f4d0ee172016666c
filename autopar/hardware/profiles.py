"""The hardware profiles the cost model prices plans with, by name (``--hardware h100``).

Every figure names its public source. Bandwidths are per device and per direction, in
bytes/s; latencies in seconds. The GPU profiles' measured curves (matmul by FLOPs per call,
attention by sequence and head dim, NCCL bus bandwidth per collective, the allocator's margin)
are in ``autopar.hardware.gpus``; the ``*_efficiency`` factors scale peaks for what no curve
covers, so predicted step times are achievable, not peak.

A plan's default memory limit is ``HardwareProfile.memory_limit()``: on GPUs the device memory
less what the CUDA context, NCCL's buffers and the caching allocator's fragmentation take
(``AllocatorMargin``, sources in ``gpus``); on the cpu profile the memory less
``memory_headroom`` (10%: what vLLM leaves by default, ``--gpu-memory-utilization`` 0.9,
https://docs.vllm.ai/en/latest/models/engine_args.html; PyTorch documents that free memory is
less than capacity, https://pytorch.org/docs/stable/generated/torch.cuda.set_per_process_memory_fraction.html).
"""

from __future__ import annotations

from autopar.errors import InputError, InputTypeError
from autopar.hardware.gpus import AMPERE, HOPPER
from autopar.hardware.profile import GB, GiB, TFLOPS, HardwareProfile


# Fixed costs of PyTorch eager on a CUDA GPU. Host side, per op: Python, PyTorch's
# dispatcher and autograd recording, several us (the same host work measures 5-6 us of
# CPU time per op on our CPU machine, benchmarks/calibrate_ops.py), then cudaLaunchKernel,
# a few us (NVIDIA Technical Blog, "Getting Started with CUDA Graphs", 2019: kernels of
# 2.9 us run back to back take 3.8 us each, 9.6 us with a sync after each). So 10 us per
# op, 10 us per op's backward (its autograd node and the kernels it launches) and 10 us
# per collective call (the functional collective's dispatch and NCCL's kernel launch).
# The host runs ahead of the GPU, so a kernel longer than that hides it. AdamW's default
# on CUDA is the foreach implementation: a dozen multi-tensor kernels per step for all
# parameters together, nothing per parameter worth pricing, but each of its passes streams the
# state through HBM (the shards far exceed the 50 MB L2): with decoupled weight decay
# (torch/optim/adam.py, ``_multi_tensor_adam``) mul_ of the weights (2 element accesses), lerp_
# of m (3), mul_ and addcmul_ of v (2 + 3), sqrt, div_ and add_ of its root (2 + 2 + 2), addcdiv_
# of the weights (4): 20 accesses per element of 4 state tensors, 5x the state's bytes
# (``optimizer_traffic``; the cpu profile's 2x is what torch's per-tensor loop measures there,
# 7.6-9.0 ns per fp32 element against 7.8 priced: ``benchmarks/calibrate_offload.py``).
# Gradient buckets: DDP launches each bucket's NCCL all-reduce on its own stream as soon as
# the bucket is full, overlapping the rest of backward (Li et al., "PyTorch Distributed",
# VLDB 2020, arXiv 2006.15704, Sec. 3.2.3 and Fig. 6-7); NCCL's kernels take SMs from the
# compute kernels they overlap, so 80% of backward hides communication, not all of it.
# FSDP issues a block's prefetched all-gathers the same way, on their own streams
# beside the neighbouring block's compute (Zhao et al., "PyTorch FSDP", VLDB 2023, arXiv
# 2304.11277, Sec. 3.3: overlapping, backward and forward prefetching): the same 80%.
# Host link and host memory, for optimizer state offloaded to the host (autopar.cost.offload).
# Links, per GPU and direction: H100 SXM and H200 attach over PCIe Gen5 x16, 64 GB/s raw,
# about 50 GB/s reached by pinned copies (NVIDIA H100 datasheet: "PCIe Gen5 128 GB/s"
# bidirectional); A100 SXM over PCIe Gen4 x16, 32 GB/s raw, about 25 GB/s reached (A100
# datasheet: "PCIe Gen4 64 GB/s" bidirectional); reached = raw x 0.78, PCIe's 128b/130b
# encoding, TLP headers and DMA gaps, the ratio the Gen5 figure gives.
# Host memory, per GPU: the node's DDR peak shared by its 8 GPUs (each rank steps its own
# state at once), times 0.4, the ratio of torch AdamW's throughput (counted at the 28 bytes
# per element the update must move) to a plain copy's that we measure on the cpu profile's
# machine (3.6-4.2 vs 8.7-11.7 GB/s): torch's per-tensor Adam makes a dozen elementwise
# passes over its arrays, so it moves more than the minimum. DGX H100 / H200: 2 x Intel
# Xeon Platinum 8480C (DGX H100 user guide), 8 channels of DDR5-4800 each (Intel ARK):
# 2 x 307.2 = 614.4 GB/s, / 8 = 76.8, x 0.4 = 30.7 GB/s. DGX A100: 2 x AMD EPYC 7742 (DGX
# A100 user guide), 8 channels of DDR4-3200 each (AMD's specifications): 2 x 204.8 = 409.6
# GB/s, / 8 = 51.2, x 0.4 = 20.5 GB/s.
_PCIE_GEN5 = {"host_link_bandwidth": 50 * GB, "host_memory_bandwidth": 30.7 * GB}
_PCIE_GEN4 = {"host_link_bandwidth": 25 * GB, "host_memory_bandwidth": 20.5 * GB}

_CUDA_EAGER = {"op_overhead": 10e-6, "backward_op_overhead": 10e-6, "collective_overhead": 10e-6,
               "overlapped_dispatch": True, "grad_sync_overlap": 0.8, "draw_kernel": True, "optimizer_traffic": 5.0}
# INT32 lanes x boost clock (NVIDIA A100 and H100 whitepapers: 64 INT32 units per SM on both;
# 108 SMs at 1.41 GHz, 132 SMs at 1.98 GHz), what a fused random draw's Philox rounds run on.
_A100_INT32 = 108 * 64 * 1.41e9
_H100_INT32 = 132 * 64 * 1.98e9

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
        inter_node_bandwidth=25 * GB, inter_node_latency=10e-6, int_op_rate=_A100_INT32,
        **_CUDA_EAGER, **_PCIE_GEN4, **AMPERE,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5 80GB): 989 TFLOPS bf16 dense,
    # 67 TFLOPS fp32, 3.35 TB/s HBM3, NVLink 900 GB/s bidirectional (450 per
    # direction). Network: one 400 Gb/s NDR ConnectX-7 per GPU (DGX H100) = 50 GB/s.
    # Latency per ring step inside a node: 3 us, from OpenXLA's measured H100 table
    # (``hardware.gpus``): an 8-GPU all-gather of 1 KiB takes 31 us, the 10 us call
    # overhead and 7 steps of 3 us.
    "h100": HardwareProfile(
        name="h100", peak_flops_bf16=989 * TFLOPS, peak_flops_fp32=67 * TFLOPS,
        memory_bandwidth=3350 * GB, memory_bytes=80 * GiB,
        intra_node_bandwidth=450 * GB, intra_node_latency=3e-6,
        inter_node_bandwidth=50 * GB, inter_node_latency=10e-6, int_op_rate=_H100_INT32,
        **_CUDA_EAGER, **_PCIE_GEN5, **HOPPER,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM
    # (989 TFLOPS bf16 dense, 67 TFLOPS fp32), 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s bidirectional. Network as DGX H200: 400 Gb/s per GPU. Latencies as H100
    # (same NVLink 4 and NVSwitch).
    "h200": HardwareProfile(
        name="h200", peak_flops_bf16=989 * TFLOPS, peak_flops_fp32=67 * TFLOPS,
        memory_bandwidth=4800 * GB, memory_bytes=141 * GB,
        intra_node_bandwidth=450 * GB, intra_node_latency=3e-6,
        inter_node_bandwidth=50 * GB, inter_node_latency=10e-6, int_op_rate=_H100_INT32,
        **_CUDA_EAGER, **_PCIE_GEN5, **HOPPER,
    ),
    # A CPU host running gloo over loopback, as in our CI: 4 ranks forked on the 2-core
    # development machine (AMD EPYC, KVM), one thread each, as the tests and benchmarks run
    # them; a device is one rank. Every figure is measured with the 4 ranks running, as
    # each rank's CPU time x ranks / cores (its wall time when the ranks keep the cores
    # busy and nothing else runs; wall times under other helpers' load, 1-min load average
    # 6-28, were 1.5-4x higher), medians of three runs, so the efficiencies are 1.
    # ``benchmarks/calibrate_ops.py``: fp32 linears forward and backward at the examples'
    # per-rank shapes (256 tokens x 128 -> 192 ... 128 -> 512) 28-32 GFLOP/s; their other
    # ops together (norms, activations, add, mul, cat, dropout, embedding, cross-entropy)
    # 3.7-4.2 GB/s of ``op_bytes``, slower than a bare add (9-37 GB/s): the compute of
    # erf, exp and reductions, cold caches between ops; fixed costs 17-18 us per op forward
    # and 27-29 us per op backward (means over 11 ops on 64 elements, from 5 us for neg to
    # 70/100 us for sdpa; a view measures 5-6 us, priced free), AdamW's per-tensor loop
    # 61-65 us per parameter.
    # ``benchmarks/calibrate_collectives.py`` (through autopar's runtime ``Reshard``, on
    # both axes of a 2 x 2 mesh and a flat mesh of 4): 1.40-1.62 ms per call, 0-64 us per
    # ring step, 0.60-0.90 GB/s. CPUs have no bf16 advantage: plans default to fp32.
    # Inter-node figures are not measured (the CI mesh fits in one node).
    # The counter stream's eager draw (``benchmarks/random.py --calibrate``: dropout masks of
    # 4K-4M elements, whole and per element): 4.5-6.0 us per op, 2.2-2.7 G element-ops/s over
    # six runs (fit of ``philox_spec.eager_draw_ops``), 17-18 ns an element for large masks.
    # Offload (the "host" is the same DRAM; 4 ranks forked at once, 64 MiB fp32 tensors,
    # CPU time x ranks / cores as above): a ``copy_`` between separate tensors 8.7-11.6 GB/s
    # of CPU time per rank, so 5 GB/s per direction; torch's AdamW step 3.1-3.7 GB/s counted
    # at its 28 bytes per element, so 1.8 GB/s (``benchmarks/calibrate_offload.py``).
    "cpu": HardwareProfile(
        name="cpu", peak_flops_bf16=32e9, peak_flops_fp32=32e9,
        memory_bandwidth=4.1 * GB, memory_bytes=24 * GiB,
        intra_node_bandwidth=0.75 * GB, intra_node_latency=40e-6,
        inter_node_bandwidth=0.6 * GB, inter_node_latency=60e-6,
        compute_efficiency=1.0, memory_efficiency=1.0, network_efficiency=1.0,
        op_overhead=17.5e-6, backward_op_overhead=28e-6, collective_overhead=1.45e-3,
        int_op_overhead=5.5e-6, int_op_rate=2.5e9,
        optimizer_param_overhead=64e-6,
        host_link_bandwidth=5 * GB, host_memory_bandwidth=1.8 * GB, host_optimizer_param_overhead=64e-6,
        default_precision="fp32", ring_attention=True,
    ),
}


def get_profile(hardware: str | HardwareProfile) -> HardwareProfile:
    """The profile named ``hardware``, or a clear error listing the known names."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if not isinstance(hardware, str):
        raise InputTypeError(f"hardware must be a profile name or a HardwareProfile, got {type(hardware).__name__}")
    try:
        return PROFILES[hardware.lower()]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise InputError(f"unknown hardware {hardware!r}; known profiles: {known}") from None
