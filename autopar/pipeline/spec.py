"""A pinned pipeline: the options a user names (``Pipeline``), the rules each
``torch.distributed.pipelining`` schedule sets on them, where its stages live, and the time
each schedule's order takes.

The pipeline is priced by playing torch's own order out (``pipeline.schedule_sim``: the orders
of ``torch/distributed/pipelining/schedules.py``, ``_get_pipeline_order`` of ScheduleGPipe and
Schedule1F1B, ``_calculate_single_rank_operations`` of ScheduleInterleaved1F1B,
ScheduleZBVZeroBubble and ScheduleDualPipeV), with each stage's predicted forward and
backward seconds of one micro-batch, the backward split into input gradients (I) and weight
gradients (W) half and half for the schedules that run them apart. The bubble is the span
less the busiest rank's compute. What the simulation gives with p ranks, m micro-batches,
stages alike and no transfers (tests/test_schedule_sim.py):

- GPipe and 1F1B: ``(m + p - 1) (F + B)`` exactly, a bubble share of ``(p - 1) / (m + p - 1)``,
  the fill and drain of Huang et al. 2019 (GPipe) and Narayanan et al. 2021 (arXiv 2104.04473
  §2.2.1: bubble time / ideal time = (p - 1) / m).
- Interleaved 1F1B, ``v`` stages per rank: ``(m + (p - 1) / v) v (F + B)`` exactly whenever
  m >= p (multiples of p or not), Narayanan et al. §2.2.2's (1 / v)(p - 1) / m; with m < p the
  bubble is larger (p=4, v=2: 4 stage-(F + B)s for m=3, 5 for m=2, against 3).
- ZB-V (two stages per rank in a V): with F = I = W no rank idles between its first action and
  its last, the "zero bubble" Qi et al. 2024 (arXiv 2401.10241 §6) and the docstring of torch's
  ScheduleZBVZeroBubble claim for those times, but the last rank waits p - 1 forwards for its
  first input: the span's bubble is ``(p - 1) F``. With F = 2I = 2W it is (3p - 4) I, with
  I = 2F = 2W (p - 1) I. The formula priced before,
  ``(p - 1)(F + B - 2W)`` (DeepSeek-V3's Table 2 row for ZB1P, arXiv 2412.19437) with B = W,
  gave 0 for F = I = W and (p - 1) I for F = 2I = 2W: it undercounted.
- DualPipeV as torch runs it (an OVERLAP_F_B action runs its forward, then its full backward:
  DeepSeek's overlap of the two needs a custom function, which autopar does not register):
  ``(p - 1) F`` with F = I = W and with F = 2I = 2W, (3p - 4) F with I = 2F = 2W. DeepSeek-V3's
  DualPipe row, (PP / 2 - 1)(F&B + B - 3W), prices an overlapped F&B and is not used.

Uneven stages and transfers between ranks (each a delay before the receiving action, the
transfers from one rank to another one after another) are played out the same way
(``pipeline.stages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopar.errors import InputError, InputTypeError
from autopar.mesh import Mesh
from autopar.pipeline.schedule_sim import Simulation, simulate, split_backward

STAGE_AXIS = "stage"
"""The one axis, of size 1, of a stage mesh when the whole mesh is the pipeline axis."""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
"""Schedules a pipeline runs (``torch.distributed.pipelining``'s ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ScheduleDualPipeV)."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules placing rank r's two stages at r and 2p - 1 - r (a V), else stage s on rank s mod p."""
SPLIT_BACKWARD = ("zbv", "dualpipev")
"""The schedules whose torch orders run input and weight gradients apart (I and W actions) at every
count (``schedule_sim.torch_order``: test_pipeline_search checks it)."""

_VIRTUAL = {"gpipe": (1, 1), "1f1b": (1, 1), "interleaved_1f1b": (2, 1 << 30), "zbv": (2, 2), "dualpipev": (2, 2)}
"""Stages per rank each schedule runs (lowest, highest)."""
VIRTUAL_CHOICES = {"gpipe": (1,), "1f1b": (1,), "interleaved_1f1b": (2, 4), "zbv": (2,), "dualpipev": (2,)}
"""Stages per rank the planner tries per schedule when ``virtual_stages`` is open (Megatron-LM's
interleaved runs use 2-4 chunks per rank; more halve the bubble again but double the transfers)."""
MICRO_BATCH_CHOICES = (1, 2, 4, 8)
"""Micro-batch counts the planner tries when ``micro_batches`` is open, as multiples of the stage
ranks p: at m = p the 1F1B bubble is (p - 1) / (2p - 1), near half; at 8p it is under 1/9
(GPipe §2.3: m >= 4p makes it negligible). Besides these, the finest count: one row per rank of
the data split (Megatron-LM's micro-batch size 1, which needs no checkpointing where coarser
counts do: Llama-3-70B on 512 H100s, pp=8, m=16p; ``benchmarks/hand_plan_grid.py``). Each
count is priced, and solved where ``search.pipeline`` says."""


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """A pipeline on one mesh axis: the schedule, micro-batches and stages per rank, each
    pinned or (None) chosen by the planner (``search.pipeline``); the cuts are always
    the planner's."""

    axis: str = "pp"
    """Mesh axis the stages are laid along; the other axes form each stage's sub-mesh."""
    schedule: str | None = None
    """One of ``SCHEDULES``; None: the planner picks the fastest that fits."""
    micro_batches: int | None = None
    """Micro-batches per step; the stages are planned for batch / micro_batches rows. None:
    the planner picks among ``MICRO_BATCH_CHOICES`` multiples of the stage count."""
    virtual_stages: int | None = None
    """Stages per rank: 1 for gpipe and 1f1b, at least 2 for interleaved_1f1b, 2 for zbv and
    dualpipev. None: the schedule's (interleaved_1f1b: the planner picks 2 or 4)."""
    from_axis: str | None = None
    """A mesh axis (the first) to take the pipeline axis out of, its size then the planner's
    choice (``search.depth``): ``axis`` is not in the mesh; each divisor k of this axis's size
    is tried as k pp ranks, the axis keeping size / k, and k = 1 as no pipeline at all (a
    mesh {"dp": 128, "tp": 8} may become {"pp": 16, "dp": 8, "tp": 8}). None: ``axis`` is an
    axis of the mesh, its size the pp ranks."""
    stage_blocks: tuple[tuple[str, ...], ...] | None = None
    """The units each stage runs, in order (``pipeline.stages.block_units``: '(head)', the repeated
    blocks such as 'layers.0', '(tail)'), pinned: every unit once, in program order. None: the
    planner's balanced cuts. ``compile_serving`` pins a prefill step's cuts to its decode step's
    so that both programs hold the same layers (and KV caches) on each stage."""

    @property
    def pinned(self) -> bool:
        """Whether every choice is made (what the runtime and the stage cuts need)."""
        return self.from_axis is None and None not in (self.schedule, self.micro_batches, self.virtual_stages)

    def depths(self, mesh_axes: dict[str, int]) -> list[int]:
        """The pp ranks the planner tries when the pipeline axis is taken ``from_axis``: every
        divisor of that axis's size, 1 (no pipeline) first."""
        assert self.from_axis is not None
        n = mesh_axes[self.from_axis]
        return [k for k in range(1, n + 1) if n % k == 0]

    def carved(self, mesh_axes: dict[str, int], depth: int) -> dict[str, int]:
        """The mesh's axes with ``depth`` pp ranks taken out of ``from_axis`` (outermost: a pp
        rank's stage mesh is a contiguous block of ranks, as when the user names the axes)."""
        assert self.from_axis is not None and mesh_axes[self.from_axis] % depth == 0
        rest = {name: size // depth if name == self.from_axis else size for name, size in mesh_axes.items()}
        return {self.axis: depth, **rest}

    def check(self, mesh_axes: dict[str, int]) -> None:
        """Refuse what no schedule of torch's runs (checked before capture); a choice left to
        the planner is checked once made (``choices``)."""
        if self.from_axis is not None:
            self._check_from(mesh_axes)
            mesh_axes = self.carved(mesh_axes, mesh_axes[self.from_axis])  # the deepest: every axis named
        if not isinstance(self.axis, str) or self.axis not in mesh_axes:
            raise InputError(f"pipeline axis {self.axis!r} is not an axis of the mesh {dict(mesh_axes)}")
        if next(iter(mesh_axes)) != self.axis:  # the stage meshes' links are then those of the whole mesh
            raise InputError(f"pipeline axis {self.axis!r} must be the mesh's first (outermost) axis, as in "
                             f"Megatron-LM and torchtitan; the mesh's axes are {tuple(mesh_axes)}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise InputError(f"pipeline schedule {self.schedule!r}: the schedules are {', '.join(SCHEDULES)}")
        for name, value in (("micro_batches", self.micro_batches), ("virtual_stages", self.virtual_stages)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"pipeline {name} must be a positive whole number (or None: the planner "
                                 f"chooses), got {value!r}")
        p = mesh_axes[self.axis]
        if p < 2:
            raise InputError(f"pipeline axis {self.axis!r} has {p} device: a pipeline needs at least 2 stages ranks")
        if self.schedule is not None and self.virtual_stages is not None:
            self._check_virtual(self.schedule, self.virtual_stages)
        if self.pinned:
            self.check_counts(p)

    def _check_from(self, mesh_axes: dict[str, int]) -> None:
        if not isinstance(self.from_axis, str) or self.from_axis not in mesh_axes:
            raise InputError(f"pipeline from_axis {self.from_axis!r} is not an axis of the mesh {dict(mesh_axes)}")
        if next(iter(mesh_axes)) != self.from_axis:  # the pp axis then goes first, as ``check`` wants it
            raise InputError(f"pipeline from_axis {self.from_axis!r} must be the mesh's first (outermost) axis; the "
                             f"mesh's axes are {tuple(mesh_axes)}")
        if self.axis in mesh_axes:
            raise InputError(f"pipeline axis {self.axis!r} is already an axis of the mesh {dict(mesh_axes)}: with "
                             f"from_axis the planner makes it, taking its size out of {self.from_axis!r}")
        if mesh_axes[self.from_axis] < 2:
            raise InputError(f"pipeline from_axis {self.from_axis!r} has 1 device: no pipeline can be taken out of it")

    @staticmethod
    def _check_virtual(schedule: str, v: int) -> None:
        low, high = _VIRTUAL[schedule]
        if not low <= v <= high:
            wanted = f"= {low}" if low == high else f">= {low}"
            raise InputError(f"pipeline schedule {schedule!r} runs virtual_stages {wanted} "
                             f"(stages per rank), got {v}")

    def check_counts(self, p: int) -> None:
        """The micro-batch counts each torch schedule accepts (its constructor's checks), on a
        pinned pipeline of ``p`` ranks."""
        assert self.pinned
        m, v = self.micro_batches, self.virtual_stages
        assert m is not None and v is not None
        if self.schedule == "1f1b" and m < p:
            raise InputError(f"pipeline schedule '1f1b' needs micro_batches >= stages ({p}), got {m}")
        if self.schedule == "interleaved_1f1b":
            rounds = max(1, m // p)
            if m % rounds:
                raise InputError(f"pipeline schedule 'interleaved_1f1b' runs micro-batches in rounds of {p} "
                                 f"(the pp size): micro_batches must be a multiple of {rounds}, got {m}")
        if self.schedule == "dualpipev" and m < p * v:
            raise InputError(f"pipeline schedule 'dualpipev' needs micro_batches >= stages ({p * v}), got {m}")

    def stage_mesh(self, mesh: Mesh) -> Mesh:
        """The mesh each stage is planned on: ``mesh`` without the pipeline axis (one axis of
        size 1, ``STAGE_AXIS``, when nothing else is left)."""
        rest = {name: size for name, size in mesh.axes.items() if name != self.axis}
        return Mesh(rest or {STAGE_AXIS: 1}, mesh.hardware, mesh.devices_per_node)

    def choices(self, p: int, batch: int | None, blocks: int, batch_ways: int = 1, finest_ways: int = 1
                ) -> list[Pipeline]:
        """The pinned pipelines the planner prices: each choice left open ranges over the
        schedules, their stages per rank (``VIRTUAL_CHOICES``, at most one block per stage)
        and ``MICRO_BATCH_CHOICES`` x p micro-batches dividing ``batch`` into micro-batches
        that split ``batch_ways`` ways (the data axes'), and the finest count, micro-batches of
        ``max(batch_ways, finest_ways)`` rows (one per rank of the data split); those torch
        refuses are left out. Empty when nothing runs (``search.pipeline.search_pipeline`` says why)."""
        if self.micro_batches is None and batch is None:
            raise InputError("the planner chooses a pipeline's micro-batches among divisors of the batch, but the "
                             "step's inputs have no batch dim it can read: pin Pipeline(micro_batches=...)")
        out = []
        for schedule in [self.schedule] if self.schedule else SCHEDULES:
            for v in [self.virtual_stages] if self.virtual_stages else VIRTUAL_CHOICES[schedule]:
                low, high = _VIRTUAL[schedule]
                if not low <= v <= high or p * v > blocks:
                    continue
                counts = [self.micro_batches] if self.micro_batches else _counts(p, batch, batch_ways, finest_ways)
                for m in counts:
                    choice = Pipeline(axis=self.axis, schedule=schedule, micro_batches=m, virtual_stages=v,
                                      stage_blocks=self.stage_blocks)
                    try:
                        choice.check_counts(p)
                    except InputError:
                        continue
                    out.append(choice)
        return out

    def stages(self, pp_size: int) -> int:
        return pp_size * self.virtual_stages

    def stage_rank(self, stage: int, pp_size: int) -> int:
        """The pp rank holding ``stage`` (torch's ``generate_stage_to_rank_mapping``)."""
        if self.schedule in V_SHAPED:
            return stage if stage < pp_size else 2 * pp_size - 1 - stage
        return stage % pp_size

    @property
    def splits_backward(self) -> bool:
        """Whether torch's schedule runs a stage's backward as two calls, input then weight gradients
        (``SPLIT_BACKWARD``): each backward op whose inputs lead to both runs in each, reading what it saved
        twice (a checkpointed block replays in each: ``schedule_sim.replays``), and torch's weight pass is one
        autograd call per group of parameters sharing an input."""
        return self.schedule in SPLIT_BACKWARD


def _counts(p: int, batch: int | None, batch_ways: int, finest_ways: int) -> list[int]:
    """Micro-batch counts of ``Pipeline.choices``: ``MICRO_BATCH_CHOICES`` x p, then the finest."""
    if batch is None:
        return []
    counts = [k * p for k in MICRO_BATCH_CHOICES if batch % (k * p * batch_ways) == 0]
    rows = max(batch_ways, finest_ways)
    finest = batch // rows
    if batch % rows == 0 and rows % batch_ways == 0 and finest >= p and finest not in counts:
        counts.append(finest)
    return counts


def as_pipeline(pipeline: object) -> Pipeline:
    """``pipeline=`` as given to ``plan``/``compile``: a ``Pipeline``, its stages per rank filled
    in where the schedule runs one number of them (gpipe and 1f1b 1, zbv and dualpipev 2), so
    that naming the schedule and micro-batches pins a pipeline as before ``virtual_stages`` was open."""
    if not isinstance(pipeline, Pipeline):
        raise InputTypeError(f"pipeline must be an autopar.Pipeline(axis=..., schedule=..., micro_batches=..., "
                             f"virtual_stages=...), got {type(pipeline).__name__}")
    if pipeline.virtual_stages is None and pipeline.schedule in _VIRTUAL:
        low, high = _VIRTUAL[pipeline.schedule]
        if low == high:
            return replace(pipeline, virtual_stages=low)
    return pipeline


def simulate_pipeline(schedule: str, pp_size: int, virtual_stages: int, micro_batches: int,
                      stage_s: Sequence[tuple[float, ...]], send_s: Sequence[float] = ()) -> Simulation:
    """``schedule_sim.simulate`` of the stages' (forward, backward[, replay]) seconds of one micro-batch (their
    waited collectives included; the backward replaying the stage's checkpointed blocks once, ``replay``
    of it, 0 when not given), backward halved into I and W, each replaying the blocks (``schedule_sim.split_backward``),
    stages placed as ``Pipeline.stage_rank`` places them; ``send_s``: one transfer's seconds across each cut."""
    where = Pipeline(schedule=schedule, virtual_stages=virtual_stages)
    rank_of = [where.stage_rank(s, pp_size) for s in range(pp_size * virtual_stages)]
    split = [split_backward(t[0], t[1], t[2] if len(t) > 2 else 0.0, first=s == 0) for s, t in enumerate(stage_s)]
    return simulate(schedule, pp_size, virtual_stages, micro_batches, split, rank_of, send_s)
