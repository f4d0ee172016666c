"""Grouped parameter collectives (``cost.groups``): a block's gathers, gathers again and gradient
reduce-scatters each run as one collective over all its members, as FSDP2 runs them per module.

Gathers: ``self.gather_group(xs, specs, dtype=...)`` (``GatherGroup``, written by
``passes.group_collectives``) issues the members' all-gathers as one all-gather of one flat
buffer (their shards end to end) and returns each member's ``Pending``, which its own
``self.reshard``/``self.regather`` waits for (``pending=``): the first of them waits for the
group and copies every member out of the buffer (``split_with_sizes_copy``: each as gathered
along dim 0, as ``Comm.launch`` gathers one), then the rest is as for one.

Gathers again (ZeRO-3): the regather handles of one group (``self.regather(..., group=tag)``)
gather together in backward (``runtime.regather``), through ``launch_group`` too.

Gradients: each member's ``self.reshard``/``self.regather`` names ``reduce_group=(tag, index,
size)``; its backward hands its gradient to the group (``GradGroup``) instead of reducing it, and
gives autograd none. Once the last member's is in, the group lays each member's gradient out by
destination rank in one flat buffer (rank j's chunks of every member, end to end), reduce-scatters
it in one call, left running beside the rest of backward (waited for before the next collective
on a CPU mesh, ``Comm.settle``), and at the end of backward each member's ``.grad`` gets its piece
(added to what it holds: gradients accumulate over micro-batches as autograd's would). A group
whose members' gradients did not all arrive in a backward is an error, never a silent skip. Under a
split backward (``Comm.weight_pass``) torch's weight pass runs one ``autograd.grad`` per set of
parameters sharing intermediates, so a group's members arrive over several of them: the stage checks
its groups once its weight pass is done (``check_grad_groups``), not each ``autograd.grad``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.fx
from torch import nn

from autopar.rules.redistribute import ALL_GATHER, COLLECTIVES, REDUCE_SCATTER, Step
from autopar.runtime.ops import Comm, Pending, _steps


def _split_at_collective(comm: Comm, steps: tuple[Step, ...], kind: str) -> int:
    """Index of the one collective of ``steps`` (of ``kind``, on more than one rank) a group runs."""
    return _collective_at(steps, tuple(comm.mesh.shape), kind)


@functools.lru_cache(maxsize=4096)
def _collective_at(steps: tuple[Step, ...], mesh_shape: tuple[int, ...], kind: str) -> int:
    at = [k for k, s in enumerate(steps) if s.kind in COLLECTIVES and mesh_shape[s.mesh_dim] > 1]
    if len(at) != 1 or steps[at[0]].kind != kind:
        raise RuntimeError(f"a grouped {kind} member runs {[s.kind for s in steps]}: not one {kind}")
    return at[0]


class _Gathered:
    """A group's all-gather in flight: one flat buffer, rank-major (rank j's shards end to end),
    copied out to every member at the first member's finish, as each one's output gathered along
    dim 0; one wait for the group."""

    def __init__(self, work: dist.Work, out: torch.Tensor, ranks: int, sent: list[torch.Tensor]) -> None:
        self.work, self.out, self.ranks = work, out, ranks
        self.numels = [t.numel() for t in sent]
        self.shapes = [(ranks * t.shape[0], *t.shape[1:]) for t in sent]
        self.members: list[torch.Tensor | None] | None = None

    def take(self, index: int) -> torch.Tensor:
        if self.members is None:
            self.work.wait()
            assert self.out is not None
            members = [torch.empty(shape, dtype=self.out.dtype, device=self.out.device) for shape in self.shapes]
            torch.split_with_sizes_copy(self.out.view(self.ranks, -1), self.numels, dim=1,
                                        out=[m.view(self.ranks, -1) for m in members])
            self.members, self.out = list(members), None  # the buffer goes: the members hold the gathered bytes
        member, self.members[index] = self.members[index], None
        assert member is not None, "a group member's gather was taken twice"
        return member


def launch_group(comm: Comm, xs: Sequence[torch.Tensor], steps: Sequence[tuple[Step, ...]], phase: str
                 ) -> list[Pending]:
    """Issue the members' all-gathers (each ``steps[i]``: local steps, one all-gather, local steps) as
    one collective over one flat buffer, not waited for; each member's ``Pending`` (``Comm.finish``
    completes it)."""
    sent, gathers, rests = [], [], []
    for x, member in zip(xs, steps):
        k = _split_at_collective(comm, member, ALL_GATHER)
        sent.append(comm.run(x, member[:k], phase).contiguous())
        gathers.append(member[k])
        rests.append(member[k + 1:])
    dim = gathers[0].mesh_dim
    if any(g.mesh_dim != dim for g in gathers) or len({t.dtype for t in sent}) != 1:
        raise RuntimeError("a gather group's members gather on one mesh dim, in one dtype")
    flat = torch.cat([t.reshape(-1) for t in sent])
    ranks = comm.mesh.size(dim)
    out = flat.new_empty(ranks * flat.numel())
    comm.settle()
    work = dist.all_gather_single(out, flat, group=comm.mesh.get_group(dim), async_op=True)
    comm.record_bytes(phase, ALL_GATHER, dim, out.numel() * out.element_size())
    comm.left_running(work)
    gathered = _Gathered(work, out, ranks, sent)
    return [Pending(out, g, r, gathered, i) for i, (g, r) in enumerate(zip(gathers, rests))]


class GatherGroup(nn.Module):
    """``self.gather_group(xs, specs, dtype=...)``: issue the all-gathers of parameters ``xs``
    (``specs``: each one's source and destination placements, flat: src0, dst0, src1, ...) as one
    collective; returns each member's ``Pending`` (``pending=`` of its own gather call)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, xs: tuple[torch.Tensor, ...], specs: tuple[str, ...], *, dtype: torch.dtype | None = None
                ) -> list[Pending]:
        steps = [_steps(specs[2 * i], specs[2 * i + 1]) for i in range(len(xs))]
        with torch.no_grad():
            return launch_group(self.comm, [x if dtype is None else x.to(dtype) for x in xs], steps, "forward")


@dataclass
class _Member:
    param: torch.Tensor
    grad: torch.Tensor
    steps: tuple[Step, ...]


class GradGroup:
    """One group's gradients, reduce-scattered in one collective once every member's is in."""

    def __init__(self, comm: Comm, tag: str, size: int) -> None:
        self.comm, self.tag, self.size = comm, tag, size
        self.members: dict[int, _Member] = {}
        self.queued = False

    def add(self, index: int, param: torch.Tensor, grad: torch.Tensor, steps: tuple[Step, ...]) -> None:
        """Member ``index``'s gradient of this backward (``steps``: its reduction, one reduce-scatter)."""
        if not self.queued and not self.comm.weight_pass:  # checks at the end of backward that the group ran
            torch.autograd.Variable._execution_engine.queue_callback(self.check)
            self.queued = True
        if index in self.members:
            raise RuntimeError(f"gradient group {self.tag}: a second gradient of member {index} in one backward")
        self.members[index] = _Member(param, grad, steps)
        if len(self.members) == self.size:
            self._issue([self.members[i] for i in range(self.size)])
            self.members = {}

    def _issue(self, members: list[_Member]) -> None:
        comm = self.comm
        rows, shapes, rests = [], [], []
        step = None
        for m in members:
            k = _split_at_collective(comm, m.steps, REDUCE_SCATTER)
            step = m.steps[k]
            x = comm._scatter_order(comm.run(m.grad, m.steps[:k], "backward"), step)
            n, d = comm.mesh.size(step.mesh_dim), step.dst_dim
            chunked = x.unflatten(d, (n, x.shape[d] // n)).movedim(d, 0)  # row j: what rank j keeps
            shapes.append(chunked.shape[1:])
            rows.append(chunked.reshape(n, -1))
            rests.append(m.steps[k + 1:])
        assert step is not None
        flat = torch.cat(rows, dim=1).reshape(-1)
        comm.settle()
        comm.record_bytes("backward", REDUCE_SCATTER, step.mesh_dim, flat.numel() * flat.element_size())
        out = torch.ops._c10d_functional.reduce_scatter_tensor(flat, "sum", comm.mesh.size(step.mesh_dim),
                                                               comm.mesh.get_group(step.mesh_dim).group_name)
        comm.scattering(out)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._assign(out, [m.param for m in members], shapes, rests))

    def _assign(self, out: torch.Tensor, params: list[torch.Tensor], shapes: list[torch.Size],
                rests: list[tuple[Step, ...]]) -> None:
        """Each member's piece of the reduced buffer into its ``.grad`` (added to what it holds)."""
        self.comm.settle()
        reduced = fc.wait_tensor(out)
        start = 0
        for param, shape, rest in zip(params, shapes, rests):
            numel = shape.numel()
            grad = self.comm.run(reduced[start:start + numel].view(shape), rest, "backward").to(param.dtype)
            start += numel
            param.grad = grad if param.grad is None else param.grad + grad

    def check(self) -> None:
        """Raise if some but not all members' gradients arrived since the group last ran."""
        self.queued = False
        if self.members:
            missing = sorted(set(range(self.size)) - set(self.members))
            self.members = {}
            raise RuntimeError(f"gradient group {self.tag}: members {missing} got no gradient in this backward; "
                               "backward must run through the whole step (the loss the compiled module returned)")


def check_grad_groups(comm: Comm) -> None:
    """``GradGroup.check`` of each of ``comm``'s groups (a split backward's, after a weight pass)."""
    for group in comm.grad_groups.values():
        group.check()


def attach_grad_groups(comm: Comm, program: torch.fx.GraphModule) -> None:
    """Make the gradient group of every ``reduce_group=(tag, index, size)`` the program's calls name
    (checkpointed regions' too) on ``comm``, where the members' backwards find it."""
    for module in program.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            found = node.kwargs.get("reduce_group") if node.op == "call_module" else None
            if found is not None and found[0] not in comm.grad_groups:
                comm.grad_groups[found[0]] = GradGroup(comm, found[0], found[2])
