"""Gradient synchronization: the plan's buckets all-reduced once their gradients are ready.

Each bucket launches as soon as backward has accumulated every gradient in it (post-
accumulate-grad hooks), overlapping the rest of backward; an end-of-backward callback
waits for all of them and writes the reduced values back, so ``opt.step()`` right after
``loss.backward()`` sees synchronized gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.buckets import GradBucket
from autopar.passes.ops import CollectiveLog


class GradSync:
    def __init__(self, buckets: list[GradBucket], params: dict[str, nn.Parameter], mesh: DeviceMesh) -> None:
        self.buckets = buckets
        self.params = params
        self.mesh = mesh
        self.log: CollectiveLog | None = None
        self._ready: list[set[str]] = [set() for _ in buckets]
        self._pending: list[tuple[int, torch.Tensor, Any]] = []
        self._callback_queued = False
        self._bucket_of = {name: i for i, b in enumerate(buckets) for name in b.params}
        for name in self._bucket_of:
            params[name].register_post_accumulate_grad_hook(self._make_hook(name))

    def _make_hook(self, name: str):  # noqa: ANN202
        def hook(param: torch.Tensor) -> None:
            i = self._bucket_of[name]
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
            self._ready[i].add(name)
            if len(self._ready[i]) == len(self.buckets[i].params):
                self._launch(i)
        return hook

    def _launch(self, i: int) -> None:
        bucket = self.buckets[i]
        flat = torch.cat([self.params[n].grad.reshape(-1) for n in bucket.params])  # type: ignore[union-attr]
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
                grad = self.params[name].grad
                assert grad is not None
                grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._pending.clear()
        self._ready = [set() for _ in self.buckets]
        self._callback_queued = False
