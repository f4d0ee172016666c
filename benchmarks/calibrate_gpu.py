"""Measure one GPU's profile figures and write them as a profile JSON (``autopar.hardware.load_profile``).

What the cost model prices by measured curves (``autopar.hardware.gpus`` gives the published
ones), measured here on this device, each by CUDA events over repeated calls after a warm-up:
- matmul efficiency by FLOPs per call, bf16 and fp32: ``torch.mm`` of square and transformer-like
  shapes, FLOPs over time over the base profile's datasheet peak;
- fused attention efficiency by key length, head dims 64 and 128, causal or not: SDPA forward and
  backward, priced as ``cost.compute.attention_flops`` x 3 (forward and twice it backward, as the
  cost model counts them), over the bf16 peak;
- memory-bound bandwidth: ``x * 1.5`` and ``x.clone()`` on large tensors, bytes read and written
  over time, as the fraction of the datasheet bandwidth (``memory_efficiency``);
- fixed costs: a chain of small ops (forward: ``op_overhead``) and its backward
  (``backward_op_overhead``), timed on the host as a step issues them, the device synchronised
  at the end only;
- the CUDA context (``allocator.context_bytes``): device memory in use beside what torch's
  caching allocator reserves, after the context is made.
What one device cannot measure (NCCL bus bandwidth, its buffers, fragmentation across a real
step's allocations, the links) stays the base profile's (``--base``, default from the device
name). The file records the device, torch version and date in ``source``.

Budget: the default sizes are chosen for under five minutes on an A100 or H100 (the largest calls
are 8192^3 matmuls and 8k-token attention, 20 timed repetitions each; not yet run on one). ``--tiny`` runs
small sizes on whatever device is given (CPU in CI) in seconds: the figures are then the CPU's,
written over the ``cpu`` base, and only show that the script works.

Usage: ``python benchmarks/calibrate_gpu.py [--device cuda] [--base h100] [--out PATH] [--tiny]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's autopar, not an installed one

from autopar.errors import InputError  # noqa: E402
from autopar.hardware import (PROFILES, AttentionCurve, Curve, HardwareProfile,  # noqa: E402
                              get_profile, save_profile)

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "calibrated_profile.json"
FULL = {"square": (256, 512, 1024, 2048, 4096, 8192), "shapes": ((8192, 4096, 4096), (8192, 4096, 14336),
                                                                 (16384, 8192, 8192), (2048, 12288, 4608)),
        "seqs": (512, 1024, 2048, 4096, 8192), "heads": 16, "stream": 2**28, "chain": 200, "reps": 20}
TINY = {"square": (32, 64, 128), "shapes": ((64, 32, 96),), "seqs": (32, 64), "heads": 2, "stream": 2**16,
        "chain": 20, "reps": 3}


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Seconds per call of ``fn`` on ``device`` (device time on CUDA), after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / reps
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - began) / reps


def matmul_curve(dtype: torch.dtype, peak: float, sizes: dict, device: torch.device) -> Curve:
    """Fraction of ``peak`` ``torch.mm`` reaches, by FLOPs per call (the best shape at each)."""
    shapes = [(n, n, n) for n in sizes["square"]] + list(sizes["shapes"])
    best: dict[float, float] = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        flops = 2.0 * m * k * n
        rate = flops / timed(lambda: torch.mm(a, b), device, sizes["reps"])
        best[flops] = max(best.get(flops, 0.0), rate / peak)
    return Curve(tuple(sorted(best.items())))


def attention_curves(peak: float, sizes: dict, device: torch.device) -> tuple[AttentionCurve, ...]:
    """SDPA forward + backward in bf16 at ``sizes["seqs"]``, 16k tokens a call (FlashAttention's
    benchmark setting), as fractions of ``peak`` in the cost model's FLOP count."""
    curves = []
    for head_dim in (64, 128):
        for causal in (False, True):
            points = []
            for seq in sizes["seqs"]:
                batch = max(1, sizes["seqs"][-1] * 2 // seq)
                q, k, v = (torch.randn(batch, sizes["heads"], seq, head_dim, device=device, dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                grad = torch.randn_like(q)

                def step() -> None:
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)
                flops = 4.0 * batch * sizes["heads"] * seq * seq * head_dim / (2 if causal else 1)
                points.append((float(seq), 3 * flops / timed(step, device, sizes["reps"]) / peak))
            curves.append(AttentionCurve(head_dim, causal, Curve(tuple(points))))
    return tuple(curves)


def memory_efficiency(bandwidth: float, sizes: dict, device: torch.device) -> float:
    """The better of a scale and a copy of ``sizes["stream"]`` fp32 elements, bytes read and
    written over time, over the datasheet ``bandwidth``."""
    x = torch.randn(sizes["stream"], device=device)
    rates = [2 * x.numel() * 4 / timed(op, device, sizes["reps"]) for op in (lambda: x * 1.5, lambda: x.clone())]
    return max(rates) / bandwidth


def fixed_costs(sizes: dict, device: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds per op of a chain of ops on 64 elements: dispatch and launch,
    as a step pays them, the device synchronised once at the end."""
    x = torch.randn(64, device=device, requires_grad=True)
    chain = sizes["chain"]

    def forward() -> torch.Tensor:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(3):
        forward().sum().backward()
    sync()
    began = time.perf_counter()
    outs = [forward() for _ in range(sizes["reps"])]
    sync()
    fwd = (time.perf_counter() - began) / (sizes["reps"] * chain)
    began = time.perf_counter()
    for y in outs:
        y.sum().backward()
    sync()
    return fwd, (time.perf_counter() - began) / (sizes["reps"] * chain)


def context_bytes(device: torch.device) -> float | None:
    """Device memory in use beside the caching allocator's reservation (the CUDA context and the
    libraries' own allocations); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free - torch.cuda.memory_reserved(device))


def base_for(device: torch.device) -> str:
    """The built-in profile nearest the device: by the CUDA device name, else cpu."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((key for key in ("h200", "h100", "a100") if key in name), "h100")


def calibrate(device: torch.device, base: HardwareProfile, sizes: dict, name: str) -> HardwareProfile:
    """``base`` with every figure this device measures replaced by the measured one."""
    started = time.perf_counter()
    fwd, bwd = fixed_costs(sizes, device)
    changes: dict = {
        "name": name, "op_overhead": fwd, "backward_op_overhead": bwd,
        "memory_efficiency": memory_efficiency(base.memory_bandwidth, sizes, device),
        "matmul_efficiency": (("bf16", matmul_curve(torch.bfloat16, base.peak_flops_bf16, sizes, device)),
                              ("fp32", matmul_curve(torch.float32, base.peak_flops_fp32, sizes, device))),
        "attention_efficiency": attention_curves(base.peak_flops_bf16, sizes, device)}
    context = context_bytes(device)
    if context is not None and base.allocator is not None:
        changes["allocator"] = dataclasses.replace(base.allocator, context_bytes=context)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    changes["source"] = (f"benchmarks/calibrate_gpu.py on {device_name}, torch {torch.__version__}, "
                         f"{datetime.date.today().isoformat()}, {time.perf_counter() - started:.0f} s; "
                         f"the rest from the {base.name} profile")
    return dataclasses.replace(base, **changes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--base", choices=sorted(PROFILES), help="built-in profile for what is not measured")
    parser.add_argument("--name", help="the written profile's name (default: BASE-measured)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tiny", action="store_true", help="small sizes, seconds on a CPU (CI)")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise InputError(f"--device {args.device!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda, but torch sees no CUDA device (pass --device cpu --tiny on a CPU)")
    base_name = args.base or base_for(device)
    profile = calibrate(device, get_profile(base_name), TINY if args.tiny else FULL,
                        args.name or f"{base_name}-measured")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, args.out, base=base_name)
    print(f"{profile.name}: {profile.source}")
    print(f"  op_overhead {profile.op_overhead * 1e6:.1f} us, backward {profile.backward_op_overhead * 1e6:.1f} us, "
          f"memory_efficiency {profile.memory_efficiency:.2f}")
    for precision, curve in profile.matmul_efficiency:
        print(f"  matmul {precision}: " + ", ".join(f"{x:.2g} FLOPs {y:.2f}" for x, y in curve.points))
    for a in profile.attention_efficiency:
        print(f"  attention hd{a.head_dim} {'causal' if a.causal else 'full'}: "
              + ", ".join(f"{x:.0f} {y:.2f}" for x, y in a.by_keys.points))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
