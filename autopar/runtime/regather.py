"""ZeRO-3 (FSDP ``reshard_after_forward=True``): a parameter's gathered copy is freed after
its forward use and gathered again in backward.

``self.regather(p, fqn, src, dst, grad_src, grad_dst)`` runs like ``self.reshard`` (same
forward gather, same backward reduce-scatter of the gradient) but tags its output. While
the program runs under ``regather_hooks()``, autograd's pack hook swaps every saved
tensor that is a tagged output, or a view of one (linear saves ``weight.t()``), for a
small handle: the local shard, the redistribution steps and the view's geometry. Nothing
then holds the gathered tensor past its consumers, so it is freed when the program drops
it. Unpacking in backward runs the gather again (logged as a backward all_gather) and
rebuilds the view; each saved use gathers on its own (no caching: the copy lives only as
long as the backward op reading it). Which ops save the parameter, and so cost a
regather: ``autopar.cost.saved``.

Backward prefetch (FSDP2's): when block ``layers.i``'s backward starts, the gathers of
every handle block ``layers.i-1`` saved (the block before it in forward, same container)
are issued without waiting; each is waited for when its handle is unpacked. What block i
does with its own parameters does not matter (gathered again, held from forward, as
torchtitan keeps the last block, or replicated): the trigger is ``self.backward_starts(v,
'layers.i', 'layers.i-1')``, which ``autopar.passes.prefetch_gathers`` writes after each
value ``v`` block i computes and later code reads, and which hooks ``v``'s gradient, as
FSDP2's pre-backward hook does on a block's outputs: it is complete exactly when the
backward of everything after block i is done (the first such hook to fire counts). A
tensor hook, not an autograd node of its own: nothing is copied or viewed, so in-place
ops on ``v`` stay legal; the calls stay outside checkpointed regions, and a recompute
runs outside this context anyway (it registers none). So block i-1's gathers run while
block i computes its backward, and at most one extra block's gathered parameters are
alive (priced: ``autopar.solver.overlap``). Handles outside a repeated block gather when
unpacked, as do those of a container's last block. Each program run (one micro-batch) has
its own prefetcher, which its hooks keep.

Grouped (``cost.groups``): the regathers a call names ``group=tag`` for gather as one
collective (``runtime.grouped.launch_group``), of every such handle saved in forward: at the
first unpack of one, or all at once by the backward prefetch. Each parameter's gathered copy
then serves each of its handles and is dropped with the last.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.rules.redistribute import Step
from autopar.problem.block_paths import block_of
from autopar.runtime.grouped import launch_group
from autopar.runtime.ops import Comm, Pending, _Redistribute, _steps, forward_value

_TAG = "_autopar_regather"
"""Attribute of a gathered output holding its ``_Source``."""


@dataclass(frozen=True)
class _Source:
    """How to make a gathered parameter again: its local shard and the forward steps."""

    comm: Comm
    shard: torch.Tensor
    """The parameter's local shard, detached (the optimizer steps only after backward, so
    it still holds the forward's values when backward regathers)."""
    steps: tuple[Step, ...]
    fqn: str
    dtype: torch.dtype | None = None
    """What the shard is cast to before gathering (mixed precision: bf16, from the fp32 master)."""
    group: str | None = None
    """The tag of the group it gathers again with (None: on its own)."""

    def cast_shard(self) -> torch.Tensor:
        return self.shard if self.dtype is None else self.shard.to(self.dtype)

    def launch(self) -> Pending:
        """Issue the gather again (not waited for: ``finish``)."""
        with self._logged(), torch.no_grad():
            return self.comm.launch(self.cast_shard(), self.steps, "backward")

    def finish(self, pending: Pending) -> torch.Tensor:
        """The gathered tensor again, contiguous and owning its storage (as in forward)."""
        with self._logged(), torch.no_grad():
            return _own_storage(self.comm.finish(pending, "backward"))

    @contextlib.contextmanager
    def _logged(self) -> Iterator[None]:
        with logged_as(self.comm, [self.fqn]):
            yield


@contextlib.contextmanager
def logged_as(comm: Comm, fqns: list[str]) -> Iterator[None]:
    """Collectives run inside are also listed as regathers of each of ``fqns``."""
    log = comm.log
    first = len(log.entries) if log is not None else 0
    yield
    if log is not None:
        log.regathers.extend((fqn, entry) for entry in log.entries[first:] for fqn in fqns)


@dataclass(frozen=True, eq=False)  # identity: two uses saving the same view are two handles
class _Saved:
    """A saved tensor's stand-in: where to gather from and the view to rebuild."""

    source: _Source
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    whole: bool
    """The saved tensor was the gathered tensor itself, not a view of it."""


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that is no view (a slice of a gather would otherwise keep
    the whole gather alive as its base, and its views' offsets would not be reproducible)."""
    if t._base is not None or not t.is_contiguous() or t.storage_offset() != 0:
        return t.clone(memory_format=torch.contiguous_format)
    return t


class _Prefetcher:
    """One program run's saved handles, by block, for the backward prefetch (module docstring)."""

    def __init__(self) -> None:
        self.waiting: dict[str, dict[_Saved, None]] = {}
        """Block -> its handles not yet unpacked, in the order saved (an ordered set)."""
        self.pending: dict[_Saved, Pending] = {}
        """Handles whose gather was issued ahead."""
        self.started: set[str] = set()
        """Blocks whose backward started (their predecessor's gathers were issued then)."""
        self.groups = _GroupedRegathers()
        """The handles of grouped regathers (their sources'), apart."""

    def pack(self, t: torch.Tensor) -> Any:
        root = t if t._base is None else t._base
        source: _Source | None = getattr(root, _TAG, None)
        if source is None or t.dtype != root.dtype:
            return t
        saved = _Saved(source, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t is root)
        block = block_of(source.fqn)
        if source.group is not None:
            self.groups.saved(source, block)
        elif block is not None:
            self.waiting.setdefault(block, {})[saved] = None
        return saved

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        source = saved.source
        if source.group is not None:
            full = self.groups.take(source)
        else:
            pending = self.pending.pop(saved, None)
            full = source.finish(pending if pending is not None else source.launch())
            block = block_of(source.fqn)
            if block is not None:
                self.waiting[block].pop(saved, None)
        return full if saved.whole else full.as_strided(saved.size, saved.stride, saved.offset)

    def backward_starts(self, block: str, previous: str) -> None:
        """``block``'s backward starts: issue the gathers of ``previous``'s handles (once)."""
        if block in self.started:
            return
        self.started.add(block)
        self.groups.launch_block(previous)
        for saved in self.waiting.get(previous, {}):
            if saved not in self.pending:
                self.pending[saved] = saved.source.launch()


class _GroupedRegathers:
    """One program run's grouped regathers: each group's sources (in the order saved) gathered as
    one collective, each source's copy serving its handles until the last is unpacked."""

    def __init__(self) -> None:
        self.members: dict[str, dict[int, _Source]] = {}
        """Group tag -> its sources saved in forward, by id (an ordered set)."""
        self.block: dict[str, str | None] = {}
        self.uses: dict[int, int] = {}
        """Source id -> its handles not yet unpacked."""
        self.pending: dict[int, Pending] = {}
        self.gathered: dict[int, torch.Tensor] = {}
        self.launched: set[str] = set()

    def saved(self, source: _Source, block: str | None) -> None:
        assert source.group is not None
        self.members.setdefault(source.group, {})[id(source)] = source
        self.block[source.group] = block
        self.uses[id(source)] = self.uses.get(id(source), 0) + 1

    def launch(self, tag: str) -> None:
        """Issue group ``tag``'s gather (once per run), not waited for."""
        if tag in self.launched:
            return
        self.launched.add(tag)
        sources = list(self.members[tag].values())
        comm = sources[0].comm
        with logged_as(comm, [s.fqn for s in sources]), torch.no_grad():
            pending = launch_group(comm, [s.cast_shard() for s in sources], [s.steps for s in sources], "backward")
        self.pending.update(zip(map(id, sources), pending))

    def launch_block(self, block: str) -> None:
        """Issue the gathers of ``block``'s groups (the backward prefetch)."""
        for tag in [t for t, b in self.block.items() if b == block]:
            self.launch(tag)

    def take(self, source: _Source) -> torch.Tensor:
        """``source``'s gathered copy for one of its handles (its group's gather issued if it was not)."""
        key = id(source)
        if key not in self.gathered:
            assert source.group is not None
            self.launch(source.group)
            self.gathered[key] = source.finish(self.pending.pop(key))
        full = self.gathered[key]
        self.uses[key] -= 1
        if not self.uses[key]:
            del self.gathered[key]
        return full


_ACTIVE: contextvars.ContextVar[_Prefetcher | None] = contextvars.ContextVar("_autopar_prefetcher", default=None)
"""The prefetcher of the program run in progress (``regather_hooks``)."""


@contextlib.contextmanager
def regather_hooks() -> Iterator[None]:
    """Run a program so that the tagged gathered parameters it saves are gathered again in
    backward, each block's ahead of its backward."""
    prefetcher = _Prefetcher()
    token = _ACTIVE.set(prefetcher)
    try:
        with torch.autograd.graph.saved_tensors_hooks(prefetcher.pack, prefetcher.unpack):
            yield
    finally:
        _ACTIVE.reset(token)


class BackwardStarts(nn.Module):
    """``self.backward_starts(v, block, previous)``: once ``v``'s gradient is complete,
    ``block``'s backward starts and ``previous``'s regathers are issued (module docstring).
    Returns nothing: ``v`` itself flows on untouched."""

    def forward(self, v: torch.Tensor, block: str, previous: str) -> None:
        prefetcher = _ACTIVE.get()
        if prefetcher is None or not v.requires_grad or not torch.is_grad_enabled():
            return  # no backward of this run will come (or no ZeRO-3 handles to prefetch)

        def starts(grad: torch.Tensor) -> None:
            prefetcher.backward_starts(block, previous)
        v.register_hook(starts)


class Regather(nn.Module):
    """``self.regather(x, fqn, src, dst, grad_src, grad_dst)``: ``self.reshard`` for a
    ZeRO-3 parameter ``fqn``, whose gathered output autograd does not keep."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, x: torch.Tensor, fqn: str, src: str, dst: str, grad_src: str = "",
                grad_dst: str = "", *, dtype: torch.dtype | None = None,
                grad_dtype: torch.dtype | None = None, pending: Pending | None = None, group: str | None = None,
                reduce_group: tuple[str, int, int] | None = None) -> torch.Tensor:
        """``dtype``/``grad_dtype``/``pending``/``reduce_group`` as for ``self.reshard``: the fp32 master
        is cast before its gather, in forward and again in backward (the handle keeps the master's
        shard); ``group``: the tag of the group it gathers again with (module docstring)."""
        fwd = _steps(src, dst)
        bwd = _steps(grad_src, grad_dst) if grad_src else ()
        if x.requires_grad and torch.is_grad_enabled():
            out = _Redistribute.apply(x, self.comm, fwd, bwd, True, dtype, grad_dtype, pending, False,
                                      self.comm.member(reduce_group))
        else:
            out = _own_storage(forward_value(self.comm, x, fwd, dtype, pending))
        if out is not x and out._base is not x:  # nothing ran (one rank on the axis): x is no copy
            setattr(out, _TAG, _Source(self.comm, x.detach(), fwd, fqn, dtype, group))
        return out
