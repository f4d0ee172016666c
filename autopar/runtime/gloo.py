"""gloo process groups that run one worker thread each (torch 2.13 corrupts the heap with two).

A ``ProcessGroupGloo`` runs its collectives on ``options.threads`` worker threads, two by
default. Each worker, once a collective has completed (its waiter already released), records it
in the group's status with no lock held (``ProcessGroupGloo::runLoop``:
``pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_)``). Two workers finishing
together assign that one ``std::string`` at once. An all-gather's name ("ALLGATHER_COALESCED")
is longer than the string's inline buffer, so an assignment frees or writes a heap block the
other one also frees or writes: "malloc(): unaligned tcache chunk detected" (the tcache link of
a freed block overwritten with an op name), a segfault, or a corruption found much later
(issue 26.4). Python needs to issue nothing concurrently for it: the waiter of collective k
issues k+1 at once, the idle worker runs it, and a worker still recording k (descheduled on a
busy machine) races with it. Collectives left running beside each other only make it likely
(``benchmarks/gloo_overlap.py``). helgrind reports the race on a plain sequence of collectives
with two workers, and none with one.

``one_worker_per_group()`` makes every gloo group this process creates afterwards (the world
group, ``new_group``, a ``DeviceMesh``'s groups) run one worker: no two ``runLoop`` threads then
share a status. Collectives of one group then run one after another in gloo, which is how
autopar issues them on CPU meshes anyway (``runtime.ops``); each group keeps its own worker, so
groups still run beside each other. The forked ranks (``runtime.forked``) call it; a user's
process can call it before ``init_process_group``.
"""

from __future__ import annotations

import datetime
import functools
import os
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.distributed.device_mesh import DeviceMesh

WORKERS = 1
"""Worker threads per gloo group once ``one_worker_per_group`` ran."""


def one_worker_per_group() -> None:
    """From now on, every gloo group this process creates runs ``WORKERS`` worker thread(s).

    torch builds each group's backend as ``ProcessGroupGloo(store, rank, size, timeout=...)``
    with its default options (two threads); the constructor taking options is the only way to
    set the count, so the timeout form is rerouted to it with torch's own defaults otherwise.
    Idempotent; affects this process only (a forked rank patches its own copy)."""
    if getattr(ProcessGroupGloo.__init__, "_autopar_one_worker", False):
        return
    ProcessGroupGloo.__init__ = _with_workers(ProcessGroupGloo.__init__)


def _with_workers(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: ProcessGroupGloo, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> None:
        timeout = kwargs.pop("timeout", args[0] if args else datetime.timedelta(minutes=30))
        if not isinstance(timeout, datetime.timedelta) or kwargs or len(args) > 1:
            original(self, store, rank, size, *args, **kwargs)  # options given: the caller chose
            return
        original(self, store, rank, size, _options(timeout))
    init._autopar_one_worker = True  # type: ignore[attr-defined]
    return init


def _options(timeout: datetime.timedelta) -> Any:
    """torch's default gloo options (``Options::create_default``: a device per interface in
    GLOO_SOCKET_IFNAME, else the host's) with ``WORKERS`` threads."""
    options = ProcessGroupGloo._Options()
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    options._devices = ([ProcessGroupGloo.create_device(interface=i) for i in interfaces] if interfaces
                        else [ProcessGroupGloo.create_default_device()])
    options._threads = WORKERS
    options._timeout = timeout
    return options


def workers(backend: ProcessGroupGloo) -> int:
    """How many worker threads a gloo backend runs."""
    return int(backend.options._threads)


def racing_dims(mesh: DeviceMesh) -> list[str]:
    """The dims of a CPU ``mesh`` whose gloo group runs more than one worker thread (this process did not
    call ``one_worker_per_group`` before making them): their collectives may corrupt the heap."""
    if mesh.device_type != "cpu":
        return []
    names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
    backends = [mesh.get_group(d)._get_backend(torch.device("cpu")) for d in range(mesh.ndim)]
    return [n for n, b in zip(names, backends) if isinstance(b, ProcessGroupGloo) and workers(b) > 1]
