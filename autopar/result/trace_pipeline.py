"""A pipelined plan's predicted step as a timeline: one process per pp rank, laid out from
the same simulation the plan is priced with (``PipelinePlan.simulate``, ``rank_ends``), so
the slowest rank's last span ends at ``predicted.step_time_s``. Tracks of a pp rank:

- ``compute``: its actions in torch's order, named by torch's letters (``F stage 2 mb 5``:
  forward; ``B``: whole backward; ``I``/``W``: input / weight gradients only), a ``bubble``
  for every idle gap before its pipeline drains, the wait for the step's loss (broadcast from
  the last stage's rank) and its optimizer step;
- ``communication (waited for)``: its gradient buckets, once its pipeline has drained, then
  the all-reduces of its tied weights' gradients with the other pp ranks holding them (after a
  wait on ``compute`` for the latest of those ranks);
- ``point-to-point to pp rank k``: the activations and gradients it sends to rank k, one at
  a time (its receiver waits for each, its compute goes on).

A stage's own collectives (tensor parallelism on the stage mesh) are inside its actions'
seconds, as the plan prices them.
"""

from __future__ import annotations

import math
from typing import Any

from autopar.pipeline.schedule_sim import BACKWARD, FORWARD, INPUT_GRAD, Simulation
from autopar.result.record import PlanRecord
from autopar.result.spans import COMPUTE, WAITED, Span

P2P = "point-to-point"
KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward (input and weight gradients)",
              INPUT_GRAD: "backward (input gradients)", "W": "backward (weight gradients)"}


def pipeline_timeline(plan: Any) -> list[list[Span]]:
    """Each pp rank's spans (module docstring); ``plan.pipeline`` is not None."""
    pipe = plan.pipeline
    sim = pipe.simulate()
    ends = pipe.rank_ends(sim)
    loss_rank = pipe.stages[-1].rank
    out: list[list[Span]] = []
    for r, end in enumerate(ends):
        spans = _compute_spans(sim, r)
        spans += [Span(name=f"send {_value(t.kind)} of stage {t.stage} mb {t.micro_batch}",
                       track=f"{P2P} to pp rank {t.dst}", start_s=t.start_s, seconds=t.end_s - t.start_s,
                       phase="forward" if t.kind == FORWARD else "backward",
                       args={"stage": t.stage, "micro_batch": t.micro_batch, "to_pp_rank": t.dst})
                  for t in sim.transfers if t.src == r]
        if end.synced_s > end.drained_s:
            spans.append(Span(name="gradient buckets (all-reduce on the stage mesh)", track=WAITED,
                              start_s=end.drained_s, seconds=end.synced_s - end.drained_s, phase="backward"))
        if end.tied_start_s > end.synced_s:
            spans.append(Span(name="waiting for the pp ranks holding its tied weights", track=COMPUTE,
                              start_s=end.synced_s, seconds=end.tied_start_s - end.synced_s, phase="bubble"))
        if end.tied_end_s > end.tied_start_s:
            spans.append(Span(name=f"tied weights' gradients (all-reduce on {pipe.axis})", track=WAITED,
                              start_s=end.tied_start_s, seconds=end.tied_end_s - end.tied_start_s, phase="backward",
                              args={"weights": [w.parameter for w in pipe.tied if r in w.ranks]}))
        if end.update_start_s > end.tied_end_s and r == loss_rank:
            spans.append(Span(name="the step's summed loss (all-reduce on the stage mesh)", track=WAITED,
                              start_s=end.tied_end_s, seconds=end.update_start_s - end.tied_end_s, phase="forward"))
        elif end.update_start_s > end.tied_end_s:
            spans.append(Span(name=f"waiting for the loss from pp rank {loss_rank}", track=COMPUTE,
                              start_s=end.tied_end_s, seconds=end.update_start_s - end.tied_end_s, phase="bubble"))
        if end.end_s > end.update_start_s:
            spans.append(Span(name="optimizer step", track=COMPUTE, start_s=end.update_start_s,
                              seconds=end.end_s - end.update_start_s, phase="optimizer",
                              args={"stages": [s.index for s in pipe.stages if s.rank == r]}))
        out.append(spans)
    return out


def _compute_spans(sim: Simulation, r: int) -> list[Span]:
    """Rank r's actions, and a bubble before each one that waits for another rank."""
    spans: list[Span] = []
    free = 0.0
    for a in sim.actions[r]:
        name = f"{a.kind} stage {a.stage} mb {a.micro_batch}"
        if a.start_s > free:
            spans.append(Span(name="bubble", track=COMPUTE, start_s=free, seconds=a.start_s - free, phase="bubble",
                              args={"waiting to run": name}))
        spans.append(Span(name=name, track=COMPUTE, start_s=a.start_s, seconds=a.end_s - a.start_s,
                          phase="forward" if a.kind == FORWARD else "backward",
                          args={"stage": a.stage, "micro_batch": a.micro_batch, "kind": KIND_NAMES[a.kind]}))
        free = a.end_s
    return spans


def _value(kind: str) -> str:
    return "activations" if kind == FORWARD else "gradients"


def pipeline_chrome_trace(plan: PlanRecord) -> dict[str, Any]:
    """The pp ranks' timelines as a Chrome trace object (microseconds; one process per pp rank,
    named with the ranks of the whole mesh it stands for: the pipeline axis is the outermost)."""
    pipe = plan.pipeline
    per_stage_mesh = math.prod(pipe.stage_mesh.values())
    events: list[dict[str, Any]] = []
    for r, spans in enumerate(pipeline_timeline(plan)):
        first, last = r * per_stage_mesh, (r + 1) * per_stage_mesh - 1
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        stages = ", ".join(str(s.index) for s in pipe.stages if s.rank == r)
        events.append({"ph": "M", "name": "process_name", "pid": r,
                       "args": {"name": f"pp rank {r} ({ranks} of the mesh; stages {stages})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        tracks = [COMPUTE, WAITED] + sorted({s.track for s in spans} - {COMPUTE, WAITED})
        events += [{"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": track}}
                   for tid, track in enumerate(tracks)]
        events += [{"ph": "X", "name": s.name, "cat": s.phase, "pid": r, "tid": tracks.index(s.track),
                    "ts": s.start_s * 1e6, "dur": s.seconds * 1e6, "args": s.args} for s in spans]
    return {"traceEvents": events, "displayTimeUnit": "ms"}
