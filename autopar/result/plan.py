"""``autopar.Plan``: a plan's record (``result.record``) with its renderings: the table ``print(plan)``
shows (``result.table``) and the predicted step as a Chrome trace (``result.trace``)."""

from __future__ import annotations

from pathlib import Path

from autopar.result.record import PlanRecord
from autopar.result.table import render_text
from autopar.result.trace import write_chrome_trace


class Plan(PlanRecord):
    """The chosen plan (``PlanRecord``'s fields): ``print(plan)`` shows it as a table grouped by layer."""

    def __str__(self) -> str:
        return render_text(self)

    def to_chrome_trace(self, path: str | Path) -> None:
        """Write the predicted step as a timeline (Chrome trace format: open it in Perfetto or
        chrome://tracing): compute, collectives waited for and beside compute (``result.trace``);
        a pipelined plan's per pp rank: its stages' actions, bubbles, sends, gradient buckets and
        update (``result.trace_pipeline``)."""
        write_chrome_trace(self, path)


