"""Measure a rank's peak memory in a real step: live tensor bytes, as the plan counts them.

``LiveBytes`` is a ``TorchDispatchMode`` that follows every storage an op creates (forward,
backward, collectives, the optimizer) until it is freed, plus the storages handed to
``track`` before the step (parameters, buffers, optimizer state, inputs), and keeps the
peak of their total. It counts what ``plan.predicted.peak_memory_bytes`` counts, and what
a device's allocator would hold for tensors:
- model state: parameters (this rank's shards), their gradients, optimizer state (Adam's
  ``exp_avg``/``exp_avg_sq`` and ``step``), buffers;
- activations autograd saves for backward, gathered parameters (ZeRO), recomputed blocks;
- temporaries alive at the same moment (an op's intermediate, a collective's buffers, the
  gradient buckets' flat buffers, a loss's logits gradient): the plan does not price these
  one by one, they are what the measured peak has beyond the predicted one.
It does not count what no op allocates through the dispatcher (a process group's internal
buffers, the CPU allocator's caching or fragmentation, the CUDA context): the plan does not
count those either (its memory headroom is for them).

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it does the same count by
module, but keys tensors by module hooks the compiled program (one FX module, saved-tensor
hooks for ZeRO-3 and checkpointing) does not fire as the user's model would; a flat count of
storages is what the plan's single per-rank figure is compared with.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that own storage behind ``t``: a wrapper subclass (DTensor) by its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):  # (some subclasses also list non-tensor attributes)
                yield from _plain_tensors(inner)
    elif t.device.type != "meta":
        yield t


class LiveBytes(TorchDispatchMode):
    """Live bytes of tracked storages and their peak (see the module docstring).

    Use as a context manager around the step; ``track`` what existed before it; ``phase``
    names the part of the step that runs, so ``peak_phase`` says where the peak fell.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.current = "start"
        self.peak_phase = "start"
        self.phase_peaks: dict[str, int] = {}
        self._bytes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref[Any]] = {}  # keeps the finalizers' keys unambiguous

    def track(self, tensors: Iterable[Any]) -> None:
        """Count these tensors' storages (already alive) from now until they are freed."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for plain in _plain_tensors(t):
                    self._add(plain.untyped_storage())

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute what runs inside to ``name`` (forward, backward, optimizer, ...)."""
        outer, self.current = self.current, name
        self.phase_peaks.setdefault(name, self.live)
        try:
            yield
        finally:
            self.current = outer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # inputs too: an in-place op or a collective may have resized a storage it wrote
        self.track(tree_leaves((out, args, kwargs)))
        return out

    def _add(self, storage: Any) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            if nbytes == self._bytes[key]:
                return
            self.live += nbytes - self._bytes[key]  # resized in place
        else:
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self.live += nbytes
        self._bytes[key] = nbytes
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.current
        self.phase_peaks[self.current] = max(self.phase_peaks.get(self.current, 0), self.live)

    def _free(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)
        self._refs.pop(key, None)


@dataclass
class StepMemory:
    """One rank's measured memory over one training step."""

    peak_bytes: int
    """Most live tensor bytes at any moment of the step."""
    start_bytes: int
    """Live bytes when the step began: parameters, buffers, optimizer state, inputs."""
    peak_phase: str
    """The part of the step the peak fell in."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Most live bytes within each part."""


def training_step(pm: torch.nn.Module, args: tuple[Any, ...], opt: torch.optim.Optimizer,
                  mem: LiveBytes | None = None) -> None:
    """``pm(*args)``, backward, ``opt.step()``, ``opt.zero_grad()``: one micro-batch's step,
    its phases named on ``mem``. A plan with micro-batches runs ``pm.step`` (forward and
    backward of every micro-batch) where the module has it."""
    mem = mem or LiveBytes()
    micro = getattr(getattr(pm, "plan", None), "memory", None)
    if micro is not None and micro.micro_batches > 1 and hasattr(pm, "step"):
        with mem.phase("forward+backward"):
            pm.step(*args)
    else:
        with mem.phase("forward"):
            loss = pm(*args)
        with mem.phase("backward"):
            loss.backward()
        del loss
    with mem.phase("optimizer"):
        opt.step()
        opt.zero_grad()


def measure_step(pm: torch.nn.Module, args: tuple[Any, ...], opt: torch.optim.Optimizer, *, warmup: int = 1,
                 step: Callable[..., None] = training_step) -> StepMemory:
    """Peak live tensor bytes of one training step, after ``warmup`` steps (the first creates
    the optimizer's state: a later step starts with it, as every step of a run does)."""
    for _ in range(warmup):
        step(pm, args, opt)
    mem = LiveBytes()
    state = [v for s in opt.state.values() for v in s.values()]
    grads = [p.grad for p in pm.parameters() if p.grad is not None]
    with mem:
        mem.track([*pm.parameters(), *pm.buffers(), *grads, *state, *tree_leaves(args)])
        start = mem.live
        step(pm, args, opt, mem)
    return StepMemory(mem.peak, start, mem.peak_phase, dict(mem.phase_peaks))


__all__ = ["LiveBytes", "StepMemory", "measure_step", "training_step"]
