"""Each pool's batching limits (vLLM's ``max_num_seqs`` and ``max_num_batched_tokens``), derived from its step times.

A pool's limits trade latency for throughput, and the best trade differs per phase (DistServe, Zhong et al.,
OSDI 2024, Sec. 4: each phase's instances are configured for its own latency target; NVIDIA's AIConfigurator
searches the batch per phase likewise):

- a decode pool's ``max_batch``: a larger batch decodes more tokens per step, but each step takes longer, and a
  request's TPOT is its steps' mean. Under a tight TPOT target the pool serves more requests within the SLO with
  a batch whose step at the mean context still fits the target (the rest wait for admission, which costs TTFT
  instead). Derived: the largest batch B with ``decode_s(B, B x L)`` <= TPOT, L the mean context midway through
  the outputs (``decode_batch_within``: on the planned decode line w + beta B + gamma B L, the largest B under
  the target);
- a prefill pool's ``token_budget``: a larger step packs more prompts per read of the weights, but a prompt waits
  for the running step before its own: derived as the largest budget whose full step fits half the TTFT target;
- an aggregated pool: both, its budget by Sarathi-Serve's rule, every step (decodes and prefill chunks together)
  within the TPOT target, since each step is one output token of every running request.

The derived values are snapped to short ladders (``MAX_BATCHES``, ``TOKEN_BUDGETS``): the rung at or below and
the next above (the SLO's percentile leaves slack the step-time rule does not see); batches only up to what the
replica's KV cache holds at the mean request length (beyond it the cache binds first, short requests aside);
budgets only below the default, the budget the replica's steps are planned at (a larger step's working memory,
and so the KV capacity beside it, is not planned, and the fitted lines are chords, optimistic beyond their
points). The defaults (``DEFAULT_MAX_BATCH``, ``DEFAULT_TOKEN_BUDGET``) stay the first tried, so searching never
does worse than them. ``plan_serving`` tries each derived limit in turn, from the best so far (a coordinate
search: the pools' limits act mostly on different targets, the prefill pool's on TTFT, the decode pool's on
TPOT), each only where its throughput bound (at those limits) could beat the best goodput found. A limit the
caller pins is the only one tried, for every pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import InputError
from autopar.serving.deployment import Pool, StepTimes
from autopar.serving.workload import SLO

MAX_BATCHES = (8, 16, 32, 64, 128, 256)
"""Requests per replica tried (a ladder of powers of two: the step-time rule picks the rung, simulation the rest)."""
TOKEN_BUDGETS = (256, 512, 1024, 2048)
"""Tokens per step tried, up to the default: the budget the steps are planned at (module docstring)."""
DEFAULT_MAX_BATCH = 256
"""The batch the steps are planned for when the caller leaves it open, and always tried (vLLM's default
``max_num_seqs``; ``plan_serving``'s fixed limit before it searched them)."""
DEFAULT_TOKEN_BUDGET = 2048
"""The token budget the steps are planned at when the caller leaves it open, and always tried."""


@dataclass(frozen=True, kw_only=True)
class Pins:
    """The limits the caller fixed (None: searched per pool)."""

    max_batch: int | None
    """Every pool's ``max_batch``, or None."""
    token_budget: int | None
    """Every pool's ``token_budget``, or None."""

    @property
    def default(self) -> tuple[int, int]:
        """(max_batch, token_budget) the steps are planned for and always tried: the pins, else the defaults
        (the batch lowered to a smaller pinned budget, as chunked prefill needs)."""
        budget = DEFAULT_TOKEN_BUDGET if self.token_budget is None else self.token_budget
        batch = min(DEFAULT_MAX_BATCH, budget) if self.max_batch is None else self.max_batch
        return batch, budget


@dataclass(frozen=True, kw_only=True)
class Means:
    """The workload's mean lengths, as the limits are derived at them."""

    prompt: float
    """Mean prompt tokens."""
    output: float
    """Mean output tokens."""

    @property
    def context(self) -> float:
        """Cached tokens of a request midway through its outputs: a running batch's mean."""
        return self.prompt + self.output / 2


def decode_batch_within(times: StepTimes, target_s: float, context: float, cap: int) -> int:
    """The largest batch B <= ``cap`` whose decode step over B x ``context`` cached tokens takes at most
    ``target_s``; 0 when not even one request's does. Step times grow with the batch (bisection)."""
    if cap < 1:
        raise InputError(f"cap must be >= 1, got {cap}")
    if times.decode_s(1, round(context)) > target_s:
        return 0
    lo, hi = 1, cap + 1  # decode_s(lo) fits, hi is past the cap or does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if times.decode_s(mid, round(mid * context)) <= target_s else (lo, mid)
    return lo


def budget_within(times: StepTimes, target_s: float, means: Means, decodes: int, cap: int) -> int:
    """The largest step budget T <= ``cap`` whose full step takes at most ``target_s``: ``decodes`` decode tokens
    at the mean context and T - ``decodes`` prefill tokens of mean-length prompts (each token attending to
    (prompt + 1) / 2 positions on average); ``decodes`` (at least 1) when not even that fits."""
    pairs_per_token = (means.prompt + 1) / 2
    decode_context = round(decodes * means.context)

    def step_s(budget: int) -> float:
        chunk = budget - decodes
        return times.mixed_s(chunk, round(chunk * pairs_per_token), decodes, decode_context)

    lo, hi = max(decodes, 1), cap + 1
    if lo > cap or step_s(lo) > target_s:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step_s(mid) <= target_s else (lo, mid)
    return lo


def around(ladder: tuple[int, ...], value: int) -> list[int]:
    """The ladder's value at or below ``value`` (its first when none is) and the next one above."""
    below = [v for v in ladder if v <= value]
    at = below[-1] if below else ladder[0]
    return [at, *[v for v in ladder if v > at][:1]]


def pool_moves(pool: Pool, role: str, means: Means, slo: SLO, pins: Pins) -> list[tuple[str, int]]:
    """Limits to try for ``pool`` in ``role`` ("serve", "prefill" or "decode") instead of its own (the defaults),
    one at a time: ("max_batch", B) or ("token_budget", T), derived from its step times (module docstring). Batches
    up to what its KV cache holds at the mean request, budgets up to the default (the budget the steps were
    planned at: a larger step's working memory is not planned), each valid beside the pool's other limit."""
    st, batch, budget = pool.step_times, pool.max_batch, pool.token_budget
    moves: list[tuple[str, int]] = []
    if role != "prefill" and pins.max_batch is None:  # a prefill replica's requests leave after their prompt
        slots = int(st.kv_capacity_tokens // (means.prompt + means.output))
        fits = decode_batch_within(st, slo.tpot_s, means.context, max(MAX_BATCHES))
        moves += [("max_batch", b) for b in around(MAX_BATCHES, fits) if b <= min(slots, budget) and b != batch]
    if role != "decode" and pins.token_budget is None:  # a decode pool's steps hold at most max_batch tokens
        decodes = 0 if role == "prefill" else next((b for key, b in moves if key == "max_batch"), batch)
        target = slo.ttft_s / 2 if role == "prefill" else slo.tpot_s
        fits = budget_within(st, target, means, decodes, max(TOKEN_BUDGETS))
        moves += [("token_budget", t) for t in around(TOKEN_BUDGETS, fits)
                  if t < budget and (t >= batch or not pool.chunked_prefill)]
    return moves
