"""Step times fitted to a measured serving run, so the simulator can be checked against the engine.

The engine (``autopar.runtime.engine``) runs compiled steps of fixed shapes: a decode call over every
cache slot costs the same whatever the batch, and a prefill call runs one request's chunk of the
compiled length, padded. So a replica's step of ``d`` decodes and ``c`` prefill calls costs about
``overhead + D * (d > 0) + P * c``, with ``D`` the decode call, ``P`` the prefill call and
``overhead`` what surrounds them: the step's own Python, and the gap before the replica's next step
(reporting the step, planning the next and handing it over, the transfers at its start).
Each is the mean of its measurements, not the median: a latency is a sum of steps, whose expectation
is the sum of the means (calls slowed now and then by ranks sharing cores count). The KV transfer is
the mean measured transfer. Approximation: the simulator hands a step its prefill tokens in all,
priced as ``ceil(tokens / chunk)`` calls, where the engine runs one call per request's partial chunk.
"""

from __future__ import annotations

from statistics import fmean
from dataclasses import dataclass

from autopar.errors import InputError


@dataclass(frozen=True, kw_only=True)
class MeasuredStepTimes:
    """A ``StepTimes`` of fixed-shape steps, fitted with ``fit_step_times``."""

    decode_call_s: float
    """One decode call (every slot)."""
    prefill_call_s: float
    """One prefill call (one compiled chunk)."""
    calls_per_token: float
    """Prefill calls per prefill token, measured (at least 1/chunk: partial chunks are padded)."""
    overhead_s: float
    """Per step, around its calls."""
    transfer_s: float
    """One request's KV cache from a prefill replica to a decode replica."""
    capacity_tokens: int
    """Cache tokens a replica holds (slots x positions)."""

    @property
    def kv_capacity_tokens(self) -> int:
        return self.capacity_tokens

    def prefill_s(self, tokens_in_batch: int, context: int) -> float:
        return self.overhead_s + self.prefill_call_s * self.calls_per_token * tokens_in_batch

    def decode_s(self, batch_size: int, total_context_tokens: int) -> float:
        return self.overhead_s + self.decode_call_s

    def mixed_s(self, prefill_tokens: int, prefill_context: int, decode_batch: int,
                decode_context_tokens: int) -> float:
        return self.prefill_s(prefill_tokens, prefill_context) + self.decode_call_s

    def kv_transfer_s(self, tokens: int) -> float:
        return self.transfer_s


def fit_step_times(*, decode_calls_s: list[float], prefill_calls_s: list[float],
                   steps: list[tuple[int, int, int, float]], gaps_s: list[float], transfers_s: list[float],
                   chunk: int, capacity_tokens: int) -> MeasuredStepTimes:
    """Means of the measured calls; the overhead is the mean of each step's duration less its calls
    (``steps``: (decode rows, prefill tokens, prefill calls, s)) plus the mean gap between steps."""
    if not decode_calls_s or not prefill_calls_s or not steps:
        raise InputError("fitting step times needs measured decode calls, prefill calls and steps")
    decode, prefill = fmean(decode_calls_s), fmean(prefill_calls_s)
    around = fmean(s - decode * (d > 0) - prefill * c for d, _, c, s in steps)
    gap = fmean(gaps_s) if gaps_s else 0.0
    tokens, calls = sum(t for _, t, _, _ in steps), sum(c for *_, c, _ in steps)
    return MeasuredStepTimes(decode_call_s=decode, prefill_call_s=prefill, overhead_s=max(around, 0.0) + gap,
                             calls_per_token=calls / tokens if tokens else 1 / chunk,
                             transfer_s=fmean(transfers_s) if transfers_s else 0.0,
                             capacity_tokens=capacity_tokens)
