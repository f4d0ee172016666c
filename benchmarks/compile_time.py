"""Wall time of ``autopar.compile`` on 4 ranks for a memory-limited plan.

Model: the example Llama (``examples/llama.py``, fp32, batch 8). Mesh ``dp=2,tp=2`` of the
``cpu`` profile: 4 gloo ranks forked from this process. The memory limit is
``--limit-fraction`` of the unconstrained plan's predicted peak memory (computed once in
this process first), which makes the ILP much harder than the free plan: on a 2-core
machine its solve takes tens of seconds, and when every rank solves it the ranks share
the cores.

Per repetition (``--runs``, all in this one invocation) the table shows the slowest rank's
``autopar.compile`` wall time, rank 0's capture / strategy / solve stage times as its plan
records them, and the CPU seconds all 4 ranks spent in ``compile`` together (work done,
independent of how many cores there are); the last row is the median of each column. Every
run must produce the same plan (the hash column).

Usage: ``python benchmarks/compile_time.py [--runs 3] [--limit-fraction 0.7] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` importable when run as a script

import autopar  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402
from examples import llama  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "compile_time.json"
MESH = {"dp": 2, "tp": 2}
HARDWARE = "cpu"
COLUMNS = ("compile_s", "capture_s", "strategies_s", "solve_s", "cpu_s_all_ranks")


def _compile_rank(rank: int, world: int, memory_limit: float) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(MESH.values()), mesh_dim_names=tuple(MESH))
    model, inputs, loss_fn, targets = llama.build()
    cpu, wall = time.process_time(), time.perf_counter()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, hardware=HARDWARE,
                         memory_limit=memory_limit, pipeline=False)
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
            "timings": dict(pm.plan.timings), "hash": pm.plan.plan_hash(),
            "peak_bytes": pm.plan.predicted.peak_memory_bytes}


def measure(runs: int, fraction: float) -> dict[str, Any]:
    model, inputs, loss_fn, targets = llama.build()
    free = autopar.plan(model, autopar.Mesh(MESH, HARDWARE), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=False)
    limit = fraction * free.predicted.peak_memory_bytes
    rows = []
    for _ in range(runs):
        ranks = run_ranks(_compile_rank, 4, limit, timeout_s=900)
        timings = ranks[0]["timings"]
        rows.append({"compile_s": max(r["wall_s"] for r in ranks), "capture_s": timings.get("capture", 0.0),
                     "strategies_s": timings.get("strategies", 0.0), "solve_s": timings.get("solve", 0.0),
                     "cpu_s_all_ranks": sum(r["cpu_s"] for r in ranks), "hash": ranks[0]["hash"],
                     "hashes_agree": len({r["hash"] for r in ranks}) == 1, "peak_bytes": ranks[0]["peak_bytes"]})
    return {"free_peak_bytes": free.predicted.peak_memory_bytes, "memory_limit_bytes": limit, "rows": rows,
            "median": {c: statistics.median(r[c] for r in rows) for c in COLUMNS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit-fraction", type=float, default=0.7,
                        help="memory limit as a fraction of the free plan's peak (default 0.7)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    torch.set_num_threads(1)  # before any computation: forked ranks hang on an inherited OpenMP pool
    result = measure(args.runs, args.limit_fraction)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"autopar.compile, example Llama on {' x '.join(f'{k}={v}' for k, v in MESH.items())} "
                  f"({HARDWARE}), memory limit {result['memory_limit_bytes'] / 2**20:.2f} MiB "
                  f"({args.limit_fraction:g} x free plan's {result['free_peak_bytes'] / 2**20:.2f} MiB)")
    for name in ("run", "compile s (slowest rank)", "capture s", "strategies s", "solve s", "cpu s (4 ranks)", "plan"):
        table.add_column(name, justify="right")
    for i, row in enumerate(result["rows"]):
        table.add_row(str(i), *(f"{row[c]:.2f}" for c in COLUMNS),
                      row["hash"] + ("" if row["hashes_agree"] else " (ranks disagree!)"))
    table.add_row("median", *(f"{result['median'][c]:.2f}" for c in COLUMNS), "")
    console = Console(width=150)
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.platform(), "cpus": __import__("os").cpu_count(),
                                     "torch": torch.__version__, "runs": args.runs,
                                     "limit_fraction": args.limit_fraction, **result}, indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
