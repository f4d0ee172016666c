"""Run a function on N gloo ranks forked from this (already torch-importing) process.

For tests, benchmarks and quick local runs: forking costs well under a second for 8 ranks
where spawning or torchrun costs 10-20 s (each child re-imports torch). An OpenMP thread
pool the parent started (any op it ran on more than one intra-op thread) does not survive the
fork: a child using it hangs in its first parallel op, as if waiting on a peer. So each rank
computes on one intra-op thread (the ranks share the cores anyway); call
``torch.set_num_threads(1)`` in the parent before any computation too, for its own children
(``multiprocessing`` elsewhere).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import socket
import time
import traceback
from collections.abc import Callable
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_S = 60
"""Default process-group timeout: a deadlock fails fast instead of hanging."""


class RankFailure(AssertionError):
    """A forked rank raised; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any, args: tuple,
               timeout_s: float) -> None:
    import faulthandler

    faulthandler.enable()  # a rank killed by a signal (a crash in C++) prints where it was
    faulthandler.dump_traceback_later(timeout_s + 30, exit=True)  # last resort if gloo never times out
    torch.set_num_threads(1)  # never the parent's OpenMP pool, which hangs after the fork (module docstring)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            queue.put((rank, fn(rank, world, *args), None))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = TIMEOUT_S) -> list[Any]:
    """``fn(rank, world, *args)`` on each rank; returns the results in rank order.

    Results must pickle without tensors (send floats or lists). Raises with the first
    failing rank's traceback.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, queue, args, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        _collect(queue, procs, results, errors, time.monotonic() + timeout_s + 60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise RankFailure(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world)]


def _collect(queue: Any, procs: list[Any], results: dict[int, Any], errors: dict[int, str], deadline: float) -> None:
    """Read every rank's report into ``results``/``errors``; a rank that died without one
    (killed by a signal: its traceback is on stderr) fails at once, not at the deadline."""
    while len(results) < len(procs):
        try:
            rank, result, error = queue.get(timeout=1.0)
        except Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
            if dead and not _drained(queue, results, errors):
                raise RankFailure(f"rank {dead[0]} died without a report (exit code {procs[dead[0]].exitcode})")
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(results))
                raise RankFailure(f"ranks {missing} did not report in time") from None
            continue
        if error:
            errors[rank] = error
        results[rank] = result


def _drained(queue: Any, results: dict[int, Any], errors: dict[int, str]) -> bool:
    """Read a report still in the pipe (a rank may die after sending it); whether there was one."""
    try:
        rank, result, error = queue.get(timeout=1.0)
    except Empty:
        return False
    if error:
        errors[rank] = error
    results[rank] = result
    return True
