"""A pinned pipeline: the options a user names (``Pipeline``), the rules each
``torch.distributed.pipelining`` schedule sets on them, where its stages live, and the
bubble each schedule pays.

Bubble formulas (time a rank idles per step, beside ``m`` micro-batches of its own work):

- GPipe and 1F1B, one stage per rank: the step takes ``(m + p - 1)`` times the slowest
  stage's forward+backward seconds of one micro-batch, so the bubble's share of the step is
  ``(p - 1) / (m + p - 1)`` (Huang et al. 2019, GPipe §2.3; Narayanan et al. 2021,
  arXiv 2104.04473 §2.2.1: bubble time / ideal time = (p - 1) / m).
- Interleaved 1F1B, ``v`` stages per rank: the fill and drain shrink ``v``-fold, the step
  takes ``(m + (p - 1) / v)`` times the slowest rank's seconds per micro-batch, a share of
  ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021 §2.2.2: bubble time fraction
  (1 / v)(p - 1) / m).
- ZB-V and DualPipeV (two stages per rank in a V): backward split into B (input gradients)
  and W (weight gradients), W filling the bubbles. We price the bubble as the ZB1P row of
  DeepSeek-V3's Table 2 (arXiv 2412.19437): ``(p - 1)(F + B - 2W)`` with F, B, W one
  stage's seconds per micro-batch (the slowest stage's), taking B = W = half the predicted
  backward seconds (the plan does not price them apart). With T_F = T_B = T_W this is 0,
  what Qi et al. 2024 (arXiv 2401.10241, §6, ZB-V) report for ZB-V under those times; we
  keep the (p - 1)(F + B - 2W) form as an upper estimate when forward is the slower part.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InputError, InputTypeError
from autopar.mesh import Mesh

STAGE_AXIS = "stage"
"""The one axis, of size 1, of a stage mesh when the whole mesh is the pipeline axis."""
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
"""Schedules a pipeline runs (``torch.distributed.pipelining``'s ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, ScheduleDualPipeV)."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules placing rank r's two stages at r and 2p - 1 - r (a V), else stage s on rank s mod p."""

_VIRTUAL = {"gpipe": (1, 1), "1f1b": (1, 1), "interleaved_1f1b": (2, 1 << 30), "zbv": (2, 2), "dualpipev": (2, 2)}
"""Stages per rank each schedule runs (lowest, highest)."""


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """A pinned pipeline: the mesh axis whose ranks hold consecutive stages, the schedule,
    micro-batches and stages per rank; the cuts are balanced by the planner."""

    axis: str = "pp"
    """Mesh axis the stages are laid along; the other axes form each stage's sub-mesh."""
    schedule: str = "1f1b"
    """One of ``SCHEDULES``."""
    micro_batches: int = 4
    """Micro-batches per step; the stages are planned for batch / micro_batches rows."""
    virtual_stages: int = 1
    """Stages per rank: 1 for gpipe and 1f1b, at least 2 for interleaved_1f1b, 2 for zbv and dualpipev."""

    def check(self, mesh_axes: dict[str, int]) -> None:
        """Refuse what no schedule of torch's runs (checked before capture)."""
        if not isinstance(self.axis, str) or self.axis not in mesh_axes:
            raise InputError(f"pipeline axis {self.axis!r} is not an axis of the mesh {dict(mesh_axes)}")
        if next(iter(mesh_axes)) != self.axis:  # the stage meshes' links are then those of the whole mesh
            raise InputError(f"pipeline axis {self.axis!r} must be the mesh's first (outermost) axis, as in "
                             f"Megatron-LM and torchtitan; the mesh's axes are {tuple(mesh_axes)}")
        if self.schedule not in SCHEDULES:
            raise InputError(f"pipeline schedule {self.schedule!r}: the schedules are {', '.join(SCHEDULES)}")
        for name, value in (("micro_batches", self.micro_batches), ("virtual_stages", self.virtual_stages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"pipeline {name} must be a positive whole number, got {value!r}")
        p, v, m = mesh_axes[self.axis], self.virtual_stages, self.micro_batches
        if p < 2:
            raise InputError(f"pipeline axis {self.axis!r} has {p} device: a pipeline needs at least 2 stages ranks")
        low, high = _VIRTUAL[self.schedule]
        if not low <= v <= high:
            wanted = f"= {low}" if low == high else f">= {low}"
            raise InputError(f"pipeline schedule {self.schedule!r} runs virtual_stages {wanted} "
                             f"(stages per rank), got {v}")
        self._check_micro_batches(p, v, m)

    def _check_micro_batches(self, p: int, v: int, m: int) -> None:
        """The micro-batch counts each torch schedule accepts (its constructor's checks)."""
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

    def stages(self, pp_size: int) -> int:
        return pp_size * self.virtual_stages

    def stage_rank(self, stage: int, pp_size: int) -> int:
        """The pp rank holding ``stage`` (torch's ``generate_stage_to_rank_mapping``)."""
        if self.schedule in V_SHAPED:
            return stage if stage < pp_size else 2 * pp_size - 1 - stage
        return stage % pp_size


def as_pipeline(pipeline: object) -> Pipeline:
    """``pipeline=`` as given to ``plan``/``compile``: a ``Pipeline``."""
    if not isinstance(pipeline, Pipeline):
        raise InputTypeError(f"pipeline must be an autopar.Pipeline(axis=..., schedule=..., micro_batches=..., "
                             f"virtual_stages=...), got {type(pipeline).__name__}")
    return pipeline


def pipeline_compute_s(pipeline: Pipeline, pp_size: int, stage_s: list[tuple[float, float]],
                       rank_of: list[int]) -> tuple[float, float]:
    """(seconds of the step's compute with its bubble, the bubble's seconds) under the
    schedule (module docstring); ``stage_s``: each stage's (forward, backward) seconds of one
    micro-batch (its waited collectives included)."""
    m, p = pipeline.micro_batches, pp_size
    per_rank = [0.0] * p
    for (f, b), r in zip(stage_s, rank_of):
        per_rank[r] += f + b
    busy = m * max(per_rank)
    if pipeline.schedule in ("gpipe", "1f1b"):
        total = (m + p - 1) * max(f + b for f, b in stage_s)
    elif pipeline.schedule == "interleaved_1f1b":
        total = (m + (p - 1) / pipeline.virtual_stages) * max(per_rank)
    else:
        forward, backward = max(stage_s, key=lambda s: s[0] + s[1])
        total = busy + (p - 1) * max(0.0, forward + backward / 2 - 2 * (backward / 2))
    total = max(total, busy)
    return total, total - busy
