"""Gradient synchronization: the plan's buckets, all-reduced once their gradients are in.

Each mesh dim a gradient is reduced over has its own stream of buckets: a flat buffer
holding the gradients end to end in the plan's order, cut where the plan cut it (a
parameter may straddle two buckets). A hook on each synchronized parameter sees this
backward's contribution (before it is added to ``.grad``) and writes it into the buffer of
its first mesh dim; a bucket whose slices are all in, and whose parameters need no earlier
mesh dim, is launched at once as an async all-reduce, overlapping the rest of backward.
An end-of-backward callback reduces the remaining buckets in mesh-dim order (a gradient
reduced over dims 0 and 1 enters dim 1's buffer already summed over dim 0), then sets
``.grad`` to what it held before this backward plus the reduced sum, so ``opt.step()`` right
after ``loss.backward()`` sees synchronized gradients, identical on every replica, and
gradients accumulated over several backward passes stay correct. The buffers are fp32
(or wider): a mixed-precision step's masters have fp32 gradients, and a bf16 model's
gradients are summed in fp32 too, then written back in bf16.

A synchronized parameter whose gradient never arrives in a backward that reached others
would leave its buckets incomplete: that is an error (after every launched all-reduce has
finished, so no rank hangs), never a silent skip. The plan leaves parameters that get no
gradient (frozen, unused, or reached only through ``detach``) out of the buckets.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
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
        self.dims = sorted({b.mesh_dim for b in buckets})
        # Where each parameter's gradient sits in each dim's buffer, and each bucket's span.
        self.offset: dict[int, dict[str, int]] = defaultdict(dict)
        self.span: list[tuple[int, int]] = []
        self.numel: dict[int, int] = defaultdict(int)
        for bucket in buckets:
            start = self.numel[bucket.mesh_dim]
            for piece in bucket.slices:
                if piece.start == 0:
                    self.offset[bucket.mesh_dim][piece.param] = self.numel[bucket.mesh_dim]
                self.numel[bucket.mesh_dim] += piece.stop - piece.start
            self.span.append((start, self.numel[bucket.mesh_dim]))
        names = {name for b in buckets for name in b.params}
        self.first_dim = {name: min(d for d in self.dims if name in self.offset[d]) for name in names}
        self.early: dict[str, list[int]] = defaultdict(list)  # buckets a parameter's arrival may complete
        for i, bucket in enumerate(buckets):
            for name in bucket.params:
                if self.first_dim[name] == bucket.mesh_dim:
                    self.early[name].append(i)
        # Reduced in fp32 at least (reduce_dtype=fp32): a bf16 model's gradients too, as the plan prices them
        self.dtype = functools.reduce(torch.promote_types, [params[n].dtype for n in sorted(names)], torch.float32)
        self._reset()
        for name in sorted(names):
            params[name].register_hook(self._make_hook(name))

    def _reset(self) -> None:
        self._flat: dict[int, torch.Tensor] = {}
        self._received: set[str] = set()
        self._before: dict[str, torch.Tensor | None] = {}  # .grad before this backward (accumulation)
        self._work: dict[int, Any] = {}  # launched bucket -> async work
        self._callback_queued = False

    def _make_hook(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self._receive(name, grad)
            return grad
        return hook

    def _receive(self, name: str, grad: torch.Tensor) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
            self._flat = {d: torch.zeros(self.numel[d], dtype=self.dtype, device=grad.device) for d in self.dims}
        dim = self.first_dim[name]
        region = self._region(dim, name)
        if name in self._received:  # a second contribution in one backward: sum, unless already sent
            if any(name in self.buckets[i].params for i in self._work):
                raise RuntimeError(f"a second gradient of {name} arrived after its bucket was reduced")
            region.add_(grad.reshape(-1))
            return
        grad_so_far = self.params[name].grad
        self._before[name] = None if grad_so_far is None else grad_so_far.clone()
        region.copy_(grad.reshape(-1))
        self._received.add(name)
        for i in self.early[name]:
            if self._ready_early(i):
                self._launch(i)

    def _region(self, dim: int, name: str) -> torch.Tensor:
        start = self.offset[dim][name]
        return self._flat[dim][start: start + self.params[name].numel()]

    def _ready_early(self, i: int) -> bool:
        """Every slice is in and none needs reducing over an earlier mesh dim first."""
        bucket = self.buckets[i]
        return all(n in self._received and self.first_dim[n] == bucket.mesh_dim for n in bucket.params)

    def _launch(self, i: int) -> None:
        start, stop = self.span[i]
        chunk = self._flat[self.buckets[i].mesh_dim][start:stop]
        self._record(self.buckets[i].mesh_dim, chunk)
        self._work[i] = dist.all_reduce(chunk, group=self.mesh.get_group(self.buckets[i].mesh_dim), async_op=True)

    def _record(self, dim: int, chunk: torch.Tensor) -> None:
        if self.log is not None:
            self.log.entries.append(("backward", "all_reduce", dim, chunk.numel() * chunk.element_size()))

    def _finish(self) -> None:
        try:
            for work in self._work.values():
                work.wait()
            missing = sorted({n for b in self.buckets for n in b.params} - self._received)
            if missing:
                raise RuntimeError(
                    f"gradient synchronization: no gradient arrived in this backward for {', '.join(missing)}, "
                    "which the plan reduces with other gradients in a bucket; backward must run through the "
                    "whole step (the loss the compiled module returned)")
            self._reduce_rest()
            self._write_grads()
        finally:
            self._reset()

    def _reduce_rest(self) -> None:
        """Buckets not launched during backward, in mesh-dim order (earlier dims' sums feed later dims)."""
        for dim in self.dims:
            for name, start in self.offset[dim].items():
                if self.first_dim[name] != dim:  # carry the sum over earlier dims into this buffer
                    self._region(dim, name).copy_(self._reduced(name, before=dim))
            for i, bucket in enumerate(self.buckets):
                if bucket.mesh_dim == dim and i not in self._work:
                    start, stop = self.span[i]
                    chunk = self._flat[dim][start:stop]
                    self._record(dim, chunk)
                    dist.all_reduce(chunk, group=self.mesh.get_group(dim))

    def _reduced(self, name: str, before: int | None = None) -> torch.Tensor:
        """The parameter's gradient as reduced over its last dim (below ``before``, if given)."""
        dims = [d for d in self.dims if name in self.offset[d] and (before is None or d < before)]
        return self._region(dims[-1], name)

    def _write_grads(self) -> None:
        for name in sorted(self._received):
            param = self.params[name]
            reduced = self._reduced(name).view(param.shape).to(param.dtype)
            before = self._before[name]
            assert param.grad is not None
            # Exactly (earlier sum) + (reduced sum): the same bits on every replica.
            param.grad.copy_(reduced if before is None else before + reduced)
