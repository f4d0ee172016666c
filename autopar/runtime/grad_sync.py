"""Gradient synchronization: the plan's buckets all-reduced once their gradients are ready.

A gradient hook on each synchronized parameter sees this backward's contribution (before
it is added to ``.grad``); when a bucket's contributions are all in, their sum is launched
as one async all-reduce, overlapping the rest of backward. An end-of-backward callback
waits and sets ``.grad`` to what it held before this backward plus the reduced sum, so
``opt.step()`` right after ``loss.backward()`` sees synchronized gradients, identical on
every replica, and gradients accumulated over several backward passes stay correct.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.buckets import GradBucket
from autopar.runtime.ops import CollectiveLog


class GradSync:
    def __init__(self, buckets: list[GradBucket], params: dict[str, nn.Parameter], mesh: DeviceMesh) -> None:
        self.buckets = buckets
        self.params = params
        self.mesh = mesh
        self.log: CollectiveLog | None = None
        self._contributions: list[dict[str, torch.Tensor]] = [{} for _ in buckets]
        self._before: dict[str, torch.Tensor | None] = {}  # .grad before this backward (accumulation)
        self._pending: list[tuple[int, torch.Tensor, Any]] = []
        self._callback_queued = False
        self._bucket_of = {name: i for i, b in enumerate(buckets) for name in b.params}
        for name in self._bucket_of:
            params[name].register_hook(self._make_hook(name))

    def _make_hook(self, name: str):  # noqa: ANN202
        def hook(grad: torch.Tensor) -> torch.Tensor:
            i = self._bucket_of[name]
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
            if name not in self._before:
                grad_so_far = self.params[name].grad
                self._before[name] = None if grad_so_far is None else grad_so_far.clone()
            contributions = self._contributions[i]
            contributions[name] = contributions[name] + grad if name in contributions else grad
            if len(contributions) == len(self.buckets[i].params):
                self._launch(i)
            return grad
        return hook

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        flat = torch.cat([self._contributions[i][n].reshape(-1) for n in bucket.params])
        first = bucket.mesh_dims[0]
        self._record(first, flat)
        work = dist.all_reduce(flat, group=self.mesh.get_group(first), async_op=True)
        self._pending.append((i, flat, work))

    def _record(self, dim: int, flat: torch.Tensor) -> None:
        if self.log is not None:
            self.log.entries.append(("backward", "all_reduce", dim, flat.numel() * flat.element_size()))

    def _finish(self) -> None:
        for i, flat, work in self._pending:
            work.wait()
            bucket = self.buckets[i]
            for dim in bucket.mesh_dims[1:]:
                self._record(dim, flat)
                dist.all_reduce(flat, group=self.mesh.get_group(dim))
            offset = 0
            for name in bucket.params:
                param = self.params[name]
                own = self._contributions[i][name]
                reduced = flat[offset: offset + own.numel()].view_as(own)
                before = self._before[name]
                assert param.grad is not None
                # Exactly (earlier sum) + (reduced sum): the same bits on every replica.
                param.grad.copy_(reduced if before is None else before + reduced)
                offset += own.numel()
        self._pending.clear()
        self._before.clear()
        self._contributions = [{} for _ in self.buckets]
        self._callback_queued = False
