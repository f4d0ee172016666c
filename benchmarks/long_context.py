"""Where the planner chooses context parallelism: a sequence-length sweep of the Llama-3-8B shape.

Every plan is made by ``autopar.plan`` on a meta-device model (nothing runs): the example
Llama (``examples/llama.py``) at the Llama-3-8B shape (vocab 128256, hidden 4096, 32 layers,
32 heads / 8 kv heads, ffn 14336, rope_theta 500000), fp32 parameters (as ``memory_sweep``),
at sequence lengths 4k to 128k, on 8 and 64 H100s at the H100's default memory limit
(80 GiB less the allocator margin: ``HardwareProfile.memory_limit()``).

Token budget: 32k tokens (8 x 4096) per group of 8 GPUs, at least one sequence: the global
batch is ``max(1, 32768 // seq) * devices // 8`` sequences (8 GPUs: 8, 4, 2, 1, 1, 1; 64 GPUs:
64, 32, 16, 8, 8, 8), so the work per GPU is the same at every length up to 32k and a whole
sequence per group of 8 beyond.

Per (sequence, devices), three plans:
- ``no CP``: data axes only (``data_axes=("dp",)``; on 64 GPUs the ``tp`` axis is left to the
  planner): the best plan without a context axis. With fewer sequences than data ranks it
  cannot be made (the batch does not divide the axis): its error's first line is printed.
- ``CP``: a ``cp`` axis pinned by ``context_axes=("cp",)`` (8 GPUs ``{"cp": 8}``, 64 GPUs
  ``{"cp": 8, "tp": 8}``): inputs split on the sequence, attention on each rank's query rows
  with keys and values all-gathered, by ring attention (keys and values split too, passed
  around the ring), or on heads behind all-to-alls (Ulysses). At 32k on 8 GPUs the heads split
  stays the fastest (1026.6 ms; ring on zig-zag chunks 1064.6 ms, gathered K/V on zig-zag rows
  1104.1 ms: with full checkpointing each block's attention runs twice, and the ring's
  per-block launches and sends weigh on a 4k-token block); ring attention wins where heads do
  not split or at 128k with memory to spare (``tests/test_long_context.py``: 2 layers, 373.8
  against 377.4 ms). At 128k on 8 GPUs no ``CP`` plan fits, ring or not: the leanest one is
  fully checkpointed, so what ring attention saves (no gathered K/V) is not what binds. The sequence
  is planned cut both contiguous and zig-zag (2n chunks, rank i holding chunks i and 2n-1-i,
  which balances causal rows: ``problem.zigzag``) and the faster plan kept; ``zigzag`` in the
  JSON rows says which. On this shape zig-zag is never kept: a zig-zag axis cuts every split
  dim in 2n chunks, so the 8 kv heads no longer split on cp=8, and the heads split it loses is
  the faster one (128k, 2 layers: 377 ms a step against 392 ms for zig-zag rows; contiguous
  rows would add 178 ms of attention compute; ``tests/test_long_context.py``). The quick sweep's
  plans are those planned before zig-zag existed. Planning a ``CP`` row prepares and solves
  both layouts (about twice the planning seconds).
- ``free``: no pins at all on the same mesh as ``CP`` (8 GPUs) or ``no CP`` (64 GPUs): the
  planner may split the sequence by itself (or the batch, heads, parameters).

Each row: predicted step time and peak memory, the memory plan (``plan.memory.describe()``),
how the attention calls' queries are split (read from the plan's placements: per mesh axis,
``seq`` where the query is split on dim -2, its rows, with keys and values all-gathered;
``ring`` where the keys are split there too, ring attention (K/V blocks passed around the
ring, ``runtime.ring``); ``heads`` where it is split on dim 1, which on a context axis is
Ulysses, heads behind all-to-alls; ``batch`` on dim 0), and planning seconds.

Usage: ``python benchmarks/long_context.py [--quick] [--json out.json]`` (``--quick``: 4k, 32k
and 128k only). Planning seconds are noisy single runs; plans and predictions are deterministic.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` importable when run as a script

import autopar  # noqa: E402
from examples.llama import Llama, LlamaConfig, from_hf_config, lm_loss  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "long_context.json"
GiB = 2**30
SEQUENCES = (4096, 8192, 16384, 32768, 65536, 131072)
QUICK_SEQUENCES = (4096, 32768, 131072)
TOKENS_PER_GROUP = 8 * 4096
"""Tokens per step per group of 8 GPUs (memory_sweep's 8B step: batch 8 x 4096)."""
PLACEMENT = re.compile(r"S\((\d+)(?:/\d+)?\)|R|P")
SPLIT_KIND = {0: "batch", 1: "heads", 2: "seq"}
"""Dim of a (batch, heads, sequence, head_dim) query -> what splitting it means."""


def llama_8b(seq: int, layers: int = 32) -> LlamaConfig:
    """Llama-3-8B's published config (``examples/configs/llama-3-8b.json``) at sequence ``seq``."""
    return from_hf_config("llama-3-8b", max_seq_len=seq, layers=layers)


def global_batch(seq: int, devices: int) -> int:
    return max(1, TOKENS_PER_GROUP // seq) * (devices // 8)


@dataclass(frozen=True)
class Setup:
    """One way to plan a (sequence, devices) point: a mesh and the pins."""

    label: str
    mesh: dict[str, int]
    options: dict[str, Any] = field(default_factory=dict)


def setups(devices: int) -> list[Setup]:
    if devices == 8:
        return [Setup("no CP", {"dp": 8}, {"data_axes": ("dp",)}),
                Setup("CP", {"cp": 8}, {"context_axes": ("cp",)}),
                Setup("free", {"cp": 8})]
    return [Setup("no CP", {"dp": 8, "tp": 8}, {"data_axes": ("dp",)}),
            Setup("CP", {"cp": 8, "tp": 8}, {"context_axes": ("cp",)}),
            Setup("free", {"dp": 8, "tp": 8})]


@dataclass
class Result:
    seq: int
    devices: int
    label: str
    mesh: dict[str, int]
    batch: int
    memory_plan: str = ""
    attention: str = ""
    """Per mesh axis, how the attention queries are split (``seq``, ``heads``, ``batch``, ``-``)."""
    sequence_split: bool = False
    """Some attention call runs on its query rows split (context parallelism by gathered K/V, or ring)."""
    zigzag: list[str] = field(default_factory=list)
    """Mesh axes the plan cuts zig-zag (``plan.mesh['zigzag']``)."""
    step_ms: float | None = None
    peak_gib: float | None = None
    plan_s: float = 0.0
    error: str | None = None


def attention_splits(plan: autopar.Plan, axes: list[str]) -> str:
    """How the first attention call's query is split on each mesh axis; with calls that differ,
    every distinct split (``|``-separated)."""
    seen: list[str] = []
    for node in plan.nodes:
        if "scaled_dot_product" not in node.op:
            continue
        ndim = len(node.shapes[0])
        parts = []
        keys = list(PLACEMENT.finditer(node.inputs[1]))
        for axis, match, key in zip(axes, PLACEMENT.finditer(node.inputs[0]), keys):
            dim = match.group(1)
            kind = "-" if dim is None else SPLIT_KIND.get(int(dim) - ndim + 4, f"dim {dim}")
            if kind == "seq" and key.group(1) == dim:  # keys split on the sequence too: passed around the ring
                kind = "ring"
            parts.append(f"{axis}:{kind}")
        text = " ".join(parts)
        if text not in seen:
            seen.append(text)
    return " | ".join(seen)


def plan_row(seq: int, devices: int, setup: Setup, model: torch.nn.Module, tokens: torch.Tensor) -> Result:
    result = Result(seq, devices, setup.label, setup.mesh, tokens.shape[0])
    mesh = autopar.Mesh(setup.mesh, hardware="h100")
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, mesh, (tokens,), loss_fn=lm_loss, example_targets=(tokens,),
                            **{"pipeline": False, **setup.options})
        result.memory_plan = plan.memory.describe()
        result.step_ms = plan.predicted.step_time_s * 1e3
        result.peak_gib = plan.predicted.peak_memory_bytes / GiB
        result.attention = attention_splits(plan, list(setup.mesh))
        result.sequence_split = ":seq" in result.attention or ":ring" in result.attention
        result.zigzag = list(plan.mesh.get("zigzag", []))
    except (autopar.MemoryLimitError, autopar.InputError) as exc:  # does not fit, or cannot be made
        result.error = str(exc).splitlines()[0]
    result.plan_s = time.perf_counter() - start
    print(f"  {seq // 1024}k on {devices}: {setup.label} {result.plan_s:.1f} s", file=sys.stderr, flush=True)
    return result


def sweep(sequences: tuple[int, ...], layers: int = 32) -> list[Result]:
    rows = []
    for seq in sequences:
        for devices in (8, 64):
            with torch.device("meta"):
                model = Llama(llama_8b(seq, layers))
                tokens = torch.randint(0, 128256, (global_batch(seq, devices), seq))
            rows += [plan_row(seq, devices, setup, model, tokens) for setup in setups(devices)]
    return rows


def best(rows: list[Result], with_cp: bool) -> Result | None:
    """The fastest plan that fits among the rows with (``CP``, ``free``) or without CP."""
    fits = [r for r in rows if r.step_ms is not None and (r.label != "no CP") == with_cp]
    return min(fits, key=lambda r: r.step_ms or 0.0, default=None)


def print_table(rows: list[Result]) -> None:
    print(f"{'seq':>5} {'GPUs':>4} {'plan':<6} {'mesh':<10} {'batch':>5} {'step ms':>9} {'peak GiB':>8} "
          f"{'plan s':>6}  {'attention queries':<22} memory plan")
    for r in rows:
        mesh = "x".join(f"{k}{v}" for k, v in r.mesh.items())
        step = f"{r.step_ms:9.1f}" if r.step_ms is not None else f"{'-':>9}"
        peak = f"{r.peak_gib:8.2f}" if r.peak_gib is not None else f"{'-':>8}"
        print(f"{r.seq // 1024:>4}k {r.devices:>4} {r.label:<6} {mesh:<10} {r.batch:>5} {step} {peak} {r.plan_s:6.1f}  "
              f"{r.attention or '-':<22} {r.memory_plan or r.error}")


def summary(rows: list[Result]) -> list[dict[str, Any]]:
    """Per (sequence, devices): the best plan with CP available and the best without."""
    out = []
    for seq, devices in sorted({(r.seq, r.devices) for r in rows}):
        here = [r for r in rows if (r.seq, r.devices) == (seq, devices)]
        with_cp, without = best(here, True), best(here, False)
        chosen = min((r for r in (with_cp, without) if r is not None), key=lambda r: r.step_ms or 0.0, default=None)
        out.append({"seq": seq, "devices": devices, "best": None if chosen is None else chosen.label,
                    "best_sequence_split": None if chosen is None else chosen.sequence_split,
                    "with_cp_ms": None if with_cp is None else with_cp.step_ms,
                    "without_cp_ms": None if without is None else without.step_ms})
    return out


def print_summary(lines: list[dict[str, Any]]) -> None:
    print(f"\n{'seq':>5} {'GPUs':>4} {'best':<6} {'splits seq':>10} {'best with CP ms':>16} {'best without CP ms':>19}")
    for s in lines:
        fmt = lambda v: f"{v:.1f}" if v is not None else "does not fit"  # noqa: E731
        print(f"{s['seq'] // 1024:>4}k {s['devices']:>4} {s['best'] or '-':<6} {str(s['best_sequence_split']):>10} "
              f"{fmt(s['with_cp_ms']):>16} {fmt(s['without_cp_ms']):>19}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    rows = sweep(QUICK_SEQUENCES if args.quick else SEQUENCES)
    print_table(rows)
    lines = summary(rows)
    print_summary(lines)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "summary": lines}, indent=1))
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
