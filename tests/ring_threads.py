"""Ring attention's ranks as threads of one process: a ring link whose sends are handed over
through a shared mailbox, so a test runs ``runtime.ring`` itself (forward and the backward's
travelling dK/dV) without process groups."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class ThreadRing:
    """The mailbox of one ring of ``size`` threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.boxes: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self.sent: dict[int, int] = {}
        self.lock = threading.Condition()
        self.log: list[tuple[int, str, int]] = []
        """(rank, phase, bytes) per transfer started."""

    def link(self, index: int) -> ThreadLink:
        return ThreadLink(self, index)


class ThreadLink:
    def __init__(self, ring: ThreadRing, index: int) -> None:
        self.ring, self.index, self.size = ring, index, ring.size
        self.count = 0

    def start(self, tensors: list[torch.Tensor], phase: str, tag: int) -> Callable[[], list[torch.Tensor]]:
        ring, seq = self.ring, self.count
        self.count += 1
        with ring.lock:
            ring.log.append((self.index, phase, sum(t.numel() * t.element_size() for t in tensors)))
            ring.boxes[((self.index + 1) % self.size, seq, tag)] = [t.detach().clone() for t in tensors]
            ring.lock.notify_all()

        def wait() -> list[torch.Tensor]:
            with ring.lock:
                ring.lock.wait_for(lambda: (self.index, seq, tag) in ring.boxes, timeout=30)
                return ring.boxes.pop((self.index, seq, tag))
        return wait


def run_threads(size: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(rank)`` on ``size`` threads; their results in rank order (a thread's error raised)."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
