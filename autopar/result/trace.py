"""The predicted step as a timeline, in the Chrome trace format (Perfetto, chrome://tracing).

Laid out from the plan's own figures, so the timeline ends at ``predicted.step_time_s``:
per micro-batch, every op's forward in graph order, then every op's backward in reverse,
each after the collectives it waits for; then the gradient buckets the last backward did not
hide and the optimizer step (ZeRO-1's reduce-scatters, the updates, its all-gathers). Three
tracks per group of ranks:

- ``compute``: ops (forward, backward, a checkpointed op's replay inside its backward) and
  the optimizer's updates;
- ``communication (waited for)``: the seconds of a collective the step waits for;
- ``communication (beside compute)``: the rest, drawn where it runs, beside compute: a
  prefetched gather ends as its consumer starts (it ran under the block before), a gradient
  bucket runs beside the last micro-batch's backward.

Every rank of a plan without pipeline stages runs the same timeline, so it is one group. A
pipelined plan is drawn per pp rank instead (``result.trace_pipeline``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from autopar.cost.summed_loss import SUMMED_LOSS
from autopar.result.record import PlanRecord
from autopar.result.spans import BESIDE, COMPUTE, TRACKS, WAITED, Span
from autopar.result.trace_pipeline import pipeline_chrome_trace
from autopar.units import fmt_bytes



class _Layout:
    """Places spans: the step's clock advances with compute and waited collectives; collectives
    beside compute go on their own track, one after another."""

    def __init__(self) -> None:
        self.now = 0.0
        self.beside = 0.0
        self.spans: list[Span] = []

    def compute(self, name: str, seconds: float, phase: str, **args: Any) -> None:
        if seconds > 0:
            self.spans.append(Span(name=name, track=COMPUTE, start_s=self.now, seconds=seconds, phase=phase, args=args))
            self.now += seconds

    def collective(self, c: Any, phase: str, hidden_from: float | None = None, waited: float | None = None
                   ) -> None:
        """Collective ``c``'s waited part (``waited``, else its own) now; its hidden part ending
        now, or from ``hidden_from``."""
        if waited is None:
            waited = c.time_s if c.waited_s is None else c.waited_s
        hidden = c.time_s - waited
        args = {"tensor": c.tensor, "consumer": c.consumer, "bytes": c.bytes}
        name = f"{c.kind} @{c.axis} {fmt_bytes(c.bytes)}"
        if hidden > 0:
            start = max(self.beside, self.now - hidden if hidden_from is None else hidden_from)
            self.spans.append(Span(name=name, track=BESIDE, start_s=start, seconds=hidden, phase=phase, args=args))
            self.beside = start + hidden
        if waited > 0:
            self.spans.append(Span(name=name, track=WAITED, start_s=self.now, seconds=waited, phase=phase, args=args))
            self.now += waited


def timeline(plan: PlanRecord) -> list[Span]:
    """The predicted step's spans (module docstring); the last ends at the step time. A
    pipelined plan's are those of the whole step on one stage mesh, not the pipelined step
    (``chrome_trace`` draws that per pp rank)."""
    by_node: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for c in plan.collectives:
        by_node[(c.phase, c.consumer)].append(c)
    forward_keys = {(c.tensor, c.consumer, c.kind, c.axis, c.bytes) for c in plan.collectives if c.phase == "forward"}
    layout = _Layout()
    micro_batches = plan.memory.micro_batches if plan.train else 1
    last_backward = 0.0
    for m in range(micro_batches):
        for node in plan.nodes:
            for c in by_node[("forward", node.name)]:
                layout.collective(c, "forward")
            layout.compute(_op_name(node), node.forward_s, "forward", node=node.name, micro_batch=m)
        for c in by_node[("forward", "output")]:  # the loss, replicated on every rank
            layout.collective(c, "forward")
        last_backward = layout.now
        for node in reversed(plan.nodes):
            again = [c for c in by_node[("backward", node.name)]
                     if (c.tensor, c.consumer, c.kind, c.axis, c.bytes) in forward_keys]  # gathered again
            for c in [*by_node[("recompute", node.name)], *again]:
                layout.collective(c, "backward")
            layout.compute(_op_name(node), node.backward_s, "backward", node=node.name, micro_batch=m)
            for c in by_node[("backward", node.name)]:
                if c not in again:
                    layout.collective(c, "backward", waited=_unwaited_share(c, m, micro_batches))
    for c in by_node[("backward", "")]:  # gradient buckets, beside the last backward
        layout.collective(c, "backward", hidden_from=last_backward)
    for c in by_node[("forward", SUMMED_LOSS)]:  # the micro-batches' summed loss, replicated once
        layout.collective(c, "forward")
    optimizer = by_node[("optimizer", "optimizer")]
    for c in optimizer:
        if c.kind == "reduce_scatter":
            layout.collective(c, "optimizer")
    layout.compute("optimizer step", sum(n.update_s for n in plan.nodes), "optimizer",
                   parameters=sum(1 for n in plan.nodes if n.update_s > 0))
    for c in optimizer:
        if c.kind != "reduce_scatter":
            layout.collective(c, "optimizer")
    return layout.spans


def _unwaited_share(c: Any, m: int, micro_batches: int) -> float | None:
    """A parameter gradient's reduce-scatter left running beside backward hides only in the last
    micro-batch (``plan._beside_backward``: its ``waited_s`` averages micro-batches that wait in
    full and the last one's share): that run's waited seconds, the others' all (None: as listed)."""
    if c.kind != "reduce_scatter" or c.waited_s is None or micro_batches == 1:
        return None
    last = c.waited_s * micro_batches - c.time_s * (micro_batches - 1)
    return last if m == micro_batches - 1 else c.time_s


def _op_name(node: Any) -> str:
    op = node.op.split(".")[1] if node.op.startswith("aten.") else node.op
    return f"{op} {node.module}" if node.module else op


def chrome_trace(plan: PlanRecord) -> dict[str, Any]:
    """The timeline as a Chrome trace object (microseconds; one process per group of ranks)."""
    if plan.pipeline is not None:
        return pipeline_chrome_trace(plan)
    ranks = math.prod(plan.mesh["axes"].values())
    pid = 0
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid,
         "args": {"name": f"ranks 0-{ranks - 1} (no pipeline stages: every rank runs this step)"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}}
               for tid, track in enumerate(TRACKS)]
    events += [{"ph": "X", "name": s.name, "cat": s.phase, "pid": pid, "tid": TRACKS.index(s.track),
                "ts": s.start_s * 1e6, "dur": s.seconds * 1e6, "args": s.args} for s in timeline(plan)]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(plan: PlanRecord, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(plan)))
