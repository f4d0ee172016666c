"""What the planner chooses as memory gets tight, and how close its figures come to published runs.

Three tables, every plan made by ``autopar.plan`` on meta-device models (nothing runs):

1. The Llama-3-8B shape (vocab 128256, hidden 4096, 32 layers, 32 heads / 8 kv heads,
   ffn 14336, sequence 4096, global batch 8) on 8 H100s (one ``dp`` axis, which the
   planner may also use for tensor parallelism or to store parameters split) at memory
   limits of 80, 40, 24 and 16 GiB: the memory plan chosen, predicted step time and peak
   memory, and planning seconds. A tighter limit must never predict a faster step.
2. The Llama-3-70B shape (hidden 8192, 80 layers, 64 / 8 heads, ffn 28672) on 64 H100s
   (dp=8 x tp=8) at 80 GiB.
3. Megatron-LM's pipeline-free GPT rows (Narayanan et al. 2021, arXiv 2104.04473, Table 1:
   1.7B on 32, 3.6B on 64, 7.5B on 128, 18.4B on 256 A100s; sequence 2048, vocab 51200,
   global batch 512 or 1024; measured 137, 138, 142 and 135 TFLOP/s per GPU with full
   recomputation), each on Megatron's own dp x tp mesh, with the predicted TFLOP/s per GPU
   (Megatron's formula: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step, recomputation
   included, over the predicted step time) beside the published figure: once as autopar
   plans it, once pinned to Megatron's configuration (full recomputation of every layer,
   its TP plan as the mesh's tp axis allows, parameters replicated on dp: ``zero={"dp": 0}``).

4. Measured beside predicted for small sizes: the example GPT and Llama (batch 16 x seq 64)
   compiled on 2 forked CPU ranks (dp=2, 2x2 for dp x tp) under each memory plan, each
   rank's peak of live tensor bytes over a training step (``autopar.runtime.memory``)
   beside ``plan.predicted.peak_memory_bytes``.

Usage: ``python benchmarks/memory_sweep.py [--quick] [--json out.json]`` (``--quick``: the
8B rows at 80 and 40 GiB and the measured table only). Single runs on whatever machine this is: planning seconds are
noisy; the plans and predictions are deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` importable when run as a script

import autopar  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.gpt import TP_PLAN as GPT_TP_PLAN  # noqa: E402
from examples.gpt import lm_loss as gpt_loss  # noqa: E402
from examples.llama import Llama, from_hf_config, lm_loss  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "memory_sweep.json"
GiB = 2**30
LLAMA_8B = from_hf_config("llama-3-8b", max_seq_len=4096)
"""Llama-3-8B's published config (``examples/configs/llama-3-8b.json``) at sequence 4096."""
LLAMA_70B = from_hf_config("llama-3-70b", max_seq_len=4096)


@dataclass(frozen=True)
class MegatronRow:
    """One pipeline-free row of Table 1 of arXiv 2104.04473."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    gpus: int
    batch: int
    published_tflops: float


MEGATRON = (MegatronRow("1.7B", 24, 2304, 24, 1, 32, 512, 137.0), MegatronRow("3.6B", 32, 3072, 30, 2, 64, 512, 138.0),
            MegatronRow("7.5B", 32, 4096, 36, 4, 128, 512, 142.0), MegatronRow("18.4B", 48, 6144, 40, 8, 256, 1024, 135.0))


@dataclass
class Result:
    label: str
    mesh: dict[str, int]
    limit_gib: float | None
    memory_plan: str = ""
    step_ms: float | None = None
    peak_gib: float | None = None
    plan_s: float = 0.0
    error: str | None = None
    tflops: float | None = None
    published_tflops: float | None = None


def plan_row(label: str, model: torch.nn.Module, tokens: torch.Tensor, loss: Any, mesh: autopar.Mesh,
             limit_gib: float | None, **pins: Any) -> Result:
    result = Result(label, dict(zip(mesh.names, mesh.shape)), limit_gib)
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, mesh, (tokens,), loss_fn=loss, example_targets=(tokens,),
                            memory_limit=None if limit_gib is None else limit_gib * GiB,
                            **{"pipeline": False, **pins})
        result.memory_plan = plan.memory.describe()
        result.step_ms = plan.predicted.step_time_s * 1e3
        result.peak_gib = plan.predicted.peak_memory_bytes / GiB
    except autopar.MemoryLimitError as exc:
        result.error = str(exc)
    result.plan_s = time.perf_counter() - start
    print(f"  {label} at {limit_gib} GiB: {result.plan_s:.1f} s", file=sys.stderr, flush=True)
    return result


def llama_rows(quick: bool) -> list[Result]:
    with torch.device("meta"):
        model = Llama(LLAMA_8B)
        tokens = torch.randint(0, LLAMA_8B.vocab_size, (8, LLAMA_8B.max_seq_len))
    rows = [plan_row("Llama-3-8B", model, tokens, lm_loss, autopar.Mesh({"dp": 8}, hardware="h100"), gib)
            for gib in ((80, 40) if quick else (80, 40, 24, 16))]
    if not quick:
        with torch.device("meta"):
            big = Llama(LLAMA_70B)
            tokens = torch.randint(0, LLAMA_70B.vocab_size, (64, LLAMA_70B.max_seq_len))
        rows.append(plan_row("Llama-3-70B", big, tokens, lm_loss, autopar.Mesh({"dp": 8, "tp": 8}, hardware="h100"), 80))
    return rows


def megatron_flops(row: MegatronRow, seq: int = 2048, vocab: int = 51200) -> float:
    """FLOPs per step as Megatron counts them (forward, backward and full recomputation)."""
    b, s, l, h = row.batch, seq, row.layers, row.hidden
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))


def megatron_rows() -> list[Result]:
    rows = []
    for row in MEGATRON:
        cfg = GPTConfig(vocab_size=51200, max_seq_len=2048, hidden=row.hidden, heads=row.heads, layers=row.layers)
        with torch.device("meta"):
            model = GPT(cfg)
            tokens = torch.randint(0, cfg.vocab_size, (row.batch, cfg.max_seq_len))
        axes = {"dp": row.gpus // row.tp, "tp": row.tp} if row.tp > 1 else {"dp": row.gpus}
        mesh = autopar.Mesh(axes, hardware="a100")
        megatron = {"checkpoint": "full", "zero": {"dp": 0}, "data_axes": ("dp",), "micro_batches": 1,
                    **({"constraints": GPT_TP_PLAN} if row.tp > 1 else {})}
        for label, pins in ((f"GPT {row.name} autopar", {}), (f"GPT {row.name} as Megatron", megatron)):
            result = plan_row(label, model, tokens, gpt_loss, mesh, 80, **pins)
            result.published_tflops = row.published_tflops
            if result.step_ms is not None:
                result.tflops = megatron_flops(row) / (result.step_ms / 1e3) / row.gpus / 1e12
            rows.append(result)
    return rows


@dataclass
class Measured:
    model: str
    config: str
    memory_plan: str
    measured_mib: float
    predicted_mib: float

    @property
    def error(self) -> float:
        return self.predicted_mib / self.measured_mib - 1


MEASURED_CONFIGS: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    "ddp": ((2,), {}), "zero3": ((2,), {"zero": {"dp": 3}}), "full ckpt": ((2,), {"checkpoint": "full"}),
    "selective ckpt": ((2,), {"checkpoint": "selective"}), "4 micro-batches": ((2,), {"micro_batches": 4}),
    "bf16 mixed": ((2,), {"precision": "bf16"}), "dp2 x tp2": ((2, 2), {"tp": True}),
}


def _measure_rank(rank: int, world: int, model_name: str, shape: tuple[int, ...], options: dict[str, Any]
                  ) -> tuple[str, float, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.memory import measure_step
    from examples import gpt, llama

    module = {"gpt": gpt, "llama": llama}[model_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[:len(shape)])
    model, inputs, loss_fn, targets = module.build(batch=16)
    kwargs: dict[str, Any] = {"data_axes": ("dp",), **{k: v for k, v in options.items() if k != "tp"}}
    if options.get("tp"):
        kwargs["constraints"] = module.TP_PLAN
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                         **{"pipeline": False, **kwargs})
    measured = measure_step(pm, (*inputs, *targets), torch.optim.AdamW(pm.parameters(), lr=1e-3))
    return pm.plan.memory.describe(), measured.peak_bytes / 2**20, pm.plan.predicted.peak_memory_bytes / 2**20


def measured_rows() -> list[Measured]:
    from autopar.runtime.forked import run_ranks

    rows = []
    for model_name in ("gpt", "llama"):
        for config, (shape, options) in MEASURED_CONFIGS.items():
            results = run_ranks(_measure_rank, int(torch.tensor(shape).prod()), model_name, shape, options)
            plan, measured, predicted = max(results, key=lambda r: r[1])  # the rank that holds the most
            rows.append(Measured(model_name, config, plan, measured, predicted))
    return rows


def print_measured(rows: list[Measured]) -> None:
    print(f"\n{'model':<6} {'config':<16} {'measured MiB':>12} {'predicted MiB':>13} {'error':>7}  memory plan")
    for r in rows:
        print(f"{r.model:<6} {r.config:<16} {r.measured_mib:12.2f} {r.predicted_mib:13.2f} {r.error:+7.1%}  "
              f"{r.memory_plan}")


def print_table(rows: list[Result]) -> None:
    print(f"{'model':<22} {'mesh':<14} {'limit':>6} {'step ms':>9} {'peak GiB':>9} {'TFLOP/s':>8} {'publ.':>6} "
          f"{'plan s':>7}  memory plan")
    for r in rows:
        mesh = "x".join(f"{k}{v}" for k, v in r.mesh.items())
        step = f"{r.step_ms:9.1f}" if r.step_ms is not None else f"{'-':>9}"
        peak = f"{r.peak_gib:9.2f}" if r.peak_gib is not None else f"{'-':>9}"
        tf = f"{r.tflops:8.1f}" if r.tflops is not None else f"{'-':>8}"
        pub = f"{r.published_tflops:6.0f}" if r.published_tflops is not None else f"{'-':>6}"
        limit = f"{r.limit_gib:g}" if r.limit_gib is not None else "-"
        print(f"{r.label:<22} {mesh:<14} {limit:>6} {step} {peak} {tf} {pub} {r.plan_s:7.1f}  "
              f"{r.memory_plan or r.error}")


def monotone(rows: list[Result]) -> bool:
    """A tighter limit never predicts a faster step (rows of one model, loosest limit first)."""
    steps = [r.step_ms for r in rows if r.step_ms is not None]
    return all(a <= b for a, b in zip(steps, steps[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    llama = llama_rows(args.quick)
    rows = llama + ([] if args.quick else megatron_rows())
    print_table(rows)
    eight = [r for r in llama if r.label == "Llama-3-8B"]
    print(f"\nLlama-3-8B: tighter limits never predict a faster step: {monotone(eight)}")
    measured = measured_rows()
    print_measured(measured)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "monotone_8b": monotone(eight),
                                     "measured": [{**asdict(m), "error": m.error} for m in measured]}, indent=1))
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
