"""Gradient synchronization: the plan's buckets, all-reduced once their gradients are in.

Each mesh dim a gradient is reduced over has its own stream of buckets: a flat buffer
holding the gradients end to end in the plan's order, cut where the plan cut it (a
parameter may straddle two buckets). A hook on each synchronized parameter sees this
backward's contribution (before it is added to ``.grad``) and writes it into the buffer of
its first mesh dim; a bucket whose slices are all in, and whose parameters need no earlier
mesh dim, is launched at once as an async all-reduce, overlapping the rest of backward.
An end-of-backward callback reduces the remaining buckets in mesh-dim order (a gradient
reduced over dims 0 and 1 enters dim 1's buffer already summed over dim 0), then sets
``.grad`` to what it held before this backward plus the reduced sum (with nothing before, the
sum's own region of the buffer, as DDP's ``gradient_as_bucket_view``), so ``opt.step()`` right
after ``loss.backward()`` sees synchronized gradients, identical on every replica, and
gradients accumulated over several backward passes stay correct. The buffers are fp32
(or wider): a mixed-precision step's masters have fp32 gradients, and a bf16 model's
gradients are summed in fp32 too, then written back in bf16.

Inside ``no_sync()`` (the micro-batches of a step but the last, as DDP's ``no_sync``) a
backward reduces nothing: each contribution is added to the parameter's place in the
buffers, which keep their content from backward to backward; the first backward outside
``no_sync`` adds its own and reduces the accumulated sum once, in the same buckets, and
sets ``.grad`` to what it held before the first of these backwards plus that sum.

A synchronized parameter whose gradient never arrives in a backward that reached others
would leave its buckets incomplete: that is an error (after every launched all-reduce has
finished, so no rank hangs), never a silent skip. The plan leaves parameters that get no
gradient (frozen, unused, or reached only through ``detach``) out of the buckets.

The buckets run on the mesh's groups as the program's own collectives do, so on a CPU mesh
(gloo) they follow ``Comm``'s rule: a bucket is issued once what is in flight on the mesh
has finished (``Comm.settle``), and the program's next collective waits for it
(``Comm.left_running``); see ``runtime.ops``.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.buckets import GradBucket
from autopar.runtime.ops import CollectiveLog, Comm


class GradSync:
    def __init__(self, buckets: list[GradBucket], params: dict[str, nn.Parameter], mesh: DeviceMesh,
                 comm: Comm) -> None:
        self.buckets = buckets
        self.params = params
        self.mesh = mesh
        self.comm = comm  # the program's collectives on ``mesh``: the buckets take turns with them on gloo
        self.log: CollectiveLog | None = None
        self.deferred = False  # inside no_sync(): accumulate, reduce nothing
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
        members = [bucket.params for bucket in buckets]
        names = {name for params_in in members for name in params_in}
        self.first_dim = {name: min(d for d in self.dims if name in self.offset[d]) for name in names}
        self.size = {name: params[name].numel() for name in names}
        # Fixed per plan, so that a hook costs O(its buckets), not O(parameters): the buckets each
        # parameter is in, those its arrival may complete, and which buckets can be launched during
        # backward (every parameter's first mesh dim is the bucket's: none waits on an earlier dim)
        self.member_of: dict[str, list[int]] = defaultdict(list)
        self.early: dict[str, list[int]] = defaultdict(list)
        for i, (bucket, params_in) in enumerate(zip(buckets, members)):
            for name in params_in:
                self.member_of[name].append(i)
                if self.first_dim[name] == bucket.mesh_dim:
                    self.early[name].append(i)
        self.launchable = [all(self.first_dim[n] == b.mesh_dim for n in m) for b, m in zip(buckets, members)]
        self.distinct = [len(m) for m in members]
        # Reduced in fp32 at least (reduce_dtype=fp32): a bf16 model's gradients too, as the plan prices them
        self.dtype = functools.reduce(torch.promote_types, [params[n].dtype for n in sorted(names)], torch.float32)
        self._reset()
        for name in sorted(names):
            params[name].register_hook(self._make_hook(name))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards in here accumulate their local gradients in the buffers and reduce
        nothing; the next backward outside reduces the accumulated sum once."""
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False

    def _reset(self) -> None:
        """Forget the accumulated gradients: after a synchronizing backward (or an error)."""
        self._flat: dict[int, torch.Tensor] = {}
        self._accumulated: set[str] = set()  # in the buffers since the last synchronization
        self._before: dict[str, torch.Tensor | None] = {}  # .grad before that (accumulation by the user)
        self._reset_backward()

    def _reset_backward(self) -> None:
        self._received: set[str] = set()  # in this backward
        self._pending = list(self.distinct)  # per bucket: its parameters not yet received in this backward
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
        if not self._flat:  # every element is written before it is read: each parameter's region is copied in
            self._flat = {d: torch.empty(self.numel[d], dtype=self.dtype, device=grad.device) for d in self.dims}
        dim = self.first_dim[name]
        region = self._region(dim, name)
        if name in self._received:  # a second contribution in one backward: sum, unless already sent
            if any(i in self._work for i in self.member_of[name]):
                raise RuntimeError(f"a second gradient of {name} arrived after its bucket was reduced")
            region.add_(grad.reshape(-1))
            return
        self._received.add(name)
        for i in self.early[name]:
            self._pending[i] -= 1
        if name in self._accumulated:  # an earlier micro-batch's gradient is in the buffer
            region.add_(grad.reshape(-1))
        else:
            grad_so_far = self.params[name].grad
            self._before[name] = None if grad_so_far is None else grad_so_far.clone()
            region.copy_(grad.reshape(-1))
            self._accumulated.add(name)
        if self.deferred:
            return
        for i in self.early[name]:
            if self._pending[i] == 0 and self.launchable[i]:  # every slice is in, none waits on an earlier dim
                self._launch(i)

    def _region(self, dim: int, name: str) -> torch.Tensor:
        start = self.offset[dim][name]
        return self._flat[dim][start: start + self.size[name]]

    def _launch(self, i: int) -> None:
        start, stop = self.span[i]
        chunk = self._flat[self.buckets[i].mesh_dim][start:stop]
        self._record(self.buckets[i].mesh_dim, chunk)
        self.comm.settle()
        self._work[i] = dist.all_reduce(chunk, group=self.mesh.get_group(self.buckets[i].mesh_dim), async_op=True)
        self.comm.left_running(self._work[i])

    def _record(self, dim: int, chunk: torch.Tensor) -> None:
        if self.log is not None:
            self.log.entries.append(("backward", "all_reduce", dim, chunk.numel() * chunk.element_size()))

    def _finish(self) -> None:
        try:
            self.comm.settle()
            for work in self._work.values():
                work.wait()
            missing = sorted(self.first_dim.keys() - self._received)
            if missing:
                raise RuntimeError(
                    f"gradient synchronization: no gradient arrived in this backward for {', '.join(missing)}, "
                    "which the plan reduces with other gradients in a bucket; backward must run through the "
                    "whole step (the loss the compiled module returned)")
            if self.deferred:  # a micro-batch before the last: keep accumulating
                self._reset_backward()
                return
            self._reduce_rest()
            self._write_grads()
        except BaseException:
            self._reset()  # a failed backward accumulates nothing into the next
            raise
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
                    self.comm.settle()
                    dist.all_reduce(chunk, group=self.mesh.get_group(dim))

    def _reduced(self, name: str, before: int | None = None) -> torch.Tensor:
        """The parameter's gradient as reduced over its last dim (below ``before``, if given)."""
        dims = [d for d in self.dims if name in self.offset[d] and (before is None or d < before)]
        return self._region(dims[-1], name)

    def _write_grads(self) -> None:
        """``.grad`` becomes the reduced sum (plus what it held before this synchronization):
        with nothing before, the buffer's own region, as DDP's ``gradient_as_bucket_view`` (no
        copy back; the buffers are fresh each synchronization, so a later backward never writes
        into gradients handed out); the unreduced ``.grad`` autograd made is dropped."""
        for name in sorted(self._received):
            param = self.params[name]
            reduced = self._reduced(name).view(param.shape).to(param.dtype)
            before = self._before[name]
            # Exactly (earlier sum) + (reduced sum): the same bits on every replica.
            param.grad = reduced if before is None else before + reduced
