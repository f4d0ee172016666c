"""The ops the passes (``autopar.passes``) insert into per-rank graphs, as modules so the
code reads plainly: ``reshard = self.reshard(x, 'S(0)P', 'S(0)R', 'S(0)R', 'S(0)R')`` runs the forward
redistribution src -> dst and, in backward, turns the gradient grad_src -> grad_dst.

Collectives are torch's functional collectives on the DeviceMesh's groups. Every
collective run is appended to ``CollectiveLog`` when one is attached, so tests can
compare what ran with what the plan listed. A forward collective that runs again while a
checkpointed block recomputes its activations in backward is logged as phase "recompute".

A parameter gather can run in two halves (``Comm.launch`` then ``Comm.finish``): the
all-gather is issued early, without waiting, so it runs while compute goes on (FSDP's
prefetch, ``autopar.passes.prefetch_gathers``), and is waited for at its first use. It is
logged when issued, so the log's order is the order collectives were launched in. A
parameter's gradient reduce-scatter is issued and not waited for (``Comm.run_unwaited``):
autograd goes on with the next ops' backward while it runs, and it is waited for when the
next one is issued, or when an op reads the gradient, at the latest at the end of backward.

On gloo (a CPU mesh) at most one collective runs at a time on this rank: before any
collective is issued, the one left running (a gather launched ahead, a gradient's
reduce-scatter, a gradient bucket's all-reduce: ``Comm.left_running``) is waited for
(``Comm.settle``). gloo (torch 2.13) corrupts the heap when two collectives of a process
group overlap ("malloc(): unaligned tcache chunk detected" or a segfault, in a wait; one
repeat in a few thousand of ``benchmarks/gloo_overlap.py``): an all-gather beside another
all-gather, beside an all-reduce or beside a reduce-scatter alike. Issue order, and so
what every rank runs and what the plan lists, is unchanged; only the overlap is less on CPU.
The cause is a race between a group's two gloo worker threads (``runtime.gloo``), which
collectives issued one at a time still hit, rarely: ranks that run their gloo groups on one
worker each (``runtime.gloo.one_worker_per_group``, as the forked ranks do) are clear of it;
this order only makes it rarer where a user's groups run torch's two.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import _disable_current_modes

from autopar.rules.redistribute import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVES, REDUCE_SCATTER, SLICE, ZERO,
                                        Step, redistribute_steps, strided_join, strided_take, zigzag_join,
                                        zigzag_order, zigzag_take)
from autopar.rules.strategy import parse_placements


DATA_DEPENDENT = -1
"""The bytes logged for a collective whose size depends on the data (an expert-parallel layer's
row all-to-alls, ``runtime.moe``); the plan lists those at their expected size
(``PlannedCollective.data_dependent``)."""


@dataclass
class CollectiveLog:
    """What ran: (phase, kind, mesh dim, bytes of M) per collective."""

    entries: list[tuple[str, str, int, int]] = field(default_factory=list)
    regathers: list[tuple[str, tuple[str, str, int, int]]] = field(default_factory=list)
    """(parameter FQN, entry) for each collective of a ZeRO-3 regather in backward (also in
    ``entries``): the plan does not list them yet."""
    transfers: list[tuple[str, int, int]] = field(default_factory=list)
    """(kind, stage, bytes) per transfer a forward-only pipelined step runs on the pipeline axis,
    logged by the rank sending it: "send" of a stage's activations to the next stage's rank,
    "broadcast" of the step's outputs from the last stage's rank (``PipelinePlan.forward_transfers``)."""


@dataclass
class Pending:
    """A redistribution whose first collective (an all-gather) was issued and not yet waited for."""

    tensor: torch.Tensor
    """The all-gather's output (waited for in ``Comm.finish``), or the finished result when
    nothing was left to wait for (one rank on the axis, no collective)."""
    step: Step | None
    """The issued all-gather step (None: ``tensor`` is already the result)."""
    rest: tuple[Step, ...]
    """Steps that run after it, at finish."""
    group: GatheredGroup | None = None
    """The group whose one all-gather gathers it (``runtime.grouped``; None: its own), and its
    place there: ``group.take(index)`` is its gathered tensor."""
    index: int = 0


class GatheredGroup(Protocol):
    """Gathers run as one collective (``runtime.grouped._Gathered``)."""

    def take(self, index: int) -> torch.Tensor: ...


def waited(t: torch.Tensor) -> torch.Tensor:
    """A collective's output once it finished: an AsyncCollectiveTensor waits once and unwraps; a
    functional collective's plain output is waited for (a second wait finds nothing to wait for)."""
    return t.trigger_wait() if isinstance(t, fc.AsyncCollectiveTensor) else fc.wait_tensor(t)


class GradientGroup(Protocol):
    """Gradients reduced together (``runtime.grouped.GradGroup``)."""

    def add(self, index: int, param: torch.Tensor, grad: torch.Tensor, steps: tuple[Step, ...]) -> None: ...


@functools.lru_cache(maxsize=4096)
def _steps(src: str, dst: str) -> tuple[Step, ...]:
    return tuple(redistribute_steps(parse_placements(src), parse_placements(dst)))


class Comm:
    """Runs redistribution steps for this rank on a DeviceMesh. On the mesh dims in ``zigzag``
    a shard is zig-zag (``Mesh.zigzag``): slices take, gathers join, and reduce-scatters and
    all-to-alls send, rank j's two chunks (``rules.redistribute.zigzag_take``)."""

    def __init__(self, mesh: DeviceMesh, zigzag: frozenset[int] = frozenset()) -> None:
        self.mesh = mesh
        self.zigzag = frozenset(zigzag)
        self.coordinate = mesh.get_coordinate()
        self.log: CollectiveLog | None = None
        self._recomputing = False
        self.serial = mesh.device_type == "cpu"
        """gloo: a collective is issued only once the one left running has finished (module docstring)."""
        self._scattering: torch.Tensor | None = None
        """The last reduce-scatter left running (``run_unwaited``)."""
        self._gathering: list[torch.Tensor] = []
        """The outputs of the last all-gather issued without waiting (``launch``, ``grouped.launch_group``),
        on a CPU mesh only; each leaves when its ``finish`` takes it."""
        self._works: list[dist.Work] = []
        """Collectives issued outside, left running on this mesh (``left_running``), on a CPU mesh only."""
        self._sized_by_data = False
        """Collectives run now move a tensor of data-dependent size (``sized_by_data``)."""
        self.grad_groups: dict[str, GradientGroup] = {}
        """Tag -> the gradient group its members' backwards hand their gradients to
        (``runtime.grouped``: made for the program's ``reduce_group=`` calls)."""
        self.weight_pass = False
        """Backward runs as input then weight gradients (a zero-bubble schedule): torch's weight pass
        (``stage_backward_weight``) takes each parameter's gradient from ``autograd.grad``, which
        refuses a parameter it gets none for, so a member of a gradient group returns zeros there."""

    def settle(self) -> None:
        """On a CPU mesh, wait for every collective left running on this mesh: called before
        any collective is issued, here or elsewhere on this mesh (gradient buckets, ZeRO-1's
        buckets at the optimizer step, the ring's sends, the experts' all-to-alls)."""
        if not self.serial or not (self._gathering or self._scattering is not None or self._works):
            return
        # What is waited for here was issued elsewhere: a checkpointed region's recompute, whose
        # selective policy counts the ops it runs against its forward's, must not see these waits.
        with _disable_current_modes() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext():
            for out in self._gathering:
                fc.wait_tensor(out)
            self._gathering = []
            if self._scattering is not None:
                waited(self._scattering)
                self._scattering = None
            while self._works:
                self._works.pop(0).wait()

    def gathering(self, outs: list[torch.Tensor]) -> None:
        """``outs``, an all-gather's outputs issued without waiting, are waited for before the next
        collective on a CPU mesh (held only until each one's ``finish``: no longer than its use)."""
        if self.serial:
            self._gathering = outs

    def scattering(self, out: torch.Tensor) -> None:
        """``out``, a reduce-scatter left running, is waited for before the next one is issued, and
        on a CPU mesh before any collective."""
        if self._scattering is not None:
            with _disable_current_modes():  # as in ``settle``
                waited(self._scattering)
        self._scattering = out

    def member(self, reduce_group: tuple[str, int, int] | None) -> tuple[GradientGroup, int] | None:
        """A ``reduce_group=(tag, index, size)`` argument as (its group, the member's index)."""
        return None if reduce_group is None else (self.grad_groups[reduce_group[0]], reduce_group[1])

    def left_running(self, work: dist.Work) -> None:
        """``work``, an asynchronous collective issued on this mesh outside ``Comm`` (a gradient
        bucket's all-reduce), is waited for before the next collective on a CPU mesh."""
        if self.serial:
            self._works.append(work)

    def _gather(self, x: torch.Tensor, mesh_dim: int, dim: int, waited: bool) -> torch.Tensor:
        """An all-gather, issued after the collectives in flight on a CPU mesh; ``waited``: waited for now."""
        self.settle()
        out = fc.all_gather_single(x, dim, (self.mesh, mesh_dim))
        if waited:
            return fc.wait_tensor(out)
        self.gathering([out])  # dropped at finish: held here, the gathered copy would outlive its use
        return out

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Forward collectives run inside are a block's recompute (logged as such)."""
        previous, self._recomputing = self._recomputing, True
        try:
            yield
        finally:
            self._recomputing = previous

    @contextlib.contextmanager
    def sized_by_data(self, data_dependent: bool = True) -> Iterator[None]:
        """Collectives run inside move a tensor whose size the data decides (the tokens routed to one
        expert, ``capture.unbacked``): logged ``DATA_DEPENDENT``, as the plan lists them."""
        previous, self._sized_by_data = self._sized_by_data, data_dependent or self._sized_by_data
        try:
            yield
        finally:
            self._sized_by_data = previous

    def _record(self, phase: str, kind: str, dim: int, tensor: torch.Tensor) -> None:
        nbytes = DATA_DEPENDENT if self._sized_by_data else tensor.numel() * tensor.element_size()
        self.record_bytes(phase, kind, dim, nbytes)

    def record_bytes(self, phase: str, kind: str, dim: int, nbytes: int) -> None:
        """Log one collective of ``nbytes`` (``DATA_DEPENDENT``: sized by the data) run on mesh dim ``dim``."""
        if self.log is not None and self.mesh.size(dim) > 1:
            if self._recomputing and phase == "forward":
                phase = "recompute"
            self.log.entries.append((phase, kind, dim, nbytes))

    def run(self, x: torch.Tensor, steps: tuple[Step, ...], phase: str) -> torch.Tensor:
        for step in steps:
            x = self._step(x, step, phase)
        return x

    def launch(self, x: torch.Tensor, steps: tuple[Step, ...], phase: str) -> Pending:
        """Run ``steps`` up to their first collective; issue it without waiting when it is an
        all-gather (else run everything now). ``finish`` completes it."""
        for k, step in enumerate(steps):
            if step.kind not in COLLECTIVES or self.mesh.size(step.mesh_dim) == 1:
                x = self._step(x, step, phase)
                continue
            if step.kind != ALL_GATHER:
                break
            # gathered along dim 0 and rearranged at finish: along another dim torch waits at once
            issued = self._gather(x.contiguous(), step.mesh_dim, 0, waited=False)
            self._record(phase, ALL_GATHER, step.mesh_dim, issued)  # its size is known before the data
            return Pending(issued, step, steps[k + 1:])
        else:
            return Pending(x, None, ())
        return Pending(self.run(x, steps[k:], phase), None, ())

    def run_unwaited(self, x: torch.Tensor, steps: tuple[Step, ...], phase: str) -> torch.Tensor:
        """``run``, except that a last step reduce-scattering is issued and not waited for: the
        result is then an AsyncCollectiveTensor, which waits when an op first reads it. The
        one issued before is waited for first: until then its whole input (the unsharded
        gradient) stays alive, so at most one more is held than when each waits at once."""
        last = steps[-1] if steps else None
        if last is None or last.kind != REDUCE_SCATTER or self.mesh.size(last.mesh_dim) == 1:
            return self.run(x, steps, phase)
        x = self._scatter_order(self.run(x, steps[:-1], phase), last).contiguous()
        self.settle()
        self._record(phase, REDUCE_SCATTER, last.mesh_dim, x)
        out = fc.reduce_scatter_single(x, "sum", last.dst_dim, (self.mesh, last.mesh_dim))
        self.scattering(out)  # waits for the one issued before
        return out

    def finish(self, pending: Pending, phase: str) -> torch.Tensor:
        """Wait for a launched redistribution and run the steps after its all-gather."""
        x, step = pending.tensor, pending.step
        if pending.group is not None:  # its group's collective (``Comm.left_running``): waited for once
            x = pending.group.take(pending.index)
        elif step is not None:
            self._gathering = [out for out in self._gathering if out is not x]
            x = fc.wait_tensor(x)
        if step is not None:
            n = self.mesh.size(step.mesh_dim)
            if step.src_dim != 0:
                x = torch.cat(x.chunk(n, dim=0), dim=step.src_dim)
            x = self._joined(x, step, n)
        return self.run(x, pending.rest, phase)

    def _joined(self, gathered: torch.Tensor, step: Step, n: int) -> torch.Tensor:
        """An all-gather's rank-major pieces of ``step.src_dim`` in the tensor's own order."""
        if step.mesh_dim in self.zigzag:
            return zigzag_join(gathered, step.src_dim, step.factor, n)
        return strided_join(gathered, step.src_dim, step.factor, n) if step.factor > 1 else gathered

    def _scatter_order(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """``x`` laid out so that contiguous chunk j of ``step.dst_dim`` is what rank j keeps."""
        return zigzag_order(x, step.dst_dim, self.mesh.size(step.mesh_dim)) if step.mesh_dim in self.zigzag else x

    def _step(self, x: torch.Tensor, step: Step, phase: str) -> torch.Tensor:
        i = step.mesh_dim
        n = self.mesh.size(i)
        group = (self.mesh, i)
        if n == 1 and step.kind in COLLECTIVES:  # one rank on this mesh dim: its data is already the result
            return x
        if step.kind == SLICE:
            if i in self.zigzag:
                return zigzag_take(x, step.dst_dim, step.factor, n, self.coordinate[i]).contiguous()
            if step.factor > 1:
                return strided_take(x, step.dst_dim, step.factor, n, self.coordinate[i]).contiguous()
            size = x.shape[step.dst_dim] // n
            return x.narrow(step.dst_dim, self.coordinate[i] * size, size).contiguous()
        if step.kind == ZERO:
            return x if self.coordinate[i] == 0 else torch.zeros_like(x)
        x = x.contiguous()
        self.settle()
        if step.kind == ALL_REDUCE:
            self._record(phase, ALL_REDUCE, i, x)
            return fc.wait_tensor(fc.all_reduce(x, "sum", group))
        if step.kind == ALL_GATHER:
            out = self._gather(x, i, step.src_dim, waited=True)
            self._record(phase, ALL_GATHER, i, out)
            return self._joined(out, step, n)
        if step.kind == REDUCE_SCATTER:
            self._record(phase, REDUCE_SCATTER, i, x)
            x = self._scatter_order(x, step).contiguous()
            return fc.wait_tensor(fc.reduce_scatter_single(x, "sum", step.dst_dim, group))
        if step.kind == ALL_TO_ALL:
            self._record(phase, ALL_TO_ALL, i, x)
            chunks = torch.stack(self._scatter_order(x, step).chunk(n, dim=step.dst_dim))  # chunk j goes to rank j
            # gloo's all-to-all carries no complex dtype: the (real, imaginary) pairs travel instead
            moved = torch.view_as_real(chunks.contiguous()) if chunks.is_complex() else chunks.contiguous()
            received = fc.wait_tensor(fc.all_to_all_single(moved, None, None, group))
            received = torch.view_as_complex(received) if chunks.is_complex() else received
            return self._joined(torch.cat(received.unbind(0), dim=step.src_dim), step, n)
        raise ValueError(step.kind)


class _Redistribute(torch.autograd.Function):
    """Forward: cast to ``dtype`` (if given), then the forward steps. Backward: the gradient
    cast to ``grad_dtype`` (if given), the backward steps, then cast to the input's dtype.

    A parameter's cast and its reshard are one op so that its gradient is reduced in
    ``grad_dtype``: after a separate cast node, autograd would hand the reshard's backward
    a gradient in the cast's (bf16) dtype and reduce-scatter it there."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, fwd: tuple[Step, ...],  # type: ignore[override]
                bwd: tuple[Step, ...], own_storage: bool = False, dtype: torch.dtype | None = None,
                grad_dtype: torch.dtype | None = None, pending: Pending | None = None,
                data_dependent: bool = False, reduce_group: tuple[GradientGroup, int] | None = None
                ) -> torch.Tensor:
        ctx.comm, ctx.bwd, ctx.input_dtype, ctx.grad_dtype = comm, bwd, x.dtype, grad_dtype
        ctx.data_dependent, ctx.reduce_group = data_dependent, reduce_group
        ctx.parameter = x if x.is_leaf else None  # its gradient goes straight into .grad
        out = forward_value(comm, x, fwd, dtype, pending)
        if own_storage and (out._base is not None or not out.is_contiguous() or out.storage_offset() != 0):
            out = out.clone(memory_format=torch.contiguous_format)  # a view would keep its whole base alive
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if ctx.grad_dtype is not None:
            grad = grad.to(ctx.grad_dtype)
        rest = (None,) * 9
        if ctx.reduce_group is not None and ctx.parameter is not None:  # reduced with its group's, into .grad
            group, index = ctx.reduce_group
            group.add(index, ctx.parameter, grad, ctx.bwd)
            return torch.zeros_like(ctx.parameter) if ctx.comm.weight_pass else None, *rest
        if ctx.parameter is None or grad.dtype != ctx.input_dtype:
            with ctx.comm.sized_by_data(ctx.data_dependent):
                return ctx.comm.run(grad, ctx.bwd, "backward").to(ctx.input_dtype), *rest
        # A parameter's reduce-scatter runs while backward goes on: autograd stores the unwaited
        # result in .grad (or sums it, which waits); at the end of backward it is waited for.
        out = ctx.comm.run_unwaited(grad, ctx.bwd, "backward")
        if isinstance(out, fc.AsyncCollectiveTensor):
            param = ctx.parameter
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _settle_grad(param))
        return out, *rest


def _settle_grad(param: torch.Tensor) -> None:
    """Wait for a reduce-scatter left running in ``param.grad`` and keep a plain tensor there."""
    if isinstance(param.grad, fc.AsyncCollectiveTensor):
        param.grad = param.grad.trigger_wait()


def forward_value(comm: Comm, x: torch.Tensor, fwd: tuple[Step, ...], dtype: torch.dtype | None,
                  pending: Pending | None) -> torch.Tensor:
    """The forward redistribution of ``x``: waited for when it was launched ahead (``pending``), else run now."""
    if pending is not None:
        return comm.finish(pending, "forward")
    return comm.run(x if dtype is None else x.to(dtype), fwd, "forward")


class Reshard(nn.Module):
    """``self.reshard(x, src, dst, grad_src, grad_dst)``: placements as printed in plans.

    A parameter's reshard in mixed precision also names ``dtype=`` (what forward computes
    in: the fp32 master is cast before its collectives, so they move bf16) and
    ``grad_dtype=`` (what its gradient is reduced in, fp32); see ``passes.cast_parameters``.
    ``pending=`` is the same redistribution launched ahead by ``self.prefetch`` or ``self.gather_group``
    (waited for here). ``data_dependent=True``: ``x`` has a dim whose size the data decides (its
    collectives logged so). ``reduce_group=(tag, index, size)``: a parameter whose gradient is
    reduced with its group's, in one collective (``runtime.grouped``)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, x: torch.Tensor, src: str, dst: str, grad_src: str = "", grad_dst: str = "", *,
                dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                pending: Pending | None = None, data_dependent: bool = False,
                reduce_group: tuple[str, int, int] | None = None) -> torch.Tensor:
        fwd = _steps(src, dst)
        bwd = _steps(grad_src, grad_dst) if grad_src else ()
        with self.comm.sized_by_data(data_dependent):
            if not x.requires_grad or not torch.is_grad_enabled():
                return forward_value(self.comm, x, fwd, dtype, pending)
            return _Redistribute.apply(x, self.comm, fwd, bwd, False, dtype, grad_dtype, pending, data_dependent,
                                       self.comm.member(reduce_group))


class Prefetch(nn.Module):
    """``self.prefetch(x, src, dst, dtype=...)``: issue the forward all-gather of a parameter's
    ``self.reshard``/``self.regather`` ahead of its use and return the ``Pending`` handle that
    call waits for (``pending=``). Autograd sees only that call: the gradient still flows
    through it, and the launch reads the parameter's data alone."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, x: torch.Tensor, src: str, dst: str, *, dtype: torch.dtype | None = None) -> Pending:
        with torch.no_grad():
            return self.comm.launch(x if dtype is None else x.to(dtype), _steps(src, dst), "forward")
