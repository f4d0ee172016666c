"""autopar's plan against the best hand-picked Megatron-style grid plan, priced by the same cost model.

For each shape, every point of a Megatron-LM-style grid is priced by autopar's own functions (a
plan with every choice pinned, never a hand formula): tensor parallelism tp in {1, 2, 4, 8}
inside a node (the example's TP plan pinned with ``constraints=``), sequence parallelism on/off
(its TP+SP plan instead; only with tp > 1), pipeline degree pp (dividing devices / tp, the layers
dividing into pp x v stages as Megatron's schedules need), data parallelism dp = devices / (tp pp)
with parameters replicated (``zero={"dp": 0}``, ``data_axes=("dp",)``), micro-batch size b (global
batch / (dp b) micro-batches, at least pp for 1F1B), schedule 1F1B or interleaved 1F1B with v
stages per rank (``Pipeline(schedule=..., micro_batches=..., virtual_stages=...)``; pp = 1: no
pipeline, the micro-batches as gradient accumulation), and full activation checkpointing or none.
Mesh axes ``{"pp": pp, "dp": dp, "tp": tp}``, pp outermost; memory limit the hardware default
(``HardwareProfile.memory_limit()``: 80 GiB less the allocator margin). Points whose busiest rank
does not fit are skipped and counted.

Tractable without cheating: the stage mesh is planned once per (tp, sp, pp, b, checkpointing),
exactly as ``autopar.plan`` plans a pinned pipeline (``search.stage_plans.StageMesh``, the memory
limit lifted so that no memory search changes the pinned configuration), and every schedule / v
at that micro-batch count is priced from that stage plan by ``search.planned.with_pipeline``, the
cheap repricing the pipeline search itself uses. Pruned first by cheap necessary conditions:
(1) the parameter and optimizer state alone, 16 bytes x parameters / (tp pp), is above the limit
(a lower bound on the busiest rank: fp32 Adam moments and master weights, bf16 weights and
gradients at least); (2) a micro-batch size none of whose schedules fit makes every larger one
skipped too for that (tp, sp, pp, checkpointing): a rank's in-flight activations grow with b.

The grid plans each captured shape many times, so it runs inside ``autopar.capture.reuse_captures``
(one trace per micro-batch shape; the plans are the same, see tests/test_hand_plan_grid.py).

autopar's plan (``autopar_plan``; planned outside ``reuse_captures`` so that its planning seconds,
recorded, are ``autopar.plan``'s own; the library's own depth search, ``Pipeline(from_axis="dp")``,
would plan every divisor of the data axis, 1 to 64 here, past this script's time budget, so the
depths are those the grid planned): for each pp degree the grid planned (past the state bound), mesh
``{"pp": pp, "dp": devices // (8 pp), "tp": 8}`` with no pins at all (the ILP decides how to use
the tp axis: TP, SP, data parallel or ZeRO; the memory choices and the pipeline's schedule, v
and micro-batches are searched), the fastest over pp. Its ratio best grid / autopar >= 1 means
autopar is predicted no slower.

Shapes:
- GPT-3 175B (96 layers, hidden 12288, 96 heads, vocab 51200, sequence 2048) on 1024 A100s,
  global batch 1536. Megatron-LM publishes 140 TFLOP/s per GPU for exactly this run (Narayanan
  et al. 2021, arXiv 2104.04473, §5.1 "Training Time Estimates": "On n = 1024 A100 GPUs using
  batch size 1536, we achieve X = 140 teraFLOP/s per GPU"; Table 1 has no 175B row; Table 2's
  153/149/141 are 384/768/1536 GPUs). Its configuration, Megatron-LM's
  ``examples/pretrain_gpt3_175B.sh`` (128 nodes x 8): tp 8, pp 16, micro-batch 1 (so dp 8, 192
  micro-batches), the default non-interleaved 1F1B schedule, activation checkpointing, no
  sequence parallelism (which came later, arXiv 2205.05198). That row is priced and printed
  beside the published figure. TFLOP/s per GPU by Megatron's formula 96 B s l h^2 (1 + s/6h +
  V/16lh) (its eq. 3, recomputation counted whether or not it runs) over the predicted step.
- Llama-3-70B (80 layers, hidden 8192, 64 / 8 heads, ffn 28672, vocab 128256) on 512 H100s,
  sequence 4096, global batch 1024 (4M tokens: Llama 3's initial batch, arXiv 2407.21783
  §3.4.3). TFLOP/s per GPU there is model FLOPs, 6 N T + 12 l h s T (the PaLM MFU count, N every parameter,
  attention included, recomputation not), over the predicted step.

Usage: ``python benchmarks/hand_plan_grid.py [--quick] [--json out.json]``. ``--quick``: GPT-3
only, tp 8, pp 16, b 1 and 2, v 2. Progress on stderr; the tables on stdout; JSON (every
priced point, the skipped counts, autopar's plan and planning seconds) to
benchmarks/results/hand_plan_grid.json. Nothing runs on devices (meta-device models).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` and ``benchmarks`` importable when run as a script

import autopar  # noqa: E402
from autopar.capture import reuse_captures  # noqa: E402
from autopar.errors import InputError  # noqa: E402
from autopar.pipeline.spec import Pipeline
from benchmarks.grid_pricing import (GiB, NODE, Grid, GridResult, Point, Priced, Shape, build,  # noqa: E402
                                     mesh_axes, parameters, price_grid, price_point)
from examples import gpt, llama  # noqa: E402

GPT3_175B = Shape(
    name="GPT-3 175B", config=gpt.GPTConfig(vocab_size=51200, max_seq_len=2048, hidden=12288, heads=96, layers=96),
    devices=1024, hardware="a100", batch=1536, published_tflops=140.0,
    published=Point(tp=8, pp=16, dp=8, sp=False, b=1, m=192, schedule="1f1b", v=1, checkpoint="full"),
    gap_note="the published figure is measured end to end (data loading, logging, kernels below their "
             "calibrated speed); the prediction prices one step of the example GPT from autopar's "
             "calibrated op and collective times")
LLAMA3_70B = Shape(
    name="Llama-3-70B", config=llama.from_hf_config("llama-3-70b", max_seq_len=4096),
    devices=512, hardware="h100", batch=1024)


@dataclass(kw_only=True)
class AutoparResult:
    """autopar's own plan, the fastest over the pipeline degrees tried."""

    mesh: dict[str, int] | None = None
    """The chosen plan's mesh."""
    schedule: str | None = None
    """Its pipeline schedule (None: no pipeline)."""
    v: int = 1
    """Its stages per pp rank."""
    m: int = 1
    """Its micro-batches."""
    memory: str = ""
    """Its memory plan (``plan.memory.describe()``)."""
    step_s: float | None = None
    """Its predicted step seconds (None: no degree gave a plan)."""
    peak_gib: float = 0.0
    """Its predicted peak memory, GiB."""
    tflops: float = 0.0
    """As ``Priced.tflops``."""
    seconds: float = 0.0
    """Wall seconds planning every degree."""
    chosen_seconds: float = 0.0
    """Wall seconds of the chosen degree's ``autopar.plan``."""
    tried: list[str] = field(default_factory=list)
    """One line per degree: its plan or why none."""

    def describe(self) -> str:
        if self.step_s is None:
            return "no plan"
        mesh = " x ".join(f"{k}{v}" for k, v in (self.mesh or {}).items())
        sched = f"{self.schedule} v{self.v} m={self.m}" if self.schedule else f"no pipeline, {self.m} micro-batches"
        return (f"{mesh}, {sched}, {self.memory}: {self.step_s:.2f} s, {self.tflops:.1f} TFLOP/s, "
                f"{self.peak_gib:.1f} GiB")


# ---- autopar's plan: the one function to switch to the library's pipeline-degree search when it lands ----
def autopar_plan(model: nn.Module, devices: int, shape: Shape, tokens: torch.Tensor, pps: tuple[int, ...]
                 ) -> AutoparResult:
    """autopar's plan of ``shape``: each pp in ``pps`` planned on ``{"pp": pp, "dp": devices // (tp pp),
    "tp": tp}`` (tp: one node's devices) with nothing pinned, schedule, stages per rank,
    micro-batches and memory choices searched, and the fastest kept (the library's depth search,
    ``Pipeline(from_axis=...)``, restricted to the degrees the grid planned: module docstring)."""
    module = gpt if shape.is_gpt else llama
    result = AutoparResult()
    began = time.perf_counter()
    for pp in pps:
        tp = min(NODE, devices // pp)
        axes = mesh_axes(pp, devices // (pp * tp), tp)
        started = time.perf_counter()
        try:
            plan = autopar.plan(model, autopar.Mesh(axes, hardware=shape.hardware), (tokens,), loss_fn=module.lm_loss,
                                example_targets=(tokens,), memory_limit=shape.memory_limit,
                                pipeline=Pipeline(axis="pp") if pp > 1 else False)
        except InputError as exc:  # MemoryLimitError included: no plan on this degree
            result.tried.append(f"pp={pp} {axes}: no plan ({time.perf_counter() - started:.0f} s): {str(exc)[:400]}")
            continue
        seconds = time.perf_counter() - started
        step_s, pipe = plan.predicted.step_time_s, plan.pipeline
        sched = f"{pipe.schedule} v{pipe.virtual_stages} m={pipe.micro_batches}" if pipe else "no pipeline"
        result.tried.append(f"pp={pp} {axes}: {step_s:.2f} s, {sched}, {plan.memory.describe()} ({seconds:.0f} s)")
        print(f"  autopar {shape.name} {result.tried[-1]}", file=sys.stderr, flush=True)
        if result.step_s is None or step_s < result.step_s:
            result.mesh, result.memory, result.step_s = axes, plan.memory.describe(), step_s
            result.chosen_seconds = seconds
            result.schedule = pipe.schedule if pipe else None
            result.v, result.m = (pipe.virtual_stages, pipe.micro_batches) if pipe else (1, plan.memory.micro_batches)
            result.peak_gib = plan.predicted.peak_memory_bytes / GiB
            result.tflops = shape.flops(parameters(model)) / step_s / devices / 1e12
    result.seconds = time.perf_counter() - began
    return result


DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "hand_plan_grid.json"
FULL = Grid(tps=(1, 2, 4, 8), bs=(1, 2, 4, 8), vs=(2, 3, 4, 6))
QUICK = Grid(tps=(8,), bs=(1, 2), vs=(2,), pps=(16,))
SLOWER_NOTE = 0.2
"""Prediction and publication further apart than this fraction get a printed note."""


def fmt_point(p: Priced) -> str:
    sched = "-" if p.schedule is None else p.schedule + (f" v{p.v}" if p.v > 1 else "")
    return (f"{p.tp:<3} {p.pp:<3} {p.dp:<4} {'on' if p.sp else 'off':<3} {p.b:<2} {p.m:<4} {sched:<20} "
            f"{p.checkpoint:<5} {p.step_s:9.2f} {p.tflops:8.1f} {p.peak_gib:8.1f}")


HEADER = (f"{'tp':<3} {'pp':<3} {'dp':<4} {'sp':<3} {'b':<2} {'m':<4} {'schedule':<20} {'ckpt':<5} {'step s':>9} "
          f"{'TFLOP/s':>8} {'peak GiB':>8}")


def report(result: GridResult, auto: AutoparResult, published: Priced | None, top: int) -> None:
    shape = result.shape
    print(f"\n== {shape.name} on {shape.devices} {shape.hardware.upper()}s, global batch {shape.batch} x seq "
          f"{shape.seq} ({shape.flops_label}) ==")
    print(f"grid: {result.stage_plans} stage plans, {len(result.priced)} points priced and fitting, "
          f"{result.unfit} priced but over the limit, {result.pruned_state} (tp, pp) pruned by state bytes, "
          f"{result.pruned_b} configurations skipped by the micro-batch rule; {result.seconds:.0f} s")
    print(HEADER)
    for p in sorted(result.priced, key=lambda q: q.step_s)[:top]:
        print(fmt_point(p))
    best = result.best
    if best is None:
        print("no grid point fits")
    if published is not None:
        pub = shape.published_tflops or 0.0
        print(f"\nMegatron's published configuration priced by autopar's model:\n{HEADER}\n{fmt_point(published)}")
        gap = published.tflops / pub - 1
        print(f"published: {pub:.0f} TFLOP/s per GPU; predicted {published.tflops:.1f} ({gap:+.0%})")
        if abs(gap) > SLOWER_NOTE:
            print(f"note: prediction and publication differ by {gap:+.0%}: {shape.gap_note}")
    print(f"\nautopar's plan ({auto.seconds:.0f} s planning, all pp degrees; fastest pp's own plan "
          f"{auto.chosen_seconds:.1f} s): {auto.describe()}")
    for line in auto.tried:
        print(f"  {line}")
    if best is not None and auto.step_s is not None:
        ratio = best.step_s / auto.step_s
        print(f"best grid {best.step_s:.2f} s / autopar {auto.step_s:.2f} s = {ratio:.3f} "
              f"({'autopar no slower' if ratio >= 1 else 'AUTOPAR SLOWER than the best grid plan'})")


def run_shape(shape: Shape, grid: Grid, top: int) -> dict[str, object]:
    model, tokens = build(shape)
    with reuse_captures():  # the grid plans each captured shape many times: trace it once
        result = price_grid(shape, model, tokens, grid)
        published = None
        if shape.published is not None:
            found = [p for p in result.priced + result.over if p.key() == shape.published.key()]
            published = found[0] if found else price_point(shape, model, tokens, shape.published)
    # autopar's plan outside: its planning seconds are those of autopar.plan alone
    auto = autopar_plan(model, shape.devices, shape, tokens, result.pps)
    report(result, auto, published, top)
    best = result.best
    ratio = None if best is None or auto.step_s is None else best.step_s / auto.step_s
    return {"shape": shape.name, "devices": shape.devices, "hardware": shape.hardware, "batch": shape.batch,
            "grid": asdict(grid), "stage_plans": result.stage_plans, "grid_seconds": result.seconds,
            "unfit": result.unfit, "pruned_state": result.pruned_state, "pruned_b": result.pruned_b,
            "priced": [asdict(p) for p in sorted(result.priced, key=lambda q: q.step_s)],
            "best_grid": None if best is None else asdict(best),
            "published_config": None if published is None else asdict(published),
            "published_tflops": shape.published_tflops, "autopar": asdict(auto), "ratio_best_grid_over_autopar": ratio,
            "autopar_no_slower": None if ratio is None else ratio >= 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-3 only, a reduced grid")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--top", type=int, default=8, help="grid plans listed per shape")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    shapes = [(GPT3_175B, QUICK if args.quick else FULL)] + ([] if args.quick else [(LLAMA3_70B, FULL)])
    rows = [run_shape(shape, grid, args.top) for shape, grid in shapes]
    elapsed = time.perf_counter() - began
    print(f"\nwall time {elapsed:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"quick": args.quick, "seconds": elapsed, "shapes": rows}, indent=1))
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
