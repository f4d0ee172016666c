"""Measure the cpu profile's offload figures: ``host_link_bandwidth`` (a copy between two
separate tensors, what the offloaded step's device <-> host copies are on a CPU mesh) and
``host_memory_bandwidth`` (torch's AdamW step over host tensors, counted at the 28 bytes per
element ``autopar.cost.offload`` prices it at).

``--world`` processes are forked and measure at once, one thread each, as the tests' ranks
run; each figure is bytes over the rank's CPU time x ranks / cores (the profile's convention,
see the cpu profile in ``autopar/hardware.py``), the median of ``--reps`` runs per rank.

Usage: ``python benchmarks/calibrate_offload.py [--world 4] [--mib 64] [--reps 5]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's autopar, not an installed one

from autopar.cost.offload import HOST_UPDATE_BYTES  # noqa: E402


def _cpu_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def _measure(numel: int, reps: int, queue: Any) -> None:
    torch.set_num_threads(1)
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    copy_s = _cpu_time(lambda: dst.copy_(src), reps)
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = torch.optim.AdamW([param], lr=1e-3)
    opt.step()  # creates the state
    step_s = _cpu_time(opt.step, reps)
    queue.put((numel * 4 / copy_s, numel * HOST_UPDATE_BYTES / step_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--mib", type=int, default=64, help="size of each fp32 tensor")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    numel = args.mib * 2**20 // 4
    procs = [ctx.Process(target=_measure, args=(numel, args.reps, queue)) for _ in range(args.world)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    share = min(args.world, os.cpu_count() or 1) / args.world  # CPU time x ranks / cores
    link = statistics.median(r[0] for r in results) * share
    host = statistics.median(r[1] for r in results) * share
    print(f"host_link_bandwidth   {link / 1e9:.2f} GB/s per direction (per rank)")
    print(f"host_memory_bandwidth {host / 1e9:.2f} GB/s at {HOST_UPDATE_BYTES} B/element (per rank)")


if __name__ == "__main__":
    main()
