"""The jobs a user brings, planned with nothing pinned: how long ``autopar.plan`` takes and what it predicts.

Each row is one model on one mesh with only what the row names pinned (a memory limit, a batch), planned
cold in a process of its own (``--runs`` times; the median reported), beside the same job planned as the
planner did before it searched pipelines by default (``today``: ``pipeline=False``, or, for the rows whose
depth the benchmark always searched, ``Pipeline(from_axis=<first axis>)``, which the default now is):
its time, and its plan's predicted step, which the new plan must not exceed by more than 1%. For those
rows the default is the search they pinned, so today's run is the new one.

Rows (targets: issue 28):

| row | job | target |
|---|---|---|
| hf-8b-64 | HF Llama-3-8B shape, dp8 x tp8 H100, ample memory | <= 3 s |
| 8b-8-24g | Llama-3-8B (examples/llama.py), dp8 H100 at 24 GiB (memory-bound) | <= 10 s |
| gpt2-1.7b-32 | HF-shaped GPT-2 1.7B (Megatron's first row), dp32 A100, batch 512 x 2048 | <= 10 s |
| mixtral-64 | Mixtral-8x7B shape, 32 layers, dp8 x tp8 H100 | <= 30 s |
| gpt-39b-512, gpt3-175b-1024, llama-70b-512 | Megatron's GPT 39.1B and GPT-3 175B on A100, Llama-3-70B on H100, tp8 | <= 60 s |
| gpt-1t-3072 | Megatron Table 1's GPT 1T on 3072 A100, tp8 | <= 120 s |
| llama-70b-open | Llama-3-70B on ``Mesh(devices=512)``, H100: the axes chosen (``search.layout``) | <= 120 s |

The meshes keep tp = 8 within a node, the rest on dp: the planner takes pp out of dp. The open row's
"today" is the same job on the hand layout dp64 x tp8 with its depth searched (the llama-70b-512 row).

Usage: ``python benchmarks/search_jobs.py [--only ROW ...] [--runs N] [--no-today] [--json out.json]``;
``--job ROW --today|--new`` plans one row in this process and prints its result as JSON (what each cold run is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` and ``benchmarks`` importable when run as a script

import autopar  # noqa: E402
from benchmarks.megatron_gpt import build as megatron_build  # noqa: E402
from examples import gpt, hf_models, llama, moe  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "search_jobs.json"
GiB = 2**30
TOLERANCE = 0.01
"""The new plan's predicted step may exceed today's by this fraction."""

Step = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]
"""(model on the meta device, example inputs, the rest of ``plan``'s step arguments)."""


def _hf_llama_8b() -> Step:
    c = llama.hf_config("llama-3-8b")
    model, inputs, loss_fn, targets, kwargs = hf_models.build_llama(
        layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"],
        kv_heads=c["num_key_value_heads"], intermediate=c["intermediate_size"], vocab=c["vocab_size"], seq=4096,
        batch=8, device="meta")
    return model, inputs, {"loss_fn": loss_fn, "example_targets": targets, "example_kwargs": kwargs}


def _lm(model: torch.nn.Module, tokens: torch.Tensor, loss: Callable[..., torch.Tensor]) -> Step:
    return model, (tokens,), {"loss_fn": loss, "example_targets": (tokens,)}


def _llama(name: str, batch: int, seq: int) -> Step:
    cfg = llama.from_hf_config(name, max_seq_len=seq)
    with torch.device("meta"):
        model = llama.Llama(cfg)
        tokens = torch.zeros(batch, seq, dtype=torch.long)
    return _lm(model, tokens, llama.lm_loss)


def _hf_gpt2(layers: int, hidden: int, heads: int, batch: int) -> Step:
    model, inputs, loss_fn, targets, kwargs = hf_models.build_gpt2(layers=layers, hidden=hidden, heads=heads,
                                                                   vocab=51200, seq=2048, batch=batch, device="meta")
    return model, inputs, {"loss_fn": loss_fn, "example_targets": targets, "example_kwargs": kwargs}


def _mixtral() -> Step:
    cfg = moe.from_hf_config("mixtral-8x7b", max_seq_len=4096, capacity_factor=1.25)
    model, inputs, loss_fn, targets = moe.build(cfg, batch=64, device="meta")
    return model, inputs, {"loss_fn": loss_fn, "example_targets": targets}


def _megatron(layers: int, hidden: int, heads: int, batch: int) -> Step:
    cfg = gpt.GPTConfig(vocab_size=51200, max_seq_len=2048, hidden=hidden, heads=heads, layers=layers)
    model, tokens = megatron_build(cfg, batch)
    return _lm(model, tokens, gpt.lm_loss)


@dataclass(frozen=True)
class Job:
    name: str
    label: str
    build: Callable[[], Step]
    mesh: dict[str, int] | int
    """The mesh's axes, or its number of devices (the axes left to the planner)."""
    hardware: str
    target_s: float
    options: dict[str, Any] = field(default_factory=dict)
    depth_searched: bool = False
    """Today's benchmark searched its depth (``Pipeline(from_axis=...)``): today's pins are that."""
    today_mesh: dict[str, int] | None = None
    """Where today's run plans an open mesh's job: a hand layout, its depth searched."""


JOBS = (
    Job("hf-8b-64", "HF Llama-3-8B, 64 H100", _hf_llama_8b, {"dp": 8, "tp": 8}, "h100", 3.0),
    Job("8b-8-24g", "Llama-3-8B, 8 H100 at 24 GiB", lambda: _llama("llama-3-8b", 8, 4096), {"dp": 8}, "h100", 10.0,
        {"memory_limit": 24 * GiB}),
    Job("gpt2-1.7b-32", "GPT-2 1.7B, 32 A100, 512 x 2048", lambda: _hf_gpt2(24, 2304, 24, 512), {"dp": 32}, "a100",
        10.0),
    Job("mixtral-64", "Mixtral-8x7B (32 layers), 64 H100", _mixtral, {"dp": 8, "tp": 8}, "h100", 30.0),
    Job("gpt-39b-512", "GPT 39.1B, 512 A100", lambda: _megatron(48, 8192, 64, 1536), {"dp": 64, "tp": 8}, "a100",
        60.0, depth_searched=True),
    Job("gpt3-175b-1024", "GPT-3 175B, 1024 A100", lambda: _megatron(96, 12288, 96, 1536), {"dp": 128, "tp": 8},
        "a100", 60.0, depth_searched=True),
    Job("llama-70b-512", "Llama-3-70B, 512 H100", lambda: _llama("llama-3-70b", 1024, 4096), {"dp": 64, "tp": 8},
        "h100", 60.0, depth_searched=True),
    Job("gpt-1t-3072", "GPT 1T, 3072 A100", lambda: _megatron(128, 25600, 160, 3072), {"dp": 384, "tp": 8}, "a100",
        120.0, depth_searched=True),
    Job("llama-70b-open", "Llama-3-70B, Mesh(devices=512) H100", lambda: _llama("llama-3-70b", 1024, 4096), 512,
        "h100", 120.0, today_mesh={"dp": 64, "tp": 8}),
)


def plan_job(job: Job, today: bool) -> dict[str, Any]:
    """Plan ``job`` once in this process: the new default, or (``today``) as the planner did before."""
    model, inputs, step = job.build()
    axes = job.today_mesh if today and job.today_mesh is not None else job.mesh
    mesh = autopar.Mesh(devices=axes, hardware=job.hardware) if isinstance(axes, int) else autopar.Mesh(axes, job.hardware)
    pins = dict(job.options)
    if today and job.today_mesh is None:
        pins["pipeline"] = autopar.Pipeline(from_axis=next(iter(axes))) if job.depth_searched else False
    began = time.perf_counter()
    try:
        plan = autopar.plan(model, mesh, inputs, **step, **pins)
    except autopar.InputError as exc:
        return {"seconds": time.perf_counter() - began, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    pipe = plan.pipeline
    return {"seconds": time.perf_counter() - began, "step_s": plan.predicted.step_time_s,
            "peak_gib": plan.predicted.peak_memory_bytes / GiB, "memory": plan.memory.describe(),
            "pipeline": f"pp={pipe.size} {pipe.schedule} v{pipe.virtual_stages} m={pipe.micro_batches}" if pipe
            else "none"}


def cold(job: Job, today: bool, timeout_s: float) -> dict[str, Any]:
    """``plan_job`` in a process of its own (nothing imported, traced or cached before it)."""
    command = [sys.executable, __file__, "--job", job.name, "--today" if today else "--new"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"seconds": timeout_s, "error": f"still planning after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"seconds": float("nan"), "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median seconds (the lower middle of an even count); its plan is every run's."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "all_seconds": [round(r["seconds"], 2) for r in runs]}


def describe(run: dict[str, Any] | None) -> str:
    if run is None:
        return "-"
    if "error" in run:
        return f"{run['seconds']:.1f} s, {run['error'][:60]}"
    return f"{run['seconds']:.1f} s, {run['step_s']:.3f} s/step, {run['pipeline']}, {run['peak_gib']:.1f} GiB"


def verdict(job: Job, new: dict[str, Any], today: dict[str, Any] | None) -> str:
    fast = "error" not in new and new["seconds"] <= job.target_s
    good = today is None or "error" in today or ("error" not in new and
                                                 new["step_s"] <= today["step_s"] * (1 + TOLERANCE))
    return ("PASS" if fast else "SLOW") + ("" if good else " WORSE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=[j.name for j in JOBS], help="run only this row (repeatable)")
    parser.add_argument("--runs", type=int, default=3, help="cold runs per row and mode (median reported)")
    parser.add_argument("--no-today", action="store_true", help="skip planning each row as before")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may plan")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--job", choices=[j.name for j in JOBS], help=argparse.SUPPRESS)
    parser.add_argument("--today", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--new", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(plan_job(next(j for j in JOBS if j.name == args.job), today=args.today)))
        return 0
    rows = []
    for job in (j for j in JOBS if not args.only or j.name in args.only):
        new = median_run([cold(job, False, args.timeout) for _ in range(args.runs)])
        today = None if args.no_today else new if job.depth_searched else \
            median_run([cold(job, True, args.timeout) for _ in range(args.runs)])  # a depth row's is the same search
        rows.append({"row": job.name, "job": job.label, "mesh": job.mesh, "target_s": job.target_s, "new": new,
                     "today": today, "verdict": verdict(job, new, today)})
        print(f"{job.label:<36} <= {job.target_s:>4.0f} s  new: {describe(new)}  |  today: {describe(today)}  "
              f"{rows[-1]['verdict']}", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": args.runs, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
