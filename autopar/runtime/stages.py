"""Pipeline stages of one rank: each stage program (``passes.split_stages``) as a module
holding its state, and the shapes of what stages send one another.

Every rank is handed the step's whole inputs, so a stage reads the user inputs it needs (the
first stage the tokens, the last the targets its loss reads) from the micro-batch it runs,
cut as the step cuts them (``StageModule.set_inputs``), rather than receive them from the stage
before: torch tells a stage which micro-batch it runs in ``forward_one_chunk`` only, which
``MicroBatchStage`` passes on to its module. What stages send one another is then only what
they compute.

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
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import GraphExecGroup

from autopar.passes.split_stages import StageProgram
from autopar.runtime.parameters import local_shard
from autopar.runtime.regather import regather_hooks
from autopar.runtime.stream import CounterStream


@dataclass(frozen=True, kw_only=True)
class ValueMeta:
    """What a stage receives or sends: one tensor's local shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    """It carries a gradient back (a float tensor computed from trainable parameters)."""

    def example(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device).requires_grad_(self.requires_grad)


@dataclass
class StepDraws:
    """Where a rank's stages' random draws fall in the step's counter stream: one device running the
    step micro-batch after micro-batch draws ``per_micro_batch`` a micro-batch, the stages' in order, so
    a stage's draws of micro-batch j are numbered from ``base + j * per_micro_batch + before`` (``before``:
    the draws of the stages ahead of it; ``base``: the stream's draws when the step began), whichever
    order the schedule runs micro-batches and stages in (``runtime.stream``); after the step the stream
    stands where one device's would."""

    stream: CounterStream
    per_micro_batch: int
    base: int = 0
    micro_batches: int = 0

    def begin(self, micro_batches: int) -> None:
        if not self.micro_batches:  # each of the rank's stages is handed the step: the first begins it
            self.base, self.micro_batches = self.stream.draws, micro_batches

    def start(self, chunk: int, before: int) -> None:
        self.stream.set_state((self.stream.seed, self.base + chunk * self.per_micro_batch + before))

    def end(self) -> None:
        if self.micro_batches:
            self.stream.set_state((self.stream.seed, self.base + self.micro_batches * self.per_micro_batch))
            self.micro_batches = 0


class StageModule(nn.Module):
    """One stage program with its state bound: called with the values it receives from the stage
    before (none for the first), reads the user inputs of the micro-batch it runs (``set_inputs``
    for the step, ``at_chunk`` for each micro-batch), returns what it sends (the last stage: the
    program's outputs)."""

    def __init__(self, program: StageProgram, state: list[torch.Tensor], slots: list[int],
                 regathers: bool = False, draws: tuple[StepDraws, int] | None = None) -> None:
        super().__init__()
        self.index = program.index
        self.program = program.gm
        # the same Parameter objects the ParallelModule holds: PipelineStage reads them here
        self.weights = nn.ParameterList([t for t in state if isinstance(t, nn.Parameter)])
        self._state = state
        self._slots = slots  # per user input the program reads, its index among the step's leaves
        self._micro: list[list[Any]] = []
        self._chunk = 0
        self._regathers = regathers
        self._draws = draws
        self.sent_bytes: list[int] = []
        """Bytes of what each call returned (what ``PipelineStage`` sends on), cleared by the step."""

    def set_inputs(self, micro: list[list[Any]]) -> None:
        """The step's user inputs: per micro-batch, its leaves (``StepSignature.split``)."""
        self._micro = micro
        if self._draws is not None and micro:
            self._draws[0].begin(len(micro))
        elif self._draws is not None:
            self._draws[0].end()

    def at_chunk(self, chunk: int) -> None:
        """The micro-batch the next call runs (``MicroBatchStage``)."""
        self._chunk = chunk

    def forward(self, *received: Any) -> Any:
        fed = tuple(self._micro[self._chunk][k] for k in self._slots)
        if self._draws is not None:
            self._draws[0].start(self._chunk, self._draws[1])
        with regather_hooks() if self._regathers else contextlib.nullcontext():
            out = self.program(*received, *fed, *self._state)
        # zero-bubble schedules detach a stage's outputs in place once their input gradients
        # are computed: a view (a slice of a buffer, a micro-batch of an input) or a value it
        # was called with passed on cannot be, so those go out as copies (exact; gradients flow
        # through). A state tensor sent on (a buffer the stage bumps in place) goes out as a copy
        # too: the send runs beside the next micro-batch's forward, whose in-place update would
        # change it.
        given = (*received, *fed, *self._state)
        out = [t.clone() if isinstance(t, torch.Tensor) and (t._base is not None or any(t is g for g in given))
               else t for t in out]
        self.sent_bytes.append(sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor)))
        return out[0] if len(out) == 1 else tuple(out)


class MicroBatchStage(PipelineStage):
    """A ``PipelineStage`` telling its ``StageModule`` which micro-batch each forward runs, so the
    stage reads that micro-batch's user inputs itself rather than receive them from the stage
    before (torch hands the micro-batch index to ``forward_one_chunk`` only). ``after_backward``
    runs after each of its backward calls (input, weight or whole): under a split backward the
    gradient groups are checked then (``runtime.grouped.check_grad_groups``). A weight pass runs under
    one ``GraphExecGroup``, so a checkpointed block replays once in it, as priced
    (``pipeline.schedule_sim.replays``)."""

    def __init__(self, *args: Any, after_backward: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.after_backward = after_backward

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self.after_backward()
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
        # torch's weight pass is one autograd.grad per group of parameters sharing an input; under one
        # GraphExecGroup a checkpointed block recomputes once for all of them, not once per group
        with GraphExecGroup():
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self.after_backward()
        return out

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        self.submod.at_chunk(fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)


def stage_metas(programs: list[StageProgram], fake_state: dict[str, Callable[[], torch.Tensor]],
                inputs: dict[str, ValueMeta], device: torch.device, drawn: Callable[[], int]
                ) -> tuple[list[tuple[list[ValueMeta], list[ValueMeta]]], list[int]]:
    """Each stage's (received, sent) values, and its random draws of one micro-batch (``drawn``: the
    draws the programs' stream has taken), from one fake run of every stage in order.
    ``fake_state``: state placeholder -> a maker of its local shard (called in fake mode);
    ``inputs``: user input -> one micro-batch of it (a program built for shapes only: its
    collectives' bookkeeping is left as the fake run leaves it)."""
    out: list[tuple[list[ValueMeta], list[ValueMeta]]] = []
    draws: list[int] = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        received: list[torch.Tensor] = []
        for program in programs:
            fed = [inputs[name].example(device) for name in program.user_inputs]
            state = [fake_state[name]() for name in program.state]
            before = drawn()
            sent = program.gm(*received, *fed, *state)
            draws.append(drawn() - before)
            sent = list(sent) if isinstance(sent, (tuple, list)) else [sent]
            bad = [name for name, v in zip(program.outputs, sent) if not isinstance(v, torch.Tensor)]
            if bad:
                raise RuntimeError(f"pipeline stage {program.index} would send {bad}, not tensors")
            out.append(([_meta(v) for v in received], [_meta(v) for v in sent]))
            received = [v.detach().requires_grad_(v.requires_grad) for v in sent]
    return out, draws


def _meta(value: torch.Tensor) -> ValueMeta:
    return ValueMeta(shape=tuple(value.shape), dtype=value.dtype, requires_grad=value.requires_grad)


def fake_shard(shape: tuple[int, ...], dtype: torch.dtype, placements: Any, mesh: DeviceMesh,
               requires_grad: bool) -> Callable[[], torch.Tensor]:
    """A maker of a fake tensor shaped as this rank's shard of a ``shape`` tensor."""
    local = tuple(local_shard(torch.empty(shape, dtype=dtype, device="meta"), placements, mesh).shape)
    device = torch.device(mesh.device_type)
    return lambda: torch.empty(local, dtype=dtype, device=device).requires_grad_(requires_grad)
