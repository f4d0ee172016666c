"""Pipeline stages of one rank: each stage program (``passes.split_stages``) as a module
holding its state, and the shapes of what stages send one another.

``torch.distributed.pipelining.PipelineStage`` needs each stage's inputs and outputs (shape,
dtype, whether they carry a gradient) before the first step, or it infers them by running
the first micro-batch once more. That extra run would draw random numbers, count a loss and
run collectives outside the step, so the shapes are found here instead: every stage
program runs once, in order, on fake tensors (``FakeTensorMode``: no data, no collective
runs) shaped as this rank's shards of the state and one micro-batch of the inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from autopar.passes.split_stages import StageProgram
from autopar.runtime.parameters import local_shard
from autopar.runtime.regather import regather_hooks


@dataclass(frozen=True, kw_only=True)
class ValueMeta:
    """What a stage receives or sends: one tensor's local shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    """It carries a gradient back (a float tensor computed from trainable parameters)."""

    def example(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device).requires_grad_(self.requires_grad)


class StageModule(nn.Module):
    """One stage program with its state bound: called with the values it receives (the
    first stage: the batch leaves of the user's inputs, the others set for the step by
    ``set_fixed``), returns what it sends (the last stage: the program's outputs)."""

    def __init__(self, program: StageProgram, state: list[torch.Tensor], slots: list[int | None] | None = None,
                 regathers: bool = False) -> None:
        super().__init__()
        self.index = program.index
        self.program = program.gm
        # the same Parameter objects the ParallelModule holds: PipelineStage reads them here
        self.weights = nn.ParameterList([t for t in state if isinstance(t, nn.Parameter)])
        self._state = state
        self._slots = slots  # first stage: position among its call's arguments of each input (None: fixed)
        self._fixed: list[Any] = []
        self._regathers = regathers
        self.sent_bytes: list[int] = []
        """Bytes of what each call returned (what ``PipelineStage`` sends on), cleared by the step."""

    def set_fixed(self, values: list[Any]) -> None:
        """The first stage's inputs that are not cut into micro-batches, in input order."""
        self._fixed = values

    def forward(self, *received: Any) -> Any:
        if self._slots is not None:
            fixed = iter(self._fixed)
            received = tuple(received[slot] if slot is not None else next(fixed) for slot in self._slots)
        with regather_hooks() if self._regathers else contextlib.nullcontext():
            out = self.program(*received, *self._state)
        # zero-bubble schedules detach a stage's outputs in place once their input gradients
        # are computed: a view (a slice of a buffer, a micro-batch of an input) or a received
        # value passed on cannot be, so those go out as copies (exact; gradients flow through).
        # A state tensor sent on (a buffer the stage bumps in place) goes out as a copy too: the
        # send runs beside the next micro-batch's forward, whose in-place update would change it.
        out = [t.clone() if isinstance(t, torch.Tensor) and (t._base is not None or any(t is r for r in received)
                                                          or any(t is s for s in self._state))
               else t for t in out]
        self.sent_bytes.append(sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor)))
        return out[0] if len(out) == 1 else tuple(out)


def stage_metas(programs: list[StageProgram], fake_state: dict[str, Callable[[], torch.Tensor]],
                inputs: list[ValueMeta], device: torch.device) -> list[tuple[list[ValueMeta], list[ValueMeta]]]:
    """Each stage's (received, sent) values, from one fake run of every stage in order.
    ``fake_state``: state placeholder -> a maker of its local shard (called in fake mode);
    ``inputs``: one micro-batch of the first stage's inputs (a program built for shapes only:
    its collectives' bookkeeping is left as the fake run leaves it)."""
    out: list[tuple[list[ValueMeta], list[ValueMeta]]] = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        received = [m.example(device) for m in inputs]
        for program in programs:
            state = [fake_state[name]() for name in program.state]
            sent = program.gm(*received, *state)
            sent = list(sent) if isinstance(sent, (tuple, list)) else [sent]
            bad = [name for name, v in zip(program.outputs, sent) if not isinstance(v, torch.Tensor)]
            if bad:
                raise RuntimeError(f"pipeline stage {program.index} would send {bad}, not tensors")
            out.append(([_meta(v) for v in received], [_meta(v) for v in sent]))
            received = [v.detach().requires_grad_(v.requires_grad) for v in sent]
    return out


def _meta(value: torch.Tensor) -> ValueMeta:
    return ValueMeta(shape=tuple(value.shape), dtype=value.dtype, requires_grad=value.requires_grad)


def fake_shard(shape: tuple[int, ...], dtype: torch.dtype, placements: Any, mesh: DeviceMesh,
               requires_grad: bool) -> Callable[[], torch.Tensor]:
    """A maker of a fake tensor shaped as this rank's shard of a ``shape`` tensor."""
    local = tuple(local_shard(torch.empty(shape, dtype=dtype, device="meta"), placements, mesh).shape)
    device = torch.device(mesh.device_type)
    return lambda: torch.empty(local, dtype=dtype, device=device).requires_grad_(requires_grad)
