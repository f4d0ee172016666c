"""Watch, on one rank, every collective issued from Python for one left running on its group.

gloo corrupts the heap when collectives of one process group overlap (``runtime.ops``,
``benchmarks/gloo_overlap.py``). ``watch()`` wraps, for the duration of its block, the
functional collectives (``torch.distributed._functional_collectives``) and ``dist.all_reduce``,
``dist.broadcast`` and ``dist.batch_isend_irecv``, and notes each issue that finds another
collective unwaited: a functional collective not yet waited for (torch's work registry,
any group), or an asynchronous ``dist`` work on the same group. Sends and receives beside
each other (a pipeline schedule's) are gloo's point-to-point path, not collectives: only a
collective beside one of them counts. The patched names are module attributes, which
``autopar.runtime`` and torch's pipelining look up at each call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch._C._distributed_c10d import _get_work_registry_size

FUNCTIONAL = {"all_gather_single": 2, "all_reduce": 2, "reduce_scatter_single": 3, "all_to_all_single": 3,
              "all_to_all_single_autograd": 3, "broadcast": 2}
"""The functional collectives watched, with their ``group`` argument's position."""
P2P = "p2p"


class _Tracked:
    """An asynchronous ``dist`` work, known unwaited until its ``wait`` returns."""

    def __init__(self, work: Any, group: str, kind: str) -> None:
        self.work, self.group, self.kind, self.waited = work, group, kind, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self.work.wait(*args, **kwargs)
        self.waited = True
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class Watch:
    def __init__(self) -> None:
        self.issued = 0
        self.overlaps: list[str] = []
        self._works: list[_Tracked] = []

    def check(self, kind: str, group: str) -> None:
        """Before ``kind`` is issued on ``group``: note what it would run beside."""
        self.issued += 1
        self._works = [w for w in self._works if not w.waited]
        beside = [f"{w.kind} on {w.group}" for w in self._works
                  if w.group == group and not (kind == P2P and w.kind == P2P)]
        if _get_work_registry_size():
            beside.append(f"{_get_work_registry_size()} functional collective(s)")
        if beside:
            self.overlaps.append(f"{kind} on {group} issued beside {', '.join(beside)}")

    def track(self, work: Any, group: str, kind: str) -> _Tracked:
        tracked = _Tracked(work, group, kind)
        self._works.append(tracked)
        return tracked


def _group_name(group: Any) -> str:
    return str(fc._resolve_group_name(group))


def _functional(watch: Watch, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def issue(*args: Any, **kwargs: Any) -> Any:
        group = kwargs["group"] if "group" in kwargs else args[FUNCTIONAL[name]]
        watch.check(name, _group_name(group))
        return original(*args, **kwargs)
    return issue


def _all_reduce(watch: Watch, original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    def issue(tensor: Any, *args: Any, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
        name = _group_name(group if group is not None else dist.group.WORLD)
        watch.check(kind, name)
        work = original(tensor, *args, group=group, async_op=async_op, **kwargs)
        return watch.track(work, name, kind) if async_op and work is not None else work
    return issue


def _batch_p2p(watch: Watch, original: Callable[..., Any]) -> Callable[..., Any]:
    def issue(ops: list[Any]) -> Any:
        group = _group_name(ops[0].group if ops[0].group is not None else dist.group.WORLD)
        watch.check(P2P, group)
        return [watch.track(w, group, P2P) for w in original(ops)]
    return issue


@contextlib.contextmanager
def watch() -> Iterator[Watch]:
    """Inside, every collective issued is checked (``Watch.overlaps``: what overlapped)."""
    seen = Watch()
    saved_fc = {name: getattr(fc, name) for name in FUNCTIONAL}
    saved_dist = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "batch_isend_irecv")}
    for name, original in saved_fc.items():
        setattr(fc, name, _functional(seen, name, original))
    dist.all_reduce = _all_reduce(seen, saved_dist["all_reduce"], "all_reduce")
    dist.broadcast = _all_reduce(seen, saved_dist["broadcast"], "broadcast")
    dist.batch_isend_irecv = _batch_p2p(seen, saved_dist["batch_isend_irecv"])
    try:
        yield seen
    finally:
        for name, original in saved_fc.items():
            setattr(fc, name, original)
        for name, original in saved_dist.items():
            setattr(dist, name, original)
