"""How long ``autopar.plan`` takes on Llama-style models, stage by stage.

First the Hugging Face ``transformers.LlamaForCausalLM`` at the Llama-3-8B shape (vocab
128256, hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate 14336, sequence 4096,
batch 8; HF computes its own loss from ``labels``) on 64 H100s (``dp=8`` x ``tp=8``), built
on the meta device by ``examples/hf_models.py``. Then, for each combination of depth (2 to 80 layers), width (hidden 4096: 32 heads, 8 kv heads,
ffn 11008; hidden 8192: 64 heads, 8 kv heads, ffn 28672) and mesh (8, 64 and 1024 H100s,
laid out as 2D ``dp`` x ``tp``), the script builds the model on the meta device (vocab
32000, sequence 2048, global batch 2 x dp) and times one ``autopar.plan`` call: wall
seconds for capture, strategy generation (including block folding) and the ILP solve as
``plan.timings`` records them, plus the end-to-end total (the whole ``plan()`` call). It
also shows the ILP's size (``plan.solver["variables"]``) and the predicted step time.

Targets (end-to-end ``plan()`` wall time, issue 8):

* HF Llama-3-8B, 64 devices: <= 5 s
* 32 layers, hidden 4096, 64 devices: <= 5 s
* 80 layers, hidden 8192, 1024 devices: <= 30 s
* the same on pp=8 x dp=16 x tp=8 with the pipeline searched (issue 9): <= 30 s

Every other row is a single run on whatever machine this is, so the figures are noisy;
target rows take the median (by total) of ``--target-runs`` runs. One untimed warm-up plan
of a tiny model of each family run (the example Llama, and a 2-layer HF Llama when HF rows
run) comes first so that one-off costs (lazy imports, first torch tracing, solver load) do
not land on the first row. Each run builds a new model and mesh.

``--quick`` runs the two 64-device targets (HF 8B and 32 layers); ``--only NAME`` runs
just the named target rows (``hf-8b-64``, ``32l-64``, ``80l-1024``, ``80l-1024-pp``; repeatable).
The last is issue 9's: the 80-layer model on ``pp=8 x dp=16 x tp=8`` with
``autopar.Pipeline(axis="pp")``, schedule, stages per rank and micro-batches searched (each
micro-batch count priced from one stage plan on a capture with a symbolic micro-batch, the ILP
solved at a few: ``search.pipeline``; its capture/strategies/solve columns are the
chosen count's, total the whole search).

Every row here pins ``pipeline=False`` (or the pipeline it names): these are the single-mesh planning
times. ``--jobs`` runs ``benchmarks/search_jobs.py`` instead: the jobs a user brings, planned with
nothing pinned (pipelines searched by default), cold, beside today's planner on the same job.

Usage: ``python benchmarks/solve_time.py [--quick | --only NAME ...] [--json out.json] [--target-runs N]``;
``python benchmarks/solve_time.py --jobs [search_jobs.py's arguments]``
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` importable when run as a script

import autopar  # noqa: E402
from examples import hf_models  # noqa: E402  (imports transformers only when an HF model is built)
from examples.llama import Llama, LlamaConfig, hf_config, lm_loss  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "solve_time.json"
HARDWARE = "h100"
VOCAB = 32000
SEQ_LEN = 2048
BATCH_PER_DP = 2
EXAMPLE = "llama"
"""examples/llama.py's Llama."""
HF = "hf-llama"
"""transformers' LlamaForCausalLM, at the Llama-3-8B shape but for its depth."""
_HF_8B = hf_config("llama-3-8b")
HF_8B_SIZES: dict[str, int] = {"hidden": _HF_8B["hidden_size"], "heads": _HF_8B["num_attention_heads"],
                               "kv_heads": _HF_8B["num_key_value_heads"], "intermediate": _HF_8B["intermediate_size"],
                               "vocab": _HF_8B["vocab_size"], "seq": 4096}
"""Llama-3-8B's published config (``examples/configs/llama-3-8b.json``) at sequence 4096."""
HF_BATCH = 8

WIDTHS: dict[int, dict[str, int]] = {
    4096: {"heads": 32, "kv_heads": 8, "ffn_hidden": 11008},
    8192: {"heads": 64, "kv_heads": 8, "ffn_hidden": 28672},
}
MESHES: dict[int, dict[str, int]] = {
    8: {"dp": 2, "tp": 4},
    64: {"dp": 8, "tp": 8},
    1024: {"dp": 128, "tp": 8},
}
LAYERS = (2, 8, 32, 80)
PIPELINE_MESHES: dict[int, dict[str, int]] = {1024: {"pp": 8, "dp": 16, "tp": 8}}
"""Meshes of the pipelined target (the pipeline axis first, as ``autopar.Pipeline`` wants it)."""
PIPELINE_BATCH_PER_DP = 32
"""Sequences per data-parallel replica of a pipelined step: room for 8-64 micro-batches."""


@dataclass(frozen=True)
class Case:
    """One model on one mesh."""

    family: str
    layers: int
    hidden: int
    devices: int
    pipelined: bool = False
    """On ``PIPELINE_MESHES``, the pipeline's schedule, stages per rank and micro-batches searched."""

    @property
    def mesh(self) -> dict[str, int]:
        return PIPELINE_MESHES[self.devices] if self.pipelined else MESHES[self.devices]

    @property
    def batch(self) -> int:
        if self.pipelined:
            return PIPELINE_BATCH_PER_DP * self.mesh["dp"]
        return HF_BATCH if self.family == HF else BATCH_PER_DP * MESHES[self.devices]["dp"]

    @property
    def seq_len(self) -> int:
        return HF_8B_SIZES["seq"] if self.family == HF else SEQ_LEN

    @property
    def vocab(self) -> int:
        return HF_8B_SIZES["vocab"] if self.family == HF else VOCAB


@dataclass(frozen=True)
class Target:
    name: str
    """What ``--only`` calls it."""
    case: Case
    limit_s: float

    def label(self) -> str:
        c = self.case
        model = "HF Llama-3-8B" if c.family == HF else f"{c.layers}L h{c.hidden}"
        pipeline = ", pp=8 searched" if c.pipelined else ""
        return f"{model} on {c.devices} devices{pipeline} <= {self.limit_s:g} s"


HF_8B = Case(HF, 32, 4096, 64)
TARGETS = (Target("hf-8b-64", HF_8B, 5.0), Target("32l-64", Case(EXAMPLE, 32, 4096, 64), 5.0),
           Target("80l-1024", Case(EXAMPLE, 80, 8192, 1024), 30.0),
           Target("80l-1024-pp", Case(EXAMPLE, 80, 8192, 1024, pipelined=True), 30.0))
QUICK = ("hf-8b-64", "32l-64")


@dataclass
class Run:
    capture_s: float
    strategies_s: float
    solve_s: float
    total_s: float
    build_s: float
    variables: int
    constraints: int
    nodes: int
    step_time_s: float


@dataclass
class Row:
    family: str
    layers: int
    hidden: int
    devices: int
    mesh: dict[str, int]
    batch: int
    seq_len: int
    vocab: int
    pipelined: bool = False
    runs: list[Run] = field(default_factory=list)
    error: str | None = None
    """Exception of the failed run, e.g. MemoryLimitError when the model cannot fit the mesh."""
    error_after_s: float | None = None
    """Seconds plan() ran before it raised."""
    target_limit_s: float | None = None

    @property
    def best(self) -> Run | None:
        """The run with the median total (the middle one; the lower middle for an even count)."""
        if not self.runs:
            return None
        ordered = sorted(self.runs, key=lambda r: r.total_s)
        return ordered[(len(ordered) - 1) // 2]

    @property
    def verdict(self) -> str | None:
        if self.target_limit_s is None:
            return None
        run = self.best
        return "PASS" if run is not None and run.total_s <= self.target_limit_s else "MISS"


def target_for(case: Case) -> Target | None:
    return next((t for t in TARGETS if t.case == case), None)


def llama_config(layers: int, hidden: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, max_seq_len=SEQ_LEN, hidden=hidden, layers=layers, **WIDTHS[hidden])


def build_meta(cfg: LlamaConfig, batch: int) -> tuple[Llama, torch.Tensor]:
    with torch.device("meta"):
        model = Llama(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len))
    return model, tokens


def build_case(case: Case) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """(model, example inputs, the rest of ``plan``'s step arguments), on the meta device."""
    if case.family == HF:
        sizes = {**HF_8B_SIZES, "hidden": case.hidden}
        model, inputs, loss_fn, targets, kwargs = hf_models.build_llama(layers=case.layers, batch=case.batch,
                                                                        device="meta", **sizes)
        return model, inputs, {"loss_fn": loss_fn, "example_targets": targets, "example_kwargs": kwargs}
    model, tokens = build_meta(llama_config(case.layers, case.hidden), case.batch)
    return model, (tokens,), {"loss_fn": lm_loss, "example_targets": (tokens,)}


def time_plan(case: Case) -> Run:
    """Build a fresh meta model and mesh, plan it once, and return the timings."""
    gc.collect()
    start = time.perf_counter()
    model, inputs, step = build_case(case)
    mesh = autopar.Mesh(case.mesh, HARDWARE)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = autopar.plan(model, mesh, inputs, **step, pipeline=autopar.Pipeline(axis="pp") if case.pipelined else False)
    total_s = time.perf_counter() - start
    t = plan.timings
    return Run(capture_s=t["capture"], strategies_s=t["strategies"], solve_s=t["solve"], total_s=total_s,
               build_s=build_s, variables=int(plan.solver["variables"]),
               constraints=int(plan.solver["constraints"]), nodes=int(plan.solver["nodes"]),
               step_time_s=plan.predicted.step_time_s)


def warm_up(families: set[str]) -> None:
    """One untimed plan of a tiny model per family: pays lazy imports and first-trace costs."""
    if EXAMPLE in families:
        model, tokens = build_meta(LlamaConfig(), BATCH_PER_DP * MESHES[8]["dp"])
        autopar.plan(model, autopar.Mesh(MESHES[8], HARDWARE), (tokens,), loss_fn=lm_loss,
                     example_targets=(tokens,), pipeline=False)
    if HF in families:
        model, inputs, loss_fn, targets, kwargs = hf_models.build_llama(device="meta")
        autopar.plan(model, autopar.Mesh(MESHES[8], HARDWARE), inputs, loss_fn=loss_fn, example_targets=targets,
                     example_kwargs=kwargs, pipeline=False)


def grid(quick: bool, only: list[str]) -> list[Case]:
    if quick or only:
        names = set(QUICK if quick else ()) | set(only)
        return [t.case for t in TARGETS if t.name in names]
    example = [Case(EXAMPLE, layers, hidden, devices) for devices in MESHES for hidden in WIDTHS for layers in LAYERS]
    return [HF_8B, *example, *(t.case for t in TARGETS if t.case.pipelined)]


def run_row(case: Case, target_runs: int) -> Row:
    target = target_for(case)
    row = Row(family=case.family, layers=case.layers, hidden=case.hidden, devices=case.devices,
              pipelined=case.pipelined, mesh=dict(case.mesh), batch=case.batch, seq_len=case.seq_len, vocab=case.vocab,
              target_limit_s=target.limit_s if target else None)
    for _ in range(target_runs if target else 1):
        start = time.perf_counter()
        try:
            row.runs.append(time_plan(case))
        except Exception as exc:  # a benchmark keeps going; the row shows the failure
            row.error = f"{type(exc).__name__}: {exc}"
            row.error_after_s = time.perf_counter() - start
            break
    return row


def fmt_s(seconds: float) -> str:
    return f"{seconds:.2f}"


def fmt_step(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def short_error(error: str) -> str:
    """``MemoryLimitError: ...; the plan with the least memory needs X`` -> ``MemoryLimitError: ...needs X``."""
    kind, _, message = error.partition(": ")
    return f"{kind}: {message.split('; ')[-1][:70]}"


def render(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"autopar.plan wall time on meta models ({HARDWARE}; example Llama: seq {SEQ_LEN}, "
                        f"vocab {VOCAB}, batch {BATCH_PER_DP} x dp; HF Llama-3-8B: seq {HF_8B_SIZES['seq']}, "
                        f"vocab {HF_8B_SIZES['vocab']}, batch {HF_BATCH})")
    for name in ("model", "layers", "hidden", "mesh", "capture s", "strategies s", "solve s", "total s", "ILP vars",
                 "pred. step", "target"):
        table.add_column(name, justify="left" if name in ("model", "mesh", "target") else "right")
    previous: tuple[str, int] | None = None
    for row in rows:
        if previous is not None and (row.family, row.devices) != previous:
            table.add_section()
        previous = (row.family, row.devices)
        mesh = f"{row.devices} (" + " x ".join(f"{n}={s}" for n, s in row.mesh.items()) + ")"
        run = row.best
        if run is None:
            failed_after = fmt_s(row.error_after_s) if row.error_after_s is not None else "-"
            cells = ["-", "-", "-", failed_after, "-", "-"]
        else:
            cells = [fmt_s(run.capture_s), fmt_s(run.strategies_s), fmt_s(run.solve_s), fmt_s(run.total_s),
                     str(run.variables), fmt_step(run.step_time_s)]
        mark = ""
        if row.verdict:
            colour = "green" if row.verdict == "PASS" else "red"
            mark = f"[{colour}]{row.verdict}[/] <= {row.target_limit_s:g} s (median of {len(row.runs)})"
        if row.error:
            mark = f"[red]{short_error(row.error)}[/]"
        model = row.family + (" (pipeline searched)" if row.pipelined else "")
        table.add_row(model, str(row.layers), str(row.hidden), mesh, *cells, mark)
    console = Console(width=None if sys.stdout.isatty() else 180)  # full width when piped to a file
    console.print(table)
    console.print("Single runs on a noisy machine (target rows: median of their runs); "
                  "total = the whole plan() call (for a failed row: time until it raised).")
    for target in TARGETS:
        row = next((r for r in rows if Case(r.family, r.layers, r.hidden, r.devices, r.pipelined) == target.case),
                   None)
        if row is None:
            console.print(f"target {target.label()}: not run")
        else:
            total = row.best.total_s if row.best else float("nan")
            console.print(f"target {target.label()}: {row.verdict} ({total:.2f} s)")


def write_json(rows: list[Row], path: Path, quick: bool, elapsed_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "benchmark": "solve_time",
        "quick": quick,
        "hardware": HARDWARE,
        "seq_len": SEQ_LEN,
        "vocab": VOCAB,
        "batch_per_dp": BATCH_PER_DP,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
        "elapsed_s": elapsed_s,
        "rows": [],
    }
    for row in rows:
        entry = asdict(row)
        best = row.best
        entry["median"] = asdict(best) if best else None
        entry["total_s_runs"] = [r.total_s for r in row.runs]
        entry["total_s_median"] = statistics.median(entry["total_s_runs"]) if row.runs else None
        entry["verdict"] = row.verdict
        payload["rows"].append(entry)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only the target rows {', '.join(QUICK)}")
    parser.add_argument("--only", action="append", default=[], choices=[t.name for t in TARGETS],
                        help="only this target row (repeatable)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output file (default {DEFAULT_JSON})")
    parser.add_argument("--target-runs", type=int, default=3,
                        help="runs of each target row, reported as the median (default 3)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--jobs"]:  # the jobs planned with nothing pinned (issue 28's rows)
        from benchmarks import search_jobs
        return search_jobs.main(argv[1:])
    args = parse_args(argv)
    start = time.perf_counter()
    cases = grid(args.quick, args.only)
    warm_up({c.family for c in cases})
    rows: list[Row] = []
    for case in cases:
        row = run_row(case, max(1, args.target_runs))
        rows.append(row)
        best = row.best
        print(f"  {case.family} {case.layers:>2} layers, hidden {case.hidden}, {case.devices:>4} devices: "
              + (f"{best.total_s:.2f} s" if best else f"error {row.error}"), file=sys.stderr, flush=True)
    elapsed_s = time.perf_counter() - start
    render(rows)
    write_json(rows, args.json, args.quick or bool(args.only), elapsed_s)
    print(f"wrote {args.json} ({elapsed_s:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
