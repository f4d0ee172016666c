"""Time to the first step in the common case: ``autopar.compile`` of a model planned before in the
process, or with a plan already saved, beside the first (cold) compile and torch's hand plan.

Model and rows: ``benchmarks/runtime_vs_torch.py``'s (HF Llama, hidden 256, 4 layers, seq 128, batch 8,
fp32), 4 gloo ranks forked from this process. Per row and rank, in order:

| case | what runs |
|---|---|
| cold | ``compile`` of a fresh model (capture, strategies, search) |
| again | ``compile`` of the same model object again: its capture kept (``capture.kept``), searched again |
| saved | the same model with ``plan=`` the cold compile's plan as JSON (``Plan.to_json``): no search |
| saved, new model | a fresh model object with ``plan=`` that JSON: traced, not searched (a new process) |
| torch | the row's hand plan (``benchmarks/torch_plans.py``) on a fresh model |

Each case: the slowest rank's wall seconds and the mean CPU seconds per rank (``time.process_time``: on
2 cores 4 ranks share them, so wall overstates one rank's work), the median over ``--reps``. With
``--profile``, cProfile of rank 0's 'saved' compile in CPU seconds (waits for the other ranks left
out): the top functions by cumulative time.

Usage: ``python benchmarks/compile_again.py [--rows zero3,pipeline] [--reps 3] [--profile]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` and ``benchmarks`` importable when run as a script

import autopar  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402
from benchmarks.runtime_vs_torch import ROW_NAMES, ROWS, Row, build  # noqa: E402
from examples.hf_models import causal_lm_loss  # noqa: E402

CASES = ("cold", "again", "saved", "saved, new model", "torch")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()`` after a barrier; its result, wall seconds and CPU seconds on this rank."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _rank(rank: int, world: int, row: Row, profile: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(row.mesh.values()), mesh_dim_names=tuple(row.mesh))
    model, tokens, targets = build()

    def compile_(m: torch.nn.Module, **extra: Any) -> Any:
        return autopar.compile(m, mesh, (tokens,), loss_fn=causal_lm_loss, example_targets=(targets,),
                               **{"pipeline": False, **row.options, **extra})
    out: dict[str, Any] = {}
    pm, out["cold"], out["cold_cpu"] = _timed(lambda: compile_(model))
    saved = pm.plan.to_json()
    hashes = {pm.plan.plan_hash()}
    pm, out["again"], out["again_cpu"] = _timed(lambda: compile_(model))
    hashes.add(pm.plan.plan_hash())
    profiler = cProfile.Profile(time.process_time) if profile and rank == 0 else None  # CPU, not waits
    if profiler is not None:
        profiler.enable()
    pm, out["saved"], out["saved_cpu"] = _timed(lambda: compile_(model, plan=saved))
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
        out["profile"] = text.getvalue()
    hashes.add(pm.plan.plan_hash())
    fresh, _, _ = build()
    pm, out["saved, new model"], out["saved, new model_cpu"] = _timed(lambda: compile_(fresh, plan=saved))
    hashes.add(pm.plan.plan_hash())
    other, _, _ = build()
    _, out["torch"], out["torch_cpu"] = _timed(lambda: row.torch(other, mesh))
    out["plans_agree"] = len(hashes) == 1
    return out


def measure(row: Row, reps: int, profile: bool) -> dict[str, Any]:
    runs = [run_ranks(_rank, 4, row, profile and k == 0, timeout_s=900) for k in range(reps)]
    summary: dict[str, Any] = {"row": row.name, "plans_agree": all(r["plans_agree"] for ranks in runs for r in ranks)}
    for case in CASES:
        summary[case] = statistics.median(max(r[case] for r in ranks) for ranks in runs)
        summary[case + "_cpu"] = statistics.median(statistics.mean(r[case + "_cpu"] for r in ranks) for ranks in runs)
    summary["profile"] = runs[0][0].get("profile", "")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="zero3,zero3 full ckpt,fsdp x tp,pipeline,free",
                    help=f"comma-separated, of: {', '.join(ROW_NAMES)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's 'saved' compile (first rep)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # before any computation: forked ranks hang on an inherited OpenMP pool
    names = [r.strip() for r in args.rows.split(",")]
    results = [measure(row, args.reps, args.profile) for row in ROWS if row.name in names]
    print("| row | " + " | ".join(f"{c} s (CPU s/rank)" for c in CASES) + " | plans agree |")
    print("|---|" + "---|" * (len(CASES) + 1))
    for r in results:
        cells = " | ".join(f"{r[c]:.2f} ({r[c + '_cpu']:.2f})" for c in CASES)
        print(f"| {r['row']} | {cells} | {r['plans_agree']} |")
    for r in results:
        if r["profile"]:
            print(f"\n## {r['row']}: rank 0's 'saved' compile\n{r['profile']}")
    print(f"{args.reps} repetitions; wall: the slowest rank, CPU: mean per rank; 4 ranks on "
          f"{__import__('os').cpu_count()} cores")


if __name__ == "__main__":
    main()
