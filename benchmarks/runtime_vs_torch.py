"""autopar's runtime against PyTorch's own parallelism, side by side on the same ranks.

Model: HF ``LlamaForCausalLM`` (``examples/hf_models.py``: hidden 256, 4 layers, 4 heads, 2 kv heads,
feed-forward 688, vocabulary 512), sequence 128, global batch 8, fp32; 4 gloo ranks forked from this
process (``autopar.runtime.forked.run_ranks``), each computing on one thread. Every row is one plan
written twice, by hand with torch (``benchmarks/torch_plans.py``) and as ``autopar.compile`` options:

| row | torch | autopar |
|---|---|---|
| zero3 | ``fully_shard`` per layer + root | ``zero={"dp": 3}`` |
| zero3 full ckpt | FSDP2 + ``checkpoint_wrapper`` per layer | ``zero={"dp": 3}, checkpoint="full"`` |
| zero3 selective ckpt | FSDP2 + selective ``checkpoint_wrapper`` (matmuls, attention kept) | ``checkpoint="selective"`` |
| zero2 | ``fully_shard(reshard_after_forward=False)`` | ``zero={"dp": 2}`` |
| zero1 | DDP + ``ZeroRedundancyOptimizer`` | ``zero={"dp": 1}`` |
| fsdp x tp | ``parallelize_module`` on tp, FSDP2 on dp (2 x 2) | the same TP plan pinned, ``zero={"dp": 3}`` |
| pipeline | ``pipelining`` 1F1B, 4 micro-batches, pp 2 x dp 2 | ``Pipeline(schedule="1f1b", micro_batches=4)`` |
| free | DDP | nothing pinned |

Timing: each rank's CPU time per step (``time.process_time``: its threads, gloo's included), so
that other work on the machine changes little; ``--reps`` repetitions of ``--steps`` steps, the
rows and the two sides interleaved (round robin, the side that goes first alternating), after
``--warmup`` steps. A repetition's ratio is autopar's CPU time over torch's, each the mean over
ranks; the table gives the median ratio over repetitions (min-max), and the median CPU ms per step
per rank on each side. Losses of the first ``--check-steps`` steps, on both sides, must equal the
single-device model's (rtol 1e-4). ``compile s``: the slowest rank's ``autopar.compile`` wall time
(the torch side's set-up beside it).

``--profile ROW``: torch's profiler on rank 0 (``--profile-rank``) over ``--steps`` steps of that row, both sides:
collective calls and bytes per step, the top ops by self CPU time, and the step's op count
(``benchmarks/step_profile.py``).

Usage: ``python benchmarks/runtime_vs_torch.py [--rows zero3,zero2] [--reps 5] [--steps 5]
[--profile zero3] [--profile-rank 2] [--json PATH] [--autopar CHECKOUT]``; the JSON (each rank's median
CPU ms per step too: ``rank_cpu_ms``) goes to ``benchmarks/results/runtime_vs_torch.json``.
``--autopar``: another checkout's autopar against the same hand plans (a baseline: ``--autopar ../main``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)  # before any compute: forked children hang on an inherited OpenMP pool

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` and ``benchmarks`` importable when run as a script
if "--autopar" in sys.argv:  # another checkout's autopar (a baseline), this one's benchmarks and examples
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--autopar") + 1]).resolve()))

import autopar  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402
from benchmarks import torch_plans  # noqa: E402
from benchmarks.torch_plans import LR, TorchStep, lm_loss  # noqa: E402
from examples.hf_models import LLAMA_TP_PLAN, build_llama_step, causal_lm_loss  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "runtime_vs_torch.json"
SIZES: dict[str, int] = {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 688, "vocab": 512,
                         "seq": 128}
BATCH = 8
DP4 = {"dp": 4}


@dataclass(frozen=True)
class Row:
    name: str
    mesh: dict[str, int]
    torch: Callable[[nn.Module, DeviceMesh], TorchStep]
    options: dict[str, Any] = field(default_factory=dict)


ROWS: tuple[Row, ...] = (
    Row("zero3", DP4, torch_plans.fsdp, {"zero": {"dp": 3}}),
    Row("zero3 data_axes", DP4, torch_plans.fsdp, {"zero": {"dp": 3}, "data_axes": ("dp",)}),
    Row("zero3 full ckpt", DP4, lambda m, d: torch_plans.fsdp(m, d, checkpoint="full"),
        {"zero": {"dp": 3}, "checkpoint": "full"}),
    Row("zero3 selective ckpt", DP4, lambda m, d: torch_plans.fsdp(m, d, checkpoint="selective"),
        {"zero": {"dp": 3}, "checkpoint": "selective"}),
    Row("zero2", DP4, lambda m, d: torch_plans.fsdp(m, d, reshard=False), {"zero": {"dp": 2}}),
    Row("zero1", DP4, torch_plans.zero1, {"zero": {"dp": 1}}),
    Row("fsdp x tp", {"dp": 2, "tp": 2}, torch_plans.fsdp_tp, {"constraints": LLAMA_TP_PLAN, "zero": {"dp": 3}}),
    Row("pipeline", {"pp": 2, "dp": 2}, torch_plans.pipeline,
        {"pipeline": autopar.Pipeline(axis="pp", schedule="1f1b", micro_batches=4)}),
    Row("free", DP4, torch_plans.ddp, {}),
)
ROW_NAMES = tuple(r.name for r in ROWS)


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model from seed 0 and the global batch (tokens, shifted targets), alike on every rank."""
    model, (tokens,), _, (targets,) = build_llama_step(batch=BATCH, **SIZES)
    return model, tokens, targets


class Side:
    """One side of a row on this rank: its step, set-up time, and what it measured."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], float | None], setup_s: float,
                 plan: dict[str, Any] | None = None) -> None:
        self.step, self.setup_s, self.plan = step, setup_s, plan or {}
        self.losses: list[float | None] = []
        self.cpu_s: list[float] = []


def torch_side(row: Row, mesh: DeviceMesh) -> Side:
    t0 = time.perf_counter()
    model, _, _ = build()
    return Side(row.torch(model, mesh).run, time.perf_counter() - t0)


def autopar_side(row: Row, mesh: DeviceMesh) -> Side:
    model, tokens, targets = build()
    dist.barrier()
    t0 = time.perf_counter()
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=causal_lm_loss, example_targets=(targets,),
                         **{"pipeline": False, **row.options})
    setup_s = time.perf_counter() - t0
    opt = pm.optimizer(torch.optim.AdamW, lr=LR)
    pipelined = "pipeline" in row.options

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        if pipelined:
            loss = pm.step(tokens, targets)
        else:
            loss = pm(tokens, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.to_local().item()
    predicted = pm.plan.predicted
    plan = {"predicted_step_s": predicted.step_time_s, "predicted_compute_s": predicted.compute_time_s,
            "predicted_comm_s": predicted.comm_time_s, "collectives": len(pm.plan.collectives),
            "hash": pm.plan.plan_hash()}
    return Side(run, setup_s, plan)


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    _, tokens, targets = build()
    sides: dict[str, dict[str, Side]] = {}
    for row in (r for r in ROWS if r.name in args.rows):
        mesh = init_device_mesh("cpu", tuple(row.mesh.values()), mesh_dim_names=tuple(row.mesh))
        sides[row.name] = {"torch": torch_side(row, mesh), "autopar": autopar_side(row, mesh)}
    for pair in sides.values():
        for side in pair.values():
            for _ in range(max(args.warmup, args.check_steps)):
                side.losses.append(side.step(tokens, targets))
            del side.losses[args.check_steps:]
    for rep in range(args.reps):
        for pair in sides.values():
            for name in ("torch", "autopar") if rep % 2 == 0 else ("autopar", "torch"):
                side = pair[name]
                gc.collect()
                dist.barrier()
                c0 = time.process_time()
                for _ in range(args.steps):
                    side.step(tokens, targets)
                side.cpu_s.append((time.process_time() - c0) / args.steps)
    out: dict[str, Any] = {row: {name: {"cpu_s": s.cpu_s, "losses": s.losses, "setup_s": s.setup_s, "plan": s.plan}
                                 for name, s in pair.items()} for row, pair in sides.items()}
    if args.profile:
        from benchmarks.step_profile import profile_sides

        out["profile"] = profile_sides({n: s.step for n, s in sides[args.profile].items()}, tokens, targets,
                                       args.steps, rank == args.profile_rank)
    return out


def reference_losses(steps: int) -> list[float]:
    model, tokens, targets = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for _ in range(steps):
        loss = lm_loss(model(tokens).logits, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def summarize(name: str, results: list[dict[str, Any]], ref: list[float]) -> dict[str, Any]:
    """One row of the table from every rank's measurements."""
    per_rank = {side: [r[name][side] for r in results] for side in ("torch", "autopar")}
    mean_cpu = {side: [statistics.mean(r["cpu_s"][k] for r in ranks) for k in range(len(ranks[0]["cpu_s"]))]
                for side, ranks in per_rank.items()}
    ratios = [a / t for a, t in zip(mean_cpu["autopar"], mean_cpu["torch"])]
    losses_ok = all(math.isclose(loss, want, rel_tol=1e-4) for ranks in per_rank.values() for r in ranks
                    for loss, want in zip(r["losses"], ref) if loss is not None)
    return {"row": name, "ratio": statistics.median(ratios), "ratios": ratios,
            "torch_cpu_ms": 1e3 * statistics.median(mean_cpu["torch"]),
            "autopar_cpu_ms": 1e3 * statistics.median(mean_cpu["autopar"]),
            "rank_cpu_ms": {side: [1e3 * statistics.median(r["cpu_s"]) for r in ranks] for side, ranks in per_rank.items()},
            "torch_setup_s": max(r["setup_s"] for r in per_rank["torch"]),
            "compile_s": max(r["setup_s"] for r in per_rank["autopar"]),
            "plan": per_rank["autopar"][0]["plan"], "losses_match_single_device": losses_ok,
            "losses": {side: ranks[-1]["losses"] for side, ranks in per_rank.items()}}


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| row | autopar / torch | CPU ms per step per rank (torch / autopar) | predicted ms | compile s "
             "(torch set-up s) | losses = 1 device |", "|---|---|---|---|---|---|"]
    for r in rows:
        predicted = r["plan"].get("predicted_step_s")
        lines.append(f"| {r['row']} | {r['ratio']:.2f} ({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) | "
                     f"{r['torch_cpu_ms']:.0f} / {r['autopar_cpu_ms']:.0f} | "
                     f"{'' if predicted is None else f'{1e3 * predicted:.0f}'} | "
                     f"{r['compile_s']:.2f} ({r['torch_setup_s']:.2f}) | "
                     f"{'yes' if r['losses_match_single_device'] else 'NO'} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=",".join(ROW_NAMES), help="comma-separated subset of " + ", ".join(ROW_NAMES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-steps", type=int, default=3, help="steps whose losses are checked against one device")
    ap.add_argument("--profile", default="", help="a row to profile with torch's profiler")
    ap.add_argument("--profile-rank", type=int, default=0, help="the rank whose profile is reported (a pipeline's "
                    "last stage: 2)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--autopar", type=Path, default=None, help="run another checkout's autopar (a baseline)")
    args = ap.parse_args()
    args.rows = [r.strip() for r in args.rows.split(",")]
    unknown = set(args.rows) - set(ROW_NAMES) | ({args.profile} - set(args.rows) - {""})
    if unknown:
        ap.error(f"unknown rows (or a profiled row not run) {sorted(unknown)}; rows: {ROW_NAMES}")
    return args


def main() -> None:
    args = parse_args()
    ref = reference_losses(args.check_steps)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    results = run_ranks(rank_main, 4, args, timeout_s=300)
    wall, load_after = time.perf_counter() - t0, os.getloadavg()[0]
    rows = [summarize(name, results, ref) for name in args.rows]
    print(render(rows))
    print(f"{args.reps} repetitions x {args.steps} steps per side and row, after {max(args.warmup, args.check_steps)}"
          f" warm-up steps; wall {wall:.0f} s; 1-min load {load_before:.1f} before, {load_after:.1f} after "
          f"(4 ranks on {os.cpu_count()} cores); autopar from {Path(autopar.__file__).parents[1]}")
    if not all(r["losses_match_single_device"] for r in rows):
        print("some row's losses differ from the single-device model's: " +
              ", ".join(r["row"] for r in rows if not r["losses_match_single_device"]))
    if args.profile:
        print(results[args.profile_rank]["profile"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "sizes": SIZES, "batch": BATCH, "config": {k: str(v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "autopar": str(Path(autopar.__file__).parents[1]), "reference_losses": ref, "rows": rows, "wall_s": wall,
        "loadavg": [load_before, load_after]}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
