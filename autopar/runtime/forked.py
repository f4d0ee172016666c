"""Run a function on N gloo ranks forked from this (already torch-importing) process.

For tests, benchmarks and quick local runs: forking costs well under a second for 8 ranks
where spawning or torchrun costs 10-20 s (each child re-imports torch). An OpenMP thread
pool the parent started (any op it ran on more than one intra-op thread) does not survive the
fork: a child using it hangs in its first parallel op, as if waiting on a peer. So each rank
computes on one intra-op thread (the ranks share the cores anyway); call
``torch.set_num_threads(1)`` in the parent before any computation too, for its own children
(``multiprocessing`` elsewhere). Each rank's gloo groups run one worker thread each
(``runtime.gloo``: with two, torch 2.13 corrupts the heap now and then).
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import math
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from autopar.runtime.gloo import one_worker_per_group

TIMEOUT_S = 60
"""Default process-group timeout: a deadlock fails fast instead of hanging."""

GRACE_S = 30
"""After a rank failed, how long past ``timeout_s`` the others have to report before the
parent dumps their stacks and kills them."""

JOIN_S = 60
"""How long the ranks wait for each other to form the world group (rank 0's store, gloo's
connections, a first barrier), whatever the collectives' ``timeout_s``: a rank forked on a busy
machine can start a second or more after its peers."""

LIMIT_S = 1200
"""How long a run may take in all: ranks that have not reported by then have their stacks
dumped and fail, so a rank stuck outside any collective (which no process-group timeout
reaches) fails its test instead of hanging the suite. Far above any test's run, so a
healthy rank is never cut short."""


class RankFailure(AssertionError):
    """A forked rank raised; the message holds its traceback."""


@dataclass(frozen=True)
class _Report:
    rank: int
    result: Any
    error: str | None
    raised_at: float
    """``time.time()`` when the rank caught its error (before it closed its connections)."""


PROCESS_GROUP_THREADS = ("pt_tcpstore", "gloo", "pt_gloo", "pt_nccl")
"""Name prefixes of the threads a process group (its store, gloo's loops) runs in its process."""


def _check_no_process_group_threads() -> None:
    """A fork copies the parent's locks, not its threads: a process group's thread holding one at the
    fork leaves it held in the child, whose own ``init_process_group`` can then wait for it for ever.
    Such threads outlive ``destroy_process_group`` until the group is collected."""
    if not _process_group_threads():
        return
    gc.collect()
    if threads := _process_group_threads():
        raise RuntimeError(f"run_ranks forks this process, which still runs process-group threads {threads}: "
                           "a rank forked from it can hang; destroy the group and drop what references it, "
                           "or run that work in a process of its own")


def _process_group_threads() -> list[str]:
    tasks = Path("/proc/self/task")
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir()] if tasks.is_dir() else []
    return sorted(n for n in names if n.startswith(PROCESS_GROUP_THREADS))


def _store(rank: int, world: int, port: Any, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's store: rank 0 serves it on a port the OS picks as it binds, and says which in ``port``
    (a shared int) for the others to join. A port picked free beforehand can be taken (another process, a
    gloo connection) before the store binds it: the group then failed with EADDRINUSE."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        port.value = store.port
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while port.value == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 served no store within {timeout.total_seconds():.0f} s")
        time.sleep(0.002)
    return dist.TCPStore("127.0.0.1", port.value, world, is_master=False, timeout=timeout)


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: Any, queue: Any, args: tuple,
               timeout_s: float) -> None:
    faulthandler.enable()  # a rank killed by a signal (a crash in C++) prints where it was
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks a rank that never reports
    torch.set_num_threads(1)  # never the parent's OpenMP pool, which hangs after the fork (module docstring)
    one_worker_per_group()  # two gloo workers per group race on its status (runtime.gloo)
    queue.put(_run(fn, rank, world, port, args, timeout_s))


def _run(fn: Callable[..., Any], rank: int, world: int, port: Any, args: tuple, timeout_s: float) -> _Report:
    """``fn`` on this rank, its error stamped when it is caught: before ``destroy_process_group``
    closes the connections its peers then fail on ("Connection closed by peer")."""
    join = datetime.timedelta(seconds=max(timeout_s, JOIN_S))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, store=_store(rank, world, port, join),
                                timeout=join)
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        return _Report(rank, None, traceback.format_exc(), time.time())
    try:
        # A rank's group is up once its own side of each connection is: without the barrier a rank whose fn
        # runs no collective could return and close its connections while a peer still completes its side.
        dist.barrier()
        c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), dist.group.WORLD)
        return _Report(rank, fn(rank, world, *args), None, 0.0)
    except BaseException:  # noqa: BLE001
        return _Report(rank, None, traceback.format_exc(), time.time())
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = TIMEOUT_S,
              grace_s: float = GRACE_S, limit_s: float = LIMIT_S) -> list[Any]:
    """``fn(rank, world, *args)`` on each rank; returns the results in rank order.

    ``timeout_s`` is every collective's timeout (the world group's, which the groups of a
    compiled module's mesh take too: ``runtime.groups``). Ranks work as long as they need;
    once one has failed, its peers fail within about ``timeout_s`` (their collectives with
    it time out), and any rank still silent ``grace_s`` after that has its stacks dumped
    and is killed; so is any rank still silent ``limit_s`` after the start. Results must
    pickle without tensors (send floats or lists). Raises with
    the traceback of the rank that raised first (its peers' errors are its echoes).
    """
    _check_no_process_group_threads()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = ctx.Value("i", 0)  # the store's, once rank 0 serves it (``_store``)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, queue, args, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, _Report] = {}
    try:
        _collect(queue, procs, reports, timeout_s + grace_s, time.monotonic() + limit_s)
    finally:
        _end(procs, reports)
    errors = sorted((r for r in reports.values() if r.error), key=lambda r: (r.raised_at, r.rank))
    if errors:
        first = errors[0]
        others = f" (then ranks {[r.rank for r in errors[1:]]})" if errors[1:] else ""
        raise RankFailure(f"rank {first.rank} failed first{others}:\n{first.error}")
    return [reports[r].result for r in range(world)]


def _end(procs: list[Any], reports: dict[int, _Report]) -> None:
    """Give the ranks that reported 10 s in all to exit (closing their groups), then dump the stacks of
    every rank still alive and kill it. A rank that never reported is not waited for: the run has failed
    (a rank died, or ranks stayed silent past a failure or the limit) or was interrupted (a test's
    timeout), and nothing it could still send is read."""
    deadline = time.monotonic() + 10
    for rank, p in enumerate(procs):
        if rank in reports:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    _dump_stacks(alive)  # reported and stuck, silent, or interrupted: say where, then kill
    for p in alive:
        p.kill()


def _collect(queue: Any, procs: list[Any], reports: dict[int, _Report], patience_s: float,
             limit: float) -> None:
    """Read every rank's report; a rank that exited without one (killed by a signal: its
    traceback is on stderr) fails at once, and ranks silent ``patience_s`` after the first
    error, or at ``limit`` (a ``time.monotonic()``), fail (``_end`` then dumps their stacks)."""
    deadline = math.inf
    while len(reports) < len(procs):
        try:
            report = queue.get(timeout=1.0)
        except Empty:
            dead = [r for r, p in enumerate(procs) if r not in reports and p.exitcode is not None]
            if dead and not _drained(queue, reports):
                raise RankFailure(f"rank {dead[0]} died without a report (exit code {procs[dead[0]].exitcode})"
                                  + _first_error(reports))
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(reports))
                raise RankFailure(f"ranks {missing} did not report {patience_s:.0f} s after a failure (stacks on "
                                  f"stderr)" + _first_error(reports)) from None
            if time.monotonic() > limit:
                missing = sorted(set(range(len(procs))) - set(reports))
                raise RankFailure(f"ranks {missing} did not report within the run's limit (stacks on stderr)")
            continue
        reports[report.rank] = report
        if report.error and deadline == math.inf:
            deadline = time.monotonic() + patience_s


def _first_error(reports: dict[int, _Report]) -> str:
    errors = sorted((r for r in reports.values() if r.error), key=lambda r: (r.raised_at, r.rank))
    return f"; rank {errors[0].rank} failed first:\n{errors[0].error}" if errors else ""


def _dump_stacks(procs: list[Any]) -> None:
    """Ask live ranks to print every thread's stack (``faulthandler`` on SIGUSR1), and give them a moment."""
    if not procs:
        return
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)


def _drained(queue: Any, reports: dict[int, _Report]) -> bool:
    """Read a report still in the pipe (a rank may die after sending it); whether there was one."""
    try:
        report = queue.get(timeout=1.0)
    except Empty:
        return False
    reports[report.rank] = report
    return True
