"""One GPU: autopar's compiled training step of the example Llama beside its prediction and beside
eager PyTorch (issue 31.4).

The example Llama (``examples/llama.py``) at a few hundred million parameters (``GPU_CONFIG``: 24
blocks of width 1024, 16 heads of which 8 key/value, SwiGLU 2816, vocabulary 32000; batch 8 x
1024 tokens), trained in bf16 mixed precision (fp32 masters, AdamW):
- autopar: ``autopar.compile`` on a one-device mesh (a process group of one: NCCL on CUDA, gloo on
  CPU), ``pm.step`` + the optimizer's step, timed per step after warm-up steps (CUDA synchronised),
  peak memory by ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``; the plan's
  ``predicted.step_time_s`` and ``peak_memory_bytes`` beside them (its optimizer step included, as
  in the prediction);
- eager: the same model and batch in plain PyTorch, ``torch.autocast`` bf16 over fp32 weights,
  ``torch.optim.AdamW`` (its default foreach path), timed the same way.
``--profile PATH`` prices the plan with a calibrated profile (``benchmarks/calibrate_gpu.py``:
``autopar.hardware.load_profile``), else the built-in profile of the device. ``--tiny`` runs a
two-block model of width 64 on the CPU in seconds (CI: the script keeps working; its times are
the CPU's and its memory is not measured).

Usage: ``python benchmarks/gpu_check.py [--profile PATH] [--steps 10] [--json PATH] [--tiny]``
Writes benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's autopar and examples

import autopar  # noqa: E402
from autopar.errors import InputError  # noqa: E402
from autopar.hardware import HardwareProfile, get_profile, load_profile  # noqa: E402
from examples import llama  # noqa: E402

GPU_CONFIG = llama.LlamaConfig(vocab_size=32000, max_seq_len=1024, hidden=1024, heads=16, kv_heads=8,
                               ffn_hidden=2816, layers=24)
TINY_CONFIG = llama.LlamaConfig(vocab_size=256, max_seq_len=32, hidden=64, heads=4, kv_heads=2, ffn_hidden=128,
                                layers=2)
DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "gpu_check.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[], Any], device: torch.device, steps: int, warmup: int) -> dict[str, float | None]:
    """Median seconds of ``steps`` training steps after ``warmup``, and the peak memory of those."""
    for _ in range(warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - began)
    times.sort()
    out: dict[str, float | None] = {"step_s": times[len(times) // 2], "allocated_bytes": None, "reserved_bytes": None}
    if device.type == "cuda":
        out["allocated_bytes"] = float(torch.cuda.max_memory_allocated(device))
        out["reserved_bytes"] = float(torch.cuda.max_memory_reserved(device))
    return out


def batch(cfg: llama.LlamaConfig, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (size, cfg.max_seq_len), generator=generator)
    return tokens.to(device), torch.roll(tokens, -1, dims=1).to(device)


def build(cfg: llama.LlamaConfig, device: torch.device) -> llama.Llama:
    """The model on ``device``, initialised alike for both runs."""
    torch.manual_seed(0)
    with torch.device(device):
        return llama.Llama(cfg)


def run_autopar(cfg: llama.LlamaConfig, tokens: torch.Tensor, targets: torch.Tensor, device: torch.device,
                profile: HardwareProfile, steps: int, warmup: int) -> dict[str, Any]:
    """The compiled step on a one-device mesh: measured and predicted (the model handed to
    compile is dropped once compiled, so only the module's own tensors stay on the device)."""
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    model = build(cfg, device)
    began = time.perf_counter()
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=llama.lm_loss, example_targets=(targets,),
                         hardware=profile, precision="bf16", pipeline=False)
    compile_s = time.perf_counter() - began
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)

    def step() -> None:
        pm.step(tokens, targets)
        opt.step()
        opt.zero_grad()
    measured = timed_steps(step, device, steps, warmup)
    predicted = pm.plan.predicted
    return {**measured, "compile_s": compile_s, "predicted_step_s": predicted.step_time_s,
            "predicted_peak_bytes": predicted.peak_memory_bytes,
            "predicted_reserved_bytes": profile.allocator.reserved(predicted.peak_memory_bytes)
            if profile.allocator is not None else None}


def run_eager(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor, device: torch.device,
              steps: int, warmup: int) -> dict[str, Any]:
    """Plain PyTorch: autocast bf16 over fp32 weights, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = llama.lm_loss(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return timed_steps(step, device, steps, warmup)


def report(result: dict[str, Any]) -> None:
    a, e = result["autopar"], result["eager"]
    gib = 2**30

    def mem(value: float | None) -> str:
        return "-" if value is None else f"{value / gib:.2f} GiB"
    print(f"{result['device']}: example Llama {result['parameters'] / 1e6:.1f}M parameters, batch "
          f"{result['batch']} x {result['seq']}, bf16, profile {result['profile']}")
    print(f"{'':<22} {'step':>10} {'peak allocated':>15} {'peak reserved':>14}")
    print(f"{'autopar measured':<22} {a['step_s'] * 1e3:>8.1f}ms {mem(a['allocated_bytes']):>15} "
          f"{mem(a['reserved_bytes']):>14}")
    print(f"{'autopar predicted':<22} {a['predicted_step_s'] * 1e3:>8.1f}ms {mem(a['predicted_peak_bytes']):>15} "
          f"{mem(a['predicted_reserved_bytes']):>14}")
    print(f"{'eager PyTorch':<22} {e['step_s'] * 1e3:>8.1f}ms {mem(e['allocated_bytes']):>15} "
          f"{mem(e['reserved_bytes']):>14}")
    print(f"predicted / measured step: {a['predicted_step_s'] / a['step_s']:.2f}; autopar / eager: "
          f"{a['step_s'] / e['step_s']:.2f}; compile {a['compile_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, help="a calibrated profile JSON (default: the device's built-in)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (CI)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise InputError("--steps must be >= 1 and --warmup >= 0")
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("no CUDA device: gpu_check measures a GPU (pass --tiny to run it on the CPU)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg, size = (TINY_CONFIG, 4) if args.tiny else (GPU_CONFIG, 8)
    profile = load_profile(args.profile) if args.profile else get_profile(
        "cpu" if args.tiny else next((k for k in ("h200", "h100", "a100")
                                      if k in torch.cuda.get_device_name(device).lower()), "h100"))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        tokens, targets = batch(cfg, size, device)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in llama.Llama(cfg).parameters())
        result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "profile": profile.name, "parameters": parameters, "batch": size, "seq": cfg.max_seq_len,
                  "autopar": run_autopar(cfg, tokens, targets, device, profile, args.steps, args.warmup)}
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the compiled module is gone: eager starts from an empty device
        result["eager"] = run_eager(build(cfg, device), tokens, targets, device, args.steps, args.warmup)
    finally:
        dist.destroy_process_group()
    report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
