"""``self.recompute(region, policy, *inputs)``: a checkpointed block's forward, run so
that backward recomputes what it did not keep (the calls ``autopar.passes.checkpoint_blocks``
writes).

torch's non-reentrant checkpoint runs the region; 'full' keeps only its inputs, 'selective'
also keeps the outputs of the ops in ``autopar.cost.recompute.SAVED_DISPATCH_OPS`` (matmuls
and attention) and recomputes the rest, 'selective_op' keeps attention's and every other linear
matmul's (torchtitan's op-level policy; the call's ``matmuls=`` places the region in its block, and
a region that runs another number of them than planned is an error). The recompute must
reproduce the forward bit for bit:
- random draws come from the module's own generator (``RandomOps``), which torch's
  checkpoint does not preserve: the recompute starts from the generator's state at region
  entry and leaves it where it found it;
- early stop is off, so a recompute runs the whole region, every forward collective in it
  included, on every rank alike (a rank stopping early would skip collectives its peers run);
- those collectives are logged as phase "recompute" (``Comm.recomputing``);
- inputs the call names ``mutated`` (state the region writes in place, as batch norm's running
  statistics and ``num_batches_tracked``, or that changes before backward) are not checkpoint's
  inputs, whose versions it checks: the forward updates the real tensors, once, and each
  recompute runs on a fresh copy of the values the forward found, which it may write freely.

A zero-bubble pipeline schedule (``replays``) runs a stage's backward as two passes, input
gradients then weight gradients (``torch.distributed.pipelining._backward``), and torch's
checkpoint recomputes a region once per pass (the weight pass's autograd calls, one per group
of parameters, share one recompute under a ``GraphExecGroup``: ``runtime.stages``), so twice.
'full' needs nothing for that; 'selective' does: torch hands each kept output out once, then
raises ("backward an extra time"), so with ``replays`` every recompute gets the kept outputs back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn, set_checkpoint_early_stop)

from autopar.cost.recompute import OP_COUNTED_DISPATCH_OPS, OP_SAVED_DISPATCH_OPS, SAVED_DISPATCH_OPS
from autopar.runtime.ops import Comm


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_DISPATCH_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _OpPolicy:
    """'selective_op' for one region call (``cost.recompute``): attention kernels kept, and of the
    linear matmuls, counted from ``before`` (those its block ran in earlier regions), every other
    one, starting with the block's first. torch asks the policy in the forward only (the recompute
    replays its answers by op and call index), so one count serves any number of recomputes."""

    def __init__(self, before: int, count: int) -> None:
        self.before, self.count = before, count
        self.seen = 0  # linear matmuls the forward ran so far

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in OP_COUNTED_DISPATCH_OPS:
            index = self.before + self.seen
            self.seen += 1
            return CheckpointPolicy.MUST_SAVE if index % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in OP_SAVED_DISPATCH_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    def check_forward(self) -> None:
        """The region ran the matmuls it was planned with: otherwise the plan priced other ops as kept."""
        if self.seen != self.count:
            raise RuntimeError(f"a 'selective_op' checkpointed region ran {self.seen} linear matmuls (mm, "
                               f"addmm) where its plan counted {self.count} (linear, mm, addmm nodes): its ops "
                               "dispatch otherwise than planned; pin checkpoint='selective' or 'full'")


def _op_contexts(policy: _OpPolicy, replays: bool) -> Any:
    forward, recompute = create_selective_checkpoint_contexts(policy)
    return forward, _Replayable(recompute) if replays else recompute


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def _replayable_selective_contexts() -> Any:
    forward, recompute = _selective_contexts()
    return forward, _Replayable(recompute)


class _Replayable:
    """Selective checkpointing's recompute context, run any number of times: the outputs the
    forward kept (the mode's ``storage``: op -> call index -> value) are put back after each
    recompute, which marks those it handed out as consumed."""

    def __init__(self, cached: Any) -> None:
        self.cached = cached
        self.kept: dict[Any, dict[int, Any]] = {}

    def __enter__(self) -> Any:
        self.kept = {op: dict(calls) for op, calls in self.cached.storage.items()}
        return self.cached.__enter__()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> Any:
        try:
            return self.cached.__exit__(kind, value, trace)
        finally:
            for op, calls in self.kept.items():
                self.cached.storage[op].update(calls)


class _RegionRun:
    """The function checkpoint calls, with the region's inputs but the mutated ones: first
    the forward, on the real mutated tensors, then each recompute, on copies of them as the
    forward found them, from the generator state the forward started from."""

    def __init__(self, region: nn.Module, comm: Comm, generator: torch.Generator,
                 mutated: dict[int, torch.Tensor], op_policy: _OpPolicy | None = None) -> None:
        self.region, self.comm, self.generator = region, comm, generator
        self.entry = generator.get_state()
        self.mutated = mutated
        self.op_policy = op_policy
        self.found: dict[int, tuple[torch.Tensor, bool]] = {}
        self.ran = False

    def __call__(self, *kept: Any) -> Any:
        if not self.ran:
            self.ran = True
            # copied here, not before: the forward runs one clone per mutated input as each
            # recompute does, so selective checkpointing sees the same ops in both
            self.found = {i: (t.detach().clone(), t.requires_grad) for i, t in self.mutated.items()}
            out = self.region(*_merged(kept, self.mutated))
            if self.op_policy is not None:
                self.op_policy.check_forward()
            return out
        # a copy per recompute (a split backward recomputes twice), needing grad where the
        # forward's did, so that autograd saves what it saved in the forward
        copies = {i: value.clone().requires_grad_(grad) for i, (value, grad) in self.found.items()}
        after = self.generator.get_state()  # where later draws (forward or backward) left it
        self.generator.set_state(self.entry)
        try:
            with self.comm.recomputing():
                return self.region(*_merged(kept, copies))
        finally:
            self.generator.set_state(after)


def _merged(kept: tuple[Any, ...], mutated: dict[int, torch.Tensor]) -> list[Any]:
    """The region's inputs in order: ``mutated`` at their positions, ``kept`` around them."""
    rest = iter(kept)
    return [mutated[i] if i in mutated else next(rest) for i in range(len(kept) + len(mutated))]


class Recompute(nn.Module):
    """Runs a region under activation checkpointing with policy 'full', 'selective' or 'selective_op'
    ('none', or grad disabled: just runs it). ``replays``: backward may recompute a region
    more than once; ``mutated``: positions of inputs that change before the recompute
    (module docstring)."""

    def __init__(self, comm: Comm, generator: torch.Generator, replays: bool = False) -> None:
        super().__init__()
        self.comm = comm
        self.generator = generator
        self.replays = replays

    def forward(self, region: nn.Module, policy: str, *inputs: Any, mutated: tuple[int, ...] = (),
                matmuls: tuple[int, int] = (0, 0)) -> Any:
        if policy == "none" or not torch.is_grad_enabled():
            return region(*inputs)
        if policy not in ("full", "selective", "selective_op"):
            raise ValueError(f"unknown checkpointing policy {policy!r}")
        context_fn: Callable[[], Any] = noop_context_fn
        op_policy = _OpPolicy(*matmuls) if policy == "selective_op" else None
        if policy == "selective":
            context_fn = _replayable_selective_contexts if self.replays else _selective_contexts
        elif op_policy is not None:
            context_fn = functools.partial(_op_contexts, op_policy, self.replays)
        run = _RegionRun(region, self.comm, self.generator, {i: inputs[i] for i in mutated}, op_policy)
        kept = [x for i, x in enumerate(inputs) if i not in run.mutated]
        with set_checkpoint_early_stop(False):
            return checkpoint(run, *kept, use_reentrant=False, context_fn=context_fn)
