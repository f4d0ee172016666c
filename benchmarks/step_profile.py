"""Where a training step's CPU time goes, by torch's profiler: for ``benchmarks/runtime_vs_torch.py
--profile``. Every rank runs the profiled steps (collectives need them all); one rank reports.

Per side and per step: the collectives (calls and bytes by kind, from the profiler's c10d and
functional-collective events, fp32 assumed for the bytes), the matmuls run (a checkpointed
block's recomputed ones show up as extra), the number of aten ops and the CPU time per op
(host overhead), and the ops with the most self CPU time.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

COLLECTIVE_KINDS = {"all_gather": ("allgather", "all_gather"), "reduce_scatter": ("reduce_scatter",),
                    "all_reduce": ("allreduce", "all_reduce"), "all_to_all": ("alltoall", "all_to_all"),
                    "broadcast": ("broadcast",), "send/recv": ("send", "recv")}
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def _kind(name: str) -> str | None:
    """The collective an event issues (None: not a collective's issuing call): the process group's own
    ``c10d::`` call, which functional collectives (``_c10d_functional::``) and ``dist.*`` both reach."""
    if not name.startswith("c10d::") or "wait" in name or "barrier" in name:
        return None
    low = name.lower()
    return next((kind for kind, keys in COLLECTIVE_KINDS.items() if any(k in low for k in keys)), None)


def _nested(event: Any) -> bool:
    """The event runs inside another collective's issuing call: a ``TorchDispatchMode`` (selective
    checkpointing's) dispatches the op again below itself, and the profiler records both calls."""
    parent = event.cpu_parent
    while parent is not None:
        if _kind(parent.name) is not None:
            return True
        parent = parent.cpu_parent
    return False


def _redispatched(event: Any) -> bool:
    """The same op again, directly below itself (a dispatch mode running it): one call, not two."""
    return event.cpu_parent is not None and event.cpu_parent.name == event.name


def _bytes(shapes: list[Any]) -> int | None:
    """The first input's bytes (fp32); for a list input, all its tensors. None: the profiler
    recorded no shape (a coalesced call's tensor lists are recorded empty)."""
    first = shapes[0] if shapes else []
    if first and isinstance(first[0], list):
        return sum(4 * math.prod(s) for s in first)
    return 4 * math.prod(first) if first else None


def breakdown(events: Any, steps: int, cpu_s: float) -> str:
    calls: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    unsized: Counter[str] = Counter()
    ops = matmuls = 0
    for e in events:
        kind = _kind(e.name)
        if kind is not None and not _nested(e):
            calls[kind] += 1
            size = _bytes(e.input_shapes)
            nbytes[kind] += size or 0
            unsized[kind] += size is None
        if e.name.startswith("aten::") and not _redispatched(e):
            ops += 1
            matmuls += e.name in MATMULS
    counts = Counter(e.name for e in events if e.name.startswith("aten::") and not _redispatched(e))
    lines = [f"  CPU {1e3 * cpu_s / steps:.1f} ms per step; collectives per step: " + ", ".join(
        f"{kind} {calls[kind] / steps:g} calls / {nbytes[kind] / steps / 2**20:.2f} MiB"
        + (f" ({unsized[kind] / steps:g} coalesced, unsized)" if unsized[kind] else "") for kind in sorted(calls)),
        f"  aten ops per step {ops / steps:.0f} (matmuls {matmuls / steps:.0f}); CPU per op "
        f"{1e6 * cpu_s / max(ops, 1):.1f} us",
        "  most run: " + ", ".join(f"{name.removeprefix('aten::')} {n / steps:.0f}" for name, n in counts.most_common(14))]
    return "\n".join(lines)


def profile_sides(sides: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]], tokens: torch.Tensor,
                  targets: torch.Tensor, steps: int, report: bool) -> str:
    """Each side's ``steps`` steps under the profiler; the report (on the reporting rank, else "")."""
    out = []
    for name, step in sides.items():
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            c0 = time.process_time()
            for _ in range(steps):
                step(tokens, targets)
            cpu_s = time.process_time() - c0
        if report:
            events = prof.events()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
            out.append(f"== {name} (profiled: its CPU time is inflated)\n{breakdown(events, steps, cpu_s)}\n{table}")
    return "\n".join(out)
