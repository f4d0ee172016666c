"""The bars of a predicted timeline (``result.trace``, ``result.trace_pipeline``) and the tracks they lie on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMPUTE, WAITED, BESIDE = "compute", "communication (waited for)", "communication (beside compute)"
TRACKS = (COMPUTE, WAITED, BESIDE)


@dataclass(frozen=True, kw_only=True)
class Span:
    """One bar of the timeline."""

    name: str
    track: str
    """``COMPUTE``, ``WAITED`` or ``BESIDE``."""
    start_s: float
    seconds: float
    phase: str
    """'forward', 'backward', 'recompute' or 'optimizer' ('bubble': a pp rank's idle gap)."""
    args: dict[str, Any] = field(default_factory=dict)
