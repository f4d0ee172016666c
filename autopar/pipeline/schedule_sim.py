"""A pipeline schedule played out in time: each pp rank's actions in the order torch 2.13
runs them, started as soon as their inputs are there.

Orders come from torch itself (``torch/distributed/pipelining/schedules.py``), each
schedule built on stand-in stages (no process group: the tables need only the stage count,
the pp size and each rank's number of stages):

- ScheduleGPipe, Schedule1F1B: the ``pipeline_order`` table ``PipelineScheduleSingle.__init__``
  fills from each class's ``_get_pipeline_order``. GPipe's is what
  ``ScheduleGPipe._step_microbatches`` runs: every forward, then every backward. 1F1B's numbers
  the last rank's forwards 1..m (its steady state counts up before its first forward); the
  runtime, ``Schedule1F1B._step_microbatches``, runs min(m, p - rank) forwards, then a backward
  and a forward at a time, then the backwards left, counting from 0: the table's sequence
  otherwise. Every torch schedule numbers a stage's forwards in the order it runs them, so
  forwards are renumbered so (a no-op for every other schedule and rank:
  tests/test_schedule_sim.py).
- ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ScheduleDualPipeV: the ``pipeline_order``
  their constructors fill from ``_calculate_single_rank_operations`` (the interleaved one via
  the module-level ``_get_1f1b_rank_ops``). ``_PipelineScheduleRuntime._step_microbatches``
  runs ``pipeline_order_with_comms``, the same compute actions in the same order with sends,
  receives and gradient reductions put between them (``_add_send_recv``); an OVERLAP_F_B
  action runs its forward, then its full backward (no custom function registered, as autopar
  registers none).

Action kinds are torch's letters: F forward, B full backward (input and weight gradients),
I input gradients only, W weight gradients only (Qi et al. 2024's B and W).

Timing: an action starts when its rank is free and its inputs are there: F of stage s after
F of stage s - 1 (same micro-batch); I or B after its own F and after the I or B of stage
s + 1; W after its own I. A value crossing to another rank arrives after a transfer that
starts when it is computed, the transfers from one rank to another running one at a time in
the order the sender computes them (they share a link, and torch issues them in that order
on one process group), beside the sender's compute (``isend``/``irecv``: the receiver waits,
the sender does not; the single-stage runtimes also wait for a send before their next
receive, not modeled: in 1F1B's steady state that receive comes later anyway). Two stages on
one rank hand values over without a transfer (torch's "V-schedule special case").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import NamedTuple

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"

Op = tuple[str, int, int]
"""(kind, stage, micro-batch): one compute action of a rank's order."""


class Action(NamedTuple):
    """One compute action placed in time."""

    rank: int
    stage: int
    micro_batch: int
    kind: str
    start_s: float
    end_s: float


class Transfer(NamedTuple):
    """A point-to-point send: an activation (after F) or an input gradient (after I or B)."""

    src: int
    dst: int
    stage: int
    """The stage that computed the value (sent to stage + 1 for F, stage - 1 for I/B)."""
    micro_batch: int
    kind: str
    start_s: float
    end_s: float


Placed = tuple[str, int, int, float, float]
"""(kind, stage, micro-batch, start, end): an action as the simulation records it."""


@dataclass(frozen=True)
class Simulation:
    """Each rank's actions in time, the transfers, and the figures the plan prices."""

    placed: list[list[Placed]]
    transfers: list[Transfer]
    busy_s: list[float]
    """Seconds each rank computes."""
    span_s: float
    """The last action's end: the pipeline's compute span."""

    @property
    def bubble_s(self) -> float:
        """span - the busiest rank's seconds: what idling adds to the step."""
        return self.span_s - max(self.busy_s, default=0.0)

    @property
    def actions(self) -> list[list[Action]]:
        """Each rank's actions, in the order it runs them."""
        return [[Action(r, s, i, kind, a, b) for kind, s, i, a, b in acts] for r, acts in enumerate(self.placed)]

    @property
    def windows_s(self) -> list[float]:
        """Each rank's seconds from its first action's start to its last one's end (the papers'
        per-stage execution time; the span also counts a rank's wait for its first input)."""
        return [acts[-1][4] - acts[0][3] if acts else 0.0 for acts in self.placed]


def split_backward(forward_s: float, backward_s: float, replay_s: float = 0.0, first: bool = False
                   ) -> tuple[float, float, float, float]:
    """(F, I, W, B) of a stage from its forward and whole backward, which replays its checkpointed blocks
    once (``replay_s`` of it): the plan does not price input and weight gradients apart, so each takes half
    of the rest (a matmul's two gradient products are each its forward's size; ops without weights make I
    the larger half, unpriced here), and each replays the blocks (``replays``). The first stage's I computes
    nothing (torch skips it: it sends no input gradient) and its W the whole backward."""
    if first:
        return forward_s, 0.0, backward_s, backward_s
    rest = (backward_s - replay_s) / 2
    return forward_s, rest + replay_s, rest + replay_s, backward_s


@lru_cache(maxsize=64)
def replays(schedule: str, p: int, v: int, m: int) -> tuple[int, ...]:
    """Per stage, how many times a step replays its checkpointed blocks: once in each whole backward (B)
    and each weight pass (W), and in each input pass (I) but the first stage's; under a split backward torch
    computes I and W in calls of their own, a checkpoint recomputing in each (the weight pass's calls, one
    per group of parameters, share one recompute: ``runtime.stages``)."""
    counts = [0] * (p * v)
    for ops in torch_order(schedule, p, v, m):
        for kind, stage, _ in ops:
            counts[stage] += kind in (BACKWARD, WEIGHT_GRAD) or (kind == INPUT_GRAD and stage > 0)
    return tuple(counts)


@lru_cache(maxsize=64)
def torch_order(schedule: str, p: int, v: int, m: int) -> tuple[tuple[Op, ...], ...]:
    """Each pp rank's compute actions in the order torch runs them (module docstring)."""
    from torch.distributed.pipelining import schedules as ts  # lazy: planning without a pipeline never needs it

    stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=k, submod=None)
              for k in range(v)]
    classes = {"gpipe": ts.ScheduleGPipe, "1f1b": ts.Schedule1F1B, "interleaved_1f1b": ts.ScheduleInterleaved1F1B,
               "zbv": ts.ScheduleZBVZeroBubble, "dualpipev": ts.ScheduleDualPipeV}
    cls = classes[schedule]
    built = cls(stages[0], m) if schedule in ("gpipe", "1f1b") else _orders_only(cls)(stages, m)
    return tuple(_renumbered(_compute_ops(built.pipeline_order[r])) for r in range(p))


def _orders_only(cls: type) -> type:
    """``cls``, a schedule whose constructor fills ``pipeline_order`` and then lowers it to
    ``pipeline_order_with_comms`` (``_PipelineScheduleRuntime._prepare_schedule_with_comms``), with
    that lowering left at torch's check of the order: the lowering adds communication actions only
    (the compute actions keep their order, what the simulation reads), and its FSDP unshard pass is
    quadratic in the schedule's length, nearly all of the constructor's time at large p and m."""
    def validated(self: object, actions: dict, format: str = "compute_only") -> None:
        self._validate_and_set_stage_mapping(actions)  # type: ignore[attr-defined]
    return type(f"_OrdersOnly{cls.__name__}", (cls,), {"_prepare_schedule_with_comms": validated})


def _compute_ops(table: list) -> list[Op]:
    """The compute actions of one rank's torch table, an OVERLAP_F_B opened into its two."""
    ops: list[Op] = []
    for action in table:
        if action is None:  # an idle slot in the table: the simulation finds the real waits
            continue
        for a in action.sub_actions or (action,):
            kind = a.computation_type.value
            if kind in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD):
                ops.append((kind, a.stage_index, a.microbatch_index))
    return ops


def _renumbered(ops: list[Op]) -> tuple[Op, ...]:
    """Forwards numbered in the order a stage runs them (1F1B's table miscounts its last rank)."""
    seen: dict[int, int] = {}
    out = []
    for kind, stage, mb in ops:
        if kind == FORWARD:
            mb = seen[stage] = seen.get(stage, -1) + 1
        out.append((kind, stage, mb))
    return tuple(out)


class _Program(NamedTuple):
    """A schedule's orders with each action's inputs and outputs resolved to slots of one
    time array: four blocks of count * m slots, (stage, micro-batch) each: its F done, its F's
    output arrived at the next stage, its I or B done, the gradient of its output arrived."""

    ops: tuple[tuple[tuple[str, int, int, tuple[int, ...], int, int, int], ...], ...]
    """Per rank: (kind, stage, micro-batch, input slots, seconds index, own slot, sent slot)."""
    rank_of: tuple[int, ...]


_KIND_INDEX = {FORWARD: 0, INPUT_GRAD: 1, WEIGHT_GRAD: 2, BACKWARD: 3}
"""Where a kind's seconds start in the flat list ``simulate`` builds (kind index x stages + stage)."""


@lru_cache(maxsize=64)
def _program(schedule: str, p: int, v: int, m: int) -> _Program:
    """``torch_order`` resolved to slots, once per schedule, p, v and m."""
    order = torch_order(schedule, p, v, m)
    count, n = p * v, p * v * m
    rank_of = [-1] * count
    for r, ops in enumerate(order):
        for _, s, _ in ops:
            rank_of[s] = r
    _check_complete(schedule, order, count, m)
    program = []
    for ops in order:
        resolved = []
        for kind, s, i in ops:
            k = s * m + i
            if kind == FORWARD:  # needs the previous stage's output; sends its own on
                deps, own, sent = ((n + k - m,) if s else ()), k, (n + k if s < count - 1 else -1)
            elif kind == WEIGHT_GRAD:  # needs its own I; nothing waits on it
                deps, own, sent = (2 * n + k,), -1, -1
            else:  # needs its own F and the gradient of its output; sends its input's gradient back
                deps = (k, 3 * n + k) if s < count - 1 else (k,)
                own, sent = 2 * n + k, (3 * n + k - m if s else -1)
            resolved.append((kind, s, i, deps, _KIND_INDEX[kind] * count + s, own, sent))
        program.append(tuple(resolved))
    return _Program(tuple(program), tuple(rank_of))


def _check_complete(schedule: str, order: tuple[tuple[Op, ...], ...], count: int, m: int) -> None:
    """Every stage runs each micro-batch's forward once, its input gradients once (I or B) and
    its weight gradients once after an I: what the simulation's slots assume."""
    ran = Counter(op for ops in order for op in ops)
    wrong = [op for op in ran if not (0 <= op[1] < count and 0 <= op[2] < m)]
    for s in range(count):
        for i in range(m):
            inputs = ran[(INPUT_GRAD, s, i)] + ran[(BACKWARD, s, i)]
            if ran[(FORWARD, s, i)] != 1 or inputs != 1 or ran[(WEIGHT_GRAD, s, i)] != ran[(INPUT_GRAD, s, i)]:
                wrong.append((FORWARD, s, i))
    if wrong:
        raise RuntimeError(f"torch's {schedule} order does not run each stage's {m} micro-batches once: {wrong[:4]}")


class _Run:
    """One simulation in progress: the slots' times, each rank's position and clock, the links."""

    def __init__(self, program: _Program, m: int, seconds: list[float], cut_s: list[float]) -> None:
        self.program, self.m, self.seconds, self.cut_s = program, m, seconds, cut_s
        p = len(program.ops)
        self.time = [-1.0] * (4 * len(program.rank_of) * m)  # -1: not there yet
        self.waiting: dict[int, int] = {}  # slot -> the rank blocked on it
        self.link = [0.0] * (p * p)  # when the link from rank a to rank b is free: a * p + b
        self.free = [0.0] * p
        self.busy = [0.0] * p
        self.placed: list[list[Placed]] = [[] for _ in range(p)]
        self.transfers: list[Transfer] = []

    def advance(self, r: int) -> list[int]:
        """Run rank r's actions until one waits on a value not there yet; the ranks it woke."""
        ops, placed, time, waiting, seconds = self.program.ops[r], self.placed[r], self.time, self.waiting, self.seconds
        now, woken = self.free[r], []
        for kind, s, i, deps, d, own, sent in ops[len(placed):]:
            start = now
            for slot in deps:
                if time[slot] < 0:
                    waiting[slot] = r
                    self.free[r] = now
                    return woken
                start = max(start, time[slot])
            now = start + seconds[d]
            self.busy[r] += seconds[d]
            placed.append((kind, s, i, start, now))
            if own >= 0:
                time[own] = now
                if own in waiting:
                    woken.append(waiting.pop(own))
            if sent >= 0:
                time[sent] = self._send(kind, s, i, now)
                if sent in waiting:
                    woken.append(waiting.pop(sent))
        self.free[r] = now
        return woken

    def _send(self, kind: str, s: int, i: int, end: float) -> float:
        """When the value stage s computed at ``end`` reaches the next stage (F) or the previous
        one (I, B): at once on the same rank, else after a transfer queued on that link."""
        to = s + 1 if kind == FORWARD else s - 1
        seconds = self.cut_s[min(s, to)]
        if seconds <= 0:
            return end
        src, dst = self.program.rank_of[s], self.program.rank_of[to]
        link = src * len(self.program.ops) + dst
        start = max(end, self.link[link])
        self.link[link] = start + seconds
        self.transfers.append(Transfer(src, dst, s, i, kind, start, start + seconds))
        return start + seconds


def simulate(schedule: str, p: int, v: int, m: int, stage_s: Sequence[tuple[float, ...]],
             rank_of: Sequence[int], send_s: Sequence[float] = ()) -> Simulation:
    """Play the schedule out. ``stage_s``: each stage's (F, I, W) seconds of one micro-batch, and its whole
    backward's B where that is not I + W (``split_backward``); ``rank_of``: each stage's pp rank
    (``Pipeline.stage_rank``, checked against torch's tables); ``send_s``: seconds of one transfer across
    each cut (after stage s; activations forward and gradients back alike), missing ones 0."""
    program = _program(schedule, p, v, m)
    if tuple(rank_of) != program.rank_of:
        raise ValueError(f"{schedule} runs stages on pp ranks {list(program.rank_of)}, not {list(rank_of)}")
    count = p * v
    seconds = [t[0] for t in stage_s] + [t[1] for t in stage_s] + [t[2] for t in stage_s] + \
        [t[3] if len(t) > 3 else t[1] + t[2] for t in stage_s]
    cut_s = [float(send_s[s]) if s < len(send_s) and s + 1 < count and rank_of[s] != rank_of[s + 1] else 0.0
             for s in range(count)]
    run = _Run(program, m, seconds, cut_s)
    todo = list(range(p))
    while todo:  # a rank runs until it waits; the rank whose action fills that wait runs it again
        todo.extend(run.advance(todo.pop()))
    if any(len(done) < len(ops) for done, ops in zip(run.placed, program.ops)):
        raise RuntimeError(f"{schedule} order deadlocks (p={p}, v={v}, m={m}): no rank can run its next action")
    return Simulation(run.placed, run.transfers, run.busy, max(run.free))
