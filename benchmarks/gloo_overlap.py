"""gloo (torch 2.13) corrupts the heap when collectives of one process group overlap.

A standalone reproducer (torch's collectives only; ``--workers 1`` borrows autopar's setting):
on forked gloo ranks, each repeat issues an asynchronous all-reduce and, while it is in
flight, all-gathers (functional collectives, issued and waited for) on a group. A rank aborts
now and then with ``malloc(): unaligned tcache chunk detected`` (or a segfault): one repeat
in a few thousand.

    python benchmarks/gloo_overlap.py --mode same      # the overlap autopar must never issue
    python benchmarks/gloo_overlap.py --mode separate  # the all-reduce on a group of its own
    python benchmarks/gloo_overlap.py --mode serial    # the all-reduce waited for first

``--mode`` says where the all-gathers run: on the all-reduce's own group while it is in
flight (``same``), on another group of the same ranks (``separate``), or on the same group
after it was waited for (``serial``). Each try forks ``--world`` ranks that run
``--repeats`` repeats; the script reports how many tries a rank died in (its exit code)
and how many repeats ran in all. ``tests/test_gloo_overlap.py`` checks that autopar's
runtime never issues a collective on a gloo group while another one is in flight on it.

The cause (``autopar.runtime.gloo``): each of a group's two gloo worker threads records the
collective it finished in the group's status with no lock, and two of them finishing together
assign one string at once. Overlapping collectives make that likely; ``--workers 1`` runs each
group on one worker thread (``one_worker_per_group``, as autopar's forked ranks do), which
leaves no second writer.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's autopar, not an installed one

from autopar.runtime.gloo import one_worker_per_group  # noqa: E402


def _rank(rank: int, world: int, port: int, mode: str, repeats: int, numel: int, gathers: int, workers: int) -> None:
    torch.set_num_threads(1)
    if workers == 1:
        one_worker_per_group()
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(list(range(world)))
    other = dist.new_group(list(range(world))) if mode == "separate" else group
    big = torch.ones(numel)
    for i in range(repeats):
        work = dist.all_reduce(big, group=group, async_op=True)
        if mode == "serial":
            work.wait()
        for k in range(gathers):
            x = torch.full((64 * (k + 1),), float(rank))
            out = fc.wait_tensor(fc.all_gather_single(x, 0, other))
            assert out.shape[0] == world * x.shape[0]
        work.wait()
    dist.destroy_process_group()
    os._exit(0)  # noqa: SLF001 - skip the interpreter's teardown in a forked child


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _try(args: argparse.Namespace) -> list[int | None]:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.mode, args.repeats, args.numel, args.gathers,
                                                     args.workers))
             for r in range(args.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("same", "separate", "serial"), default="same")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--numel", type=int, default=1 << 20, help="all-reduce elements (fp32: 4 MB)")
    parser.add_argument("--gathers", type=int, default=4, help="all-gathers per repeat")
    parser.add_argument("--workers", type=int, choices=(1, 2), default=2,
                        help="gloo worker threads per group (2: torch's default; 1: autopar's forked ranks')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    failed = 0
    start = time.monotonic()
    for t in range(args.tries):
        codes = _try(args)
        if any(c != 0 for c in codes):
            failed += 1
            print(f"try {t}: exit codes {codes}", flush=True)
    print(f"mode={args.mode} workers={args.workers}: {failed} of {args.tries} tries failed, "
          f"{args.tries * args.repeats} repeats, {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
