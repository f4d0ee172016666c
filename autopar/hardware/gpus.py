"""A100, H100 and H200 as the cost model prices them, every figure beside its public source.

Peaks are datasheet figures; the curves and efficiencies are what published measurements reach:
- Matmul: fraction of peak by FLOPs per call (2 b m n k on one device). H100 bf16: OpenXLA's
  measured GEMM table for sm_90 (``xla/service/gpu/model/matmul_interpolator_data.h``, the
  version holding sm_90 alone: b 1-4, m n k 256-4096, median of the shapes at each FLOP count;
  e.g. 1024^3 247 TFLOP/s, 4096x2048x4096 764), above it cuBLAS at 8192^3, 795 TFLOP/s
  (github.com/pranjalssh/fast.cu README), and the Maximum Achievable Matmul FLOPS, 794.5 of 989
  (stas00/ml-engineering, compute/accelerator/README.md, "MAMF" table; "H200 is the same").
  A100 bf16 and fp32: NVIDIA's "CUDA 11 Features Revealed" blog, Figure 6 (cuBLAS, m = n = k
  from 256 to 8192; bf16 reaches 290 TFLOP/s at 8192), the bf16 curve scaled so that its top is the
  A100's MAMF, 271.2 of 312 (86.9%, the same table: what torch reaches at its best shape; the
  blog's figures are cuBLAS's own best). H100/H200 fp32 (no TF32, torch's
  default): the A100 fp32 curve at the same seconds at peak (x scaled by 67 / 19.5 TFLOP/s),
  an assumption: no per-size fp32 measurement of Hopper is published that we found.
- Attention: FlashAttention-2 forward + backward (the kernel behind SDPA's flash backend),
  Dao-AILab/flash-attention README, assets/flash2_{a100,h100}_fwd_bwd_benchmark.png: TFLOP/s at
  sequence 512-16k, head dim 64 and 128, causal or not, batch 16k / seqlen, 16 or 32 heads. Those
  count backward as 2.5x forward; autopar prices backward at 2x the same FLOPs at one efficiency,
  so the fraction here is 6/7 x reported / peak (equal total time).
- Sustained, not burst: the matmul and attention sources above time kernels in short runs, at the
  boost clock; a training step holds the tensor cores busy for seconds and runs at the clock
  the power limit allows. ml-engineering (S. Bekman), compute/accelerator/benchmarks/README.md,
  "What we measured: alone vs all-8 concurrent" (mamf-finder's MAMF, a short burst, against its
  MSMF, the rate sustained at the power-saturated clock; H200 bf16, its fattest shapes, every GPU
  of the node computing, 40 runs): 698.6 TFLOP/s sustained at 1405-1527 MHz against 823.9 in
  bursts, 0.848 (``HOPPER_SUSTAINED``; the revision measured with torch 2.14.0.dev20260810). A later
  revision of that section, another H200 node with torch 2.14.0, gives 755.5 against 852.1 (0.887):
  the ratio moves with the node's chips and cooling, so step predictions here carry that +-4%. H100 SXM is the same compute silicon at the same 700 W
  (the MAMF table: "H200 is the same"), so both Hopper curves are scaled by it. HBM's clock does
  not drop under the power limit: memory-bound ops are not scaled.
- Memory-bound ops: 89% of peak bandwidth, torch's ``a * 1.2`` on 4M fp32 elements on an
  A800 80GB (1727 of 1935 GB/s; mli/transformers-benchmarks issue #4, micro_bench.ipynb);
  smaller calls are bound by the per-op fixed cost (``_CUDA_EAGER``). The same fraction is
  assumed for HBM3/HBM3e.
- NCCL bus bandwidth at large messages (nccl-tests' busbw): H100/H200 inside a node, all-reduce
  480 GB/s (NVLink SHARP, NCCL's default on NVSwitch), other collectives 370 (NVIDIA/nccl-tests
  issue #212, NCCL maintainer: "effective NVLink bandwidth of 370GB/s ... BusBw ... non-allreduce
  operations ... On 8 GPUs ... a peak busBw of ~480GB/s"; NVIDIA GTC25 session S72583 slides 12-13,
  reproduced in stas00/ml-engineering network/README.md: all-reduce 370 / 480 with SHARP,
  all-to-all 320 on 8 H100s, 48 on 32 across DGX H100s with 8x400Gb, all-reduce 370 there);
  sends between two GPUs 396 GB/s (nvbandwidth ``device_to_device_memcpy_write_ce`` on 8x H200,
  ml-engineering network/README.md); across nodes 47 GB/s per 400 Gb/s NDR NIC
  (nccl-tests issue #290, NCCL maintainer: "For NDR @ 400Gbps you should see 46-48GB/s per NIC").
  A100: all-reduce 232 GB/s on 8 A100s, all-to-all 210, 24 per 200 Gb/s HDR NIC (GTC25 S72583:
  all-reduce 192 on 32 GPUs = 8 x 24, all-to-all 24; nccl-tests issue #160, NCCL maintainer: "24
  (what we see ourselves in general on perfect setups)"); all-gather and reduce-scatter and sends
  at all-reduce's ring rate (no separate A100 figure found). By message size the collectives are
  alpha-beta (``cost.collectives``): ``collective_overhead`` + ring steps x latency + bytes / bus
  bandwidth, which reproduces OpenXLA's measured H100 table (``collective_interpolator_data.h``,
  sm_90, 8 GPUs, 1 MiB - 2 GiB) within its scatter (tests/test_profiles.py).
- Memory the plan cannot use (``AllocatorMargin``): the CUDA context, ~400 MB with lazy module
  loading (PyTorch's default since 1.13: pytorch/pytorch PR #86509, 287 MB lazy vs 667 MB eager;
  issue #109888, "around 400MB if CUDA >= 11.7 is used and lazy module loading enabled"); NCCL's
  buffers, 1.06 GB per communicator on 8 H100s (NVIDIA/nccl issue #1685, measured excluding
  PyTorch's memory, before an all-to-all, which adds 3.3 GB), for two communicators (a data and a
  model-parallel axis); fragmentation 10% of what the caching allocator reserves (GMLake, ASPLOS'24,
  alibaba GLake README: PyTorch's allocator under ZeRO-3/FSDP with recomputation leaves 10-30% of
  its reserved memory unused at the peak, which GMLake recovers; the low end, as torch's
  ``expandable_segments`` recovers some of it too).
"""

from __future__ import annotations

from autopar.hardware.curve import Curve
from autopar.hardware.profile import GB, TFLOPS, AllocatorMargin, AttentionCurve, BusBandwidth

SEQ = (512, 1024, 2048, 4096, 8192, 16384)
"""FlashAttention-2's benchmark sequence lengths."""


def _fraction(points: tuple[tuple[float, float], ...], peak_tflops: float) -> Curve:
    """A curve of measured TFLOP/s as fractions of ``peak_tflops``."""
    return Curve(tuple((x, tflops / peak_tflops) for x, tflops in points))


def _attention(measured: dict[tuple[int, bool], tuple[float | None, ...]], peak_tflops: float,
               sustained: float = 1.0) -> tuple[AttentionCurve, ...]:
    """FlashAttention-2's fwd+bwd TFLOP/s at ``SEQ`` (None: not legible) as autopar's efficiency, times
    the ``sustained`` share of a burst's rate."""
    return tuple(AttentionCurve(hd, causal, Curve(tuple((s, sustained * 6 / 7 * t / peak_tflops)
                                                        for s, t in zip(SEQ, tflops) if t is not None)))
                 for (hd, causal), tflops in measured.items())


HOPPER_SUSTAINED = 698.6 / 823.9
"""H200's (and H100's) bf16 matmul rate sustained at the power-saturated clock over its short-burst
rate, 0.848 (module docstring)."""


# FLOPs per call -> TFLOP/s (module docstring).
H100_BF16 = _fraction(((1.34e8, 17.8), (2.68e8, 40.0), (5.37e8, 80.0), (1.07e9, 140.0), (2.15e9, 216.0),
                       (4.29e9, 363.0), (8.59e9, 490.0), (1.72e10, 605.0), (3.44e10, 700.0), (6.87e10, 745.0),
                       (1.10e12, 794.5)), 989.0).scaled(HOPPER_SUSTAINED)
A100_BF16 = _fraction(((3.4e7, 5.0), (2.7e8, 28.0), (9.1e8, 65.0), (2.1e9, 88.0), (4.2e9, 150.0), (1.7e10, 195.0),
                       (2.4e10, 243.0), (5.8e10, 235.0), (1.37e11, 258.0), (2.7e11, 260.0), (4.6e11, 277.0),
                       (1.1e12, 290.0)), 312.0).scaled(271.2 / 290.0)
A100_FP32 = _fraction(((3.4e7, 3.0), (2.7e8, 8.0), (9.1e8, 14.0), (2.1e9, 15.0), (7.2e9, 18.0), (1.7e10, 17.0),
                       (1.37e11, 18.5)), 19.5)
HOPPER_FP32 = Curve(tuple((x * 67.0 / 19.5, y) for x, y in A100_FP32.points))

# FlashAttention-2 fwd+bwd TFLOP/s at SEQ, (head dim, causal) -> values (module docstring).
H100_ATTENTION = _attention({
    (64, False): (215, 254, 274, 288, 294, 296), (128, False): (248, 294, 320, 326, 335, 338),
    (64, True): (141, 192, 232, 257, 273, 284), (128, True): (163, 221, 265, 294, 308, 328)}, 989.0, HOPPER_SUSTAINED)
A100_ATTENTION = _attention({
    (64, False): (132, None, 162, 171, 175, 176), (128, False): (None, None, 187, 196, 201, 203),
    (64, True): (88, 119, 140, 156, 165, 171), (128, True): (99, 133, 155, 173, 182, 189)}, 312.0)

HOPPER_NCCL = (BusBandwidth("all_reduce", 480 * GB, 47 * GB), BusBandwidth("all_gather", 370 * GB, 47 * GB),
               BusBandwidth("reduce_scatter", 370 * GB, 47 * GB), BusBandwidth("all_to_all", 320 * GB, 48 * GB),
               BusBandwidth("send_recv", 396 * GB, 47 * GB))
AMPERE_NCCL = (BusBandwidth("all_reduce", 232 * GB, 24 * GB), BusBandwidth("all_gather", 232 * GB, 24 * GB),
               BusBandwidth("reduce_scatter", 232 * GB, 24 * GB), BusBandwidth("all_to_all", 210 * GB, 24 * GB),
               BusBandwidth("send_recv", 232 * GB, 24 * GB))

CUDA_ALLOCATOR = AllocatorMargin(context_bytes=0.4 * GB, nccl_bytes=2 * 1.06 * GB, fragmentation=0.10)

MEASURED_MEMORY_EFFICIENCY = 0.89

HOPPER = {"matmul_efficiency": (("bf16", H100_BF16), ("fp32", HOPPER_FP32)), "attention_efficiency": H100_ATTENTION,
          "bus_bandwidth": HOPPER_NCCL, "allocator": CUDA_ALLOCATOR, "memory_efficiency": MEASURED_MEMORY_EFFICIENCY}
AMPERE = {"matmul_efficiency": (("bf16", A100_BF16), ("fp32", A100_FP32)), "attention_efficiency": A100_ATTENTION,
          "bus_bandwidth": AMPERE_NCCL, "allocator": CUDA_ALLOCATOR, "memory_efficiency": MEASURED_MEMORY_EFFICIENCY}
"""The measured figures of each generation, spread into its profiles (``autopar.hardware``)."""

__all__ = ["AMPERE", "HOPPER", "TFLOPS"]
