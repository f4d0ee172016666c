"""Discrete-event simulation of a serving run: requests, replicas, batching steps, KV transfers.

Time only moves from event to event (arrivals, step ends, KV transfers ends); nothing sleeps.

Policies (chosen to match what vLLM, Sarathi-Serve and DistServe do, and stated here because
the predicted latencies depend on them):

- Routing: an arriving request goes to the replica of its pool with the least outstanding work
  (tokens still to prefill and decode of the requests routed to it), the lowest index on ties;
  so does a prefilled request to the decode pool. Deterministic, and it balances prompts of
  unequal length better than round robin.
- Admission: first come, first served per replica, strictly (a request that does not fit blocks
  those behind it, so no request starves). A request is admitted when the replica runs fewer
  than ``max_batch`` requests and its KV cache can hold the request's prompt and output tokens
  whole: the cache is reserved at admission, so nothing is ever preempted (vLLM preempts and
  recomputes instead; reserving is the conservative bound). A request larger than a replica's
  whole cache can never run: ``simulate`` refuses it with an ``InputError`` before starting.
- Steps (aggregated, chunked): every running request past its prefill decodes one token, and
  the budget left is filled with prefill chunks in admission order (Sarathi-Serve's stall-free
  batching). Without chunking a step either prefills whole prompts (at least one, up to the
  budget) or, when none waits, decodes.
- Disaggregated: the prefill replica keeps a request's KV cache until it has been sent; the
  decode replica admits the request (and reserves its cache) before the transfer starts, as
  DistServe's decode instances pull caches when they have room. The first token reaches the
  user from the decode replica, when the transfer ends (the response streams from one place),
  so TTFT includes the transfer.

TPOT of a request = (finish - first token) / (output tokens - 1); 0 for one output token.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import InputError, KVCapacityError
from autopar.serving.deployment import Deployment, Pool
from autopar.serving.workload import SLO, Requests

_STEP_END, _TRANSFER_END = 1, 2


@dataclass(kw_only=True, slots=True, eq=False)
class _Request:
    """One request's progress (mutable, internal)."""

    index: int
    """Position in the run's ``Requests``."""
    arrival: float
    """Arrival time, s."""
    prompt: int
    """Prompt tokens."""
    output: int
    """Output tokens in all."""
    prefilled: int = 0
    """Prompt tokens prefilled so far."""
    order: int = 0
    """Its admission number on the replica whose batch holds it: a batch runs in admission order."""
    first_token: float = math.nan
    """When the user got the first token."""
    finish: float = math.nan
    """When the user got the last token."""
    holder: _Replica | None = None
    """The prefill replica keeping its KV cache until it is sent (disaggregated)."""


@dataclass(kw_only=True, eq=False)
class _Replica:
    """One replica's queue, running batch and cache (mutable, internal).

    Every decoding request gains one token per decode step of its replica, so none is touched per
    step: the replica counts its decode steps, keeps each decoding request under the count at which
    its last token comes, and keeps the sum of their contexts as a base that the count moves."""

    pool: Pool
    """Its pool."""
    role: str
    """'serve' (prefill and decode), 'prefill' or 'decode'."""
    index: int
    """Index in its pool (routing ties go to the lowest)."""
    queue: deque[_Request] = field(default_factory=deque)
    """Routed here, not yet admitted, in arrival order."""
    batch: int = 0
    """Requests admitted and still in the batch (at most ``max_batch``)."""
    admitted: int = 0
    """Requests admitted so far (numbers the next one: ``_Request.order``)."""
    prefilling: deque[_Request] = field(default_factory=deque)
    """Admitted, prompt not yet whole, in admission order ('serve' and 'prefill'). Steps prefill them
    in this order and only the last chunk of a step may leave a prompt unfinished, so they finish in it too."""
    joining: list[_Request] = field(default_factory=list)
    """Past their first token since the last step was planned: they decode from the next step on."""
    decoding: list[tuple[int, int, _Request]] = field(default_factory=list)
    """Decoding requests, a heap of (``decode_steps`` at their last token, admission number, request):
    those ending in one step come off it in batch order, the order the step's work is done in."""
    decode_steps: int = 0
    """Decode steps run (each gives every request of ``decoding`` a token)."""
    context_base: int = 0
    """The decoding requests' context tokens (prompt and tokens generated) less ``len(decoding) x
    decode_steps``: the sum over them of prompt + output - the count at their last token."""
    kv_used: int = 0
    """Cache tokens reserved."""
    load: int = 0
    """Tokens still to prefill or decode of requests routed here (the routing key)."""
    busy: bool = False
    """A step is running."""
    capacity: int = 0
    """Cache tokens the replica holds (read once: a StepTimes may compute it)."""
    step_decodes: int = 0
    """Requests of ``decoding`` the running step gives a token (all of them, or none)."""
    step_chunks: list[tuple[_Request, int]] = field(default_factory=list)
    """The running step's prefill chunks: (request, prompt tokens)."""

    def need(self, req: _Request) -> int:
        """Cache tokens a request reserves here: its prompt on a prefill replica (it leaves after
        prefill), its prompt and output elsewhere."""
        return req.prompt if self.role == "prefill" else req.prompt + req.output

    def work_of(self, req: _Request) -> int:
        """Tokens of work a request brings here (its routing load): prompt tokens to prefill, and
        output tokens to produce (the first by the prefill's last step, or delivered by a transfer)."""
        if self.role == "serve":
            return req.prompt + req.output - 1
        return req.prompt if self.role == "prefill" else req.output


@dataclass(frozen=True, kw_only=True)
class ServingReport:
    """Latency percentiles and SLO attainment of one run."""

    requests: int
    """Requests counted (the run's, less its warm-up)."""
    ttft_s: dict[int, float]
    """TTFT percentiles: {50: p50, 90: p90, 99: p99}, seconds."""
    tpot_s: dict[int, float]
    """TPOT percentiles, seconds."""
    attainment: float
    """Fraction of requests meeting both the TTFT and the TPOT target."""
    throughput_rps: float
    """Requests finished per second, first arrival to last finish."""
    output_tokens_per_s: float
    """Output tokens per second over the same span."""


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Per-request times of one simulated run."""

    requests: Requests
    """The requests, as simulated."""
    first_token_s: np.ndarray
    """When each request's first token reached the user, s."""
    finish_s: np.ndarray
    """When each request's last token reached the user, s."""

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.requests.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        decoded = self.requests.output_tokens - 1
        return np.where(decoded > 0, (self.finish_s - self.first_token_s) / np.maximum(decoded, 1), 0.0)

    def measured(self, warmup: float) -> slice:
        """The requests a report counts: all but the first ``warmup`` fraction by arrival (a run
        starts with empty replicas; its first requests see less queueing than the steady state)."""
        if not 0 <= warmup < 1:
            raise InputError(f"warmup is the fraction of requests left out, in [0, 1); got {warmup}")
        return slice(int(len(self.requests) * warmup), None)

    def attainment(self, slo: SLO, warmup: float = 0.0) -> float:
        """Fraction of the measured requests meeting both targets."""
        window = self.measured(warmup)
        ok = (self.ttft_s[window] <= slo.ttft_s) & (self.tpot_s[window] <= slo.tpot_s)
        return float(ok.mean())

    def report(self, slo: SLO, warmup: float = 0.0) -> ServingReport:
        """Percentiles and attainment of the measured requests; throughput over the whole run."""
        window = self.measured(warmup)
        ttft, tpot = self.ttft_s[window], self.tpot_s[window]
        span = float(self.finish_s.max() - self.requests.arrival_s.min())
        pct = (50, 90, 99)
        return ServingReport(
            requests=len(ttft),
            ttft_s={p: float(np.percentile(ttft, p)) for p in pct},
            tpot_s={p: float(np.percentile(tpot, p)) for p in pct},
            attainment=self.attainment(slo, warmup),
            throughput_rps=len(self.requests) / span if span > 0 else math.inf,
            output_tokens_per_s=float(self.requests.output_tokens.sum()) / span if span > 0 else math.inf)


def simulate(deployment: Deployment, requests: Requests) -> SimResult:
    """Run ``requests`` through ``deployment``; deterministic (no randomness, ties broken by order)."""
    if len(requests) == 0:
        raise InputError("simulate needs at least one request")
    check_capacity(deployment, requests)
    return _Simulation(deployment, requests).run()


def check_capacity(deployment: Deployment, requests: Requests) -> None:
    """Refuse a request no replica's cache can ever hold, rather than let it wait forever."""
    needs = {"serve": requests.prompt_tokens + requests.output_tokens, "prefill": requests.prompt_tokens,
             "decode": requests.prompt_tokens + requests.output_tokens}
    roles = ("serve",) if not deployment.disaggregated else ("prefill", "decode")
    for role, pool in zip(roles, deployment.pools):
        capacity = pool.step_times.kv_capacity_tokens
        too_big = np.flatnonzero(needs[role] > capacity)
        if too_big.size:
            i = int(too_big[0])
            raise KVCapacityError(
                f"request {i} (prompt {requests.prompt_tokens[i]} + output {requests.output_tokens[i]} tokens) needs "
                f"{needs[role][i]} tokens of KV cache, more than a {role} replica of {deployment.name!r} holds "
                f"({capacity}); {too_big.size} request(s) too long: give replicas more memory (more devices per "
                "replica) or cap the lengths")


class _Simulation:
    """The event loop of one run."""

    def __init__(self, deployment: Deployment, requests: Requests) -> None:
        self.requests = requests
        columns = (requests.arrival_s.tolist(), requests.prompt_tokens.tolist(), requests.output_tokens.tolist())
        self.reqs = [_Request(index=i, arrival=a, prompt=p, output=o) for i, (a, p, o) in enumerate(zip(*columns))]
        roles = ("serve",) if not deployment.disaggregated else ("prefill", "decode")
        self.pools = {role: [_Replica(pool=pool, role=role, index=k, capacity=pool.step_times.kv_capacity_tokens)
                             for k in range(pool.replicas)]
                      for role, pool in zip(roles, deployment.pools)}
        self.entry = self.pools[roles[0]]
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.done = 0

    def push(self, time: float, kind: int, obj: object) -> None:
        heapq.heappush(self.events, (time, self.seq, kind, obj))
        self.seq += 1

    def run(self) -> SimResult:
        next_arrival = 0
        n = len(self.reqs)
        while self.done < n:
            # Arrivals come from the sorted list, not the heap: the heap stays the size of the
            # replicas and transfers in flight, not of the run.
            if next_arrival < n and (not self.events or self.reqs[next_arrival].arrival <= self.events[0][0]):
                req = self.reqs[next_arrival]
                next_arrival += 1
                self.route(self.entry, req, req.arrival)
                continue
            if not self.events:
                raise AssertionError("serving simulation stalled with requests unfinished")  # a bug, not bad input
            now, _, kind, obj = heapq.heappop(self.events)
            if kind == _STEP_END:
                self.end_step(obj, now)  # type: ignore[arg-type]
            else:
                self.end_transfer(obj, now)  # type: ignore[arg-type]
        return SimResult(requests=self.requests, first_token_s=np.array([r.first_token for r in self.reqs]),
                         finish_s=np.array([r.finish for r in self.reqs]))

    def route(self, replicas: list[_Replica], req: _Request, now: float) -> None:
        rep = min(replicas, key=lambda r: (r.load, r.index))
        rep.queue.append(req)
        rep.load += rep.work_of(req)
        self.admit(rep, now)
        self.start(rep, now)

    def admit(self, rep: _Replica, now: float) -> None:
        capacity, limit = rep.capacity, rep.pool.max_batch
        while rep.queue and rep.batch < limit and rep.kv_used + rep.need(rep.queue[0]) <= capacity:
            req = rep.queue.popleft()
            rep.kv_used += rep.need(req)
            rep.batch += 1
            req.order = rep.admitted
            rep.admitted += 1
            if rep.role == "decode":  # the cache has room: pull the request's KV from its prefill replica
                self.push(now + rep.pool.step_times.kv_transfer_s(req.prompt), _TRANSFER_END, (rep, req))
            else:
                rep.prefilling.append(req)

    def start(self, rep: _Replica, now: float) -> None:
        """Start a step on an idle replica that has work."""
        if rep.busy:
            return
        duration = _plan_step(rep)
        if not 0 <= duration < math.inf:
            raise InputError(f"step times of {rep.pool.describe()} gave a {rep.role} step of {duration!r} s; "
                             "steps must take a finite time >= 0")
        if rep.step_decodes or rep.step_chunks:
            rep.busy = True
            self.push(now + duration, _STEP_END, rep)

    def end_step(self, rep: _Replica, now: float) -> None:
        rep.busy = False
        if rep.step_decodes:
            rep.load -= rep.step_decodes
            rep.decode_steps += 1
            ended = []
            while rep.decoding and rep.decoding[0][0] <= rep.decode_steps:
                ended.append(heapq.heappop(rep.decoding))
            for last, _, req in ended:
                rep.context_base -= req.prompt + req.output - last
                self.finish(rep, req, now)
        for req, chunk in rep.step_chunks:
            rep.load -= chunk
            req.prefilled += chunk
            if req.prefilled == req.prompt:
                self.end_prefill(rep, req, now)
        rep.step_chunks = []
        self.admit(rep, now)
        self.start(rep, now)

    def end_prefill(self, rep: _Replica, req: _Request, now: float) -> None:
        """A prompt is prefilled, and its last chunk has yielded the first token."""
        first = rep.prefilling.popleft()
        assert first is req, "prompts finish prefilling in admission order"
        if rep.role == "prefill":
            rep.batch -= 1  # leaves the batch; its cache stays until sent
            req.holder = rep
            self.route(self.pools["decode"], req, now)
        else:
            req.first_token = now
            self.decode_or_finish(rep, req, now)

    def end_transfer(self, item: tuple[_Replica, _Request], now: float) -> None:
        rep, req = item
        holder = req.holder
        assert holder is not None
        holder.kv_used -= req.prompt
        req.holder = None
        self.admit(holder, now)
        self.start(holder, now)
        req.first_token = now
        rep.load -= 1  # the first token, produced by prefill, is delivered now
        self.decode_or_finish(rep, req, now)
        self.start(rep, now)

    def decode_or_finish(self, rep: _Replica, req: _Request, now: float) -> None:
        """A request has its first token: it is done, or decodes the rest."""
        if req.output == 1:
            self.finish(rep, req, now)
        else:
            rep.joining.append(req)

    def finish(self, rep: _Replica, req: _Request, now: float) -> None:
        req.finish = now
        rep.batch -= 1
        rep.kv_used -= rep.need(req)
        self.done += 1
        self.admit(rep, now)


def _plan_step(rep: _Replica) -> float:
    """Set the next step's work (``step_decodes``, ``step_chunks``) and return its duration (0 when there is none)."""
    pool, times = rep.pool, rep.pool.step_times
    for req in rep.joining:  # one token out (by prefill): its last comes output - 1 decode steps from now
        last = rep.decode_steps + req.output - 1
        heapq.heappush(rep.decoding, (last, req.order, req))
        rep.context_base += req.prompt + req.output - last
    rep.joining.clear()
    decodes = len(rep.decoding)
    if rep.prefilling and not pool.chunked_prefill:
        decodes = 0  # no chunking: a step prefills whole prompts, alone
    budget = pool.token_budget - decodes
    chunks: list[tuple[_Request, int]] = []
    prefill_tokens = pairs = 0
    for req in rep.prefilling:
        left = req.prompt - req.prefilled
        chunk = min(left, budget) if pool.chunked_prefill else left
        if chunk <= 0 or (not pool.chunked_prefill and chunks and chunk > budget):
            break
        chunks.append((req, chunk))
        prefill_tokens += chunk
        pairs += chunk * req.prefilled + chunk * (chunk + 1) // 2
        budget -= chunk
    rep.step_decodes, rep.step_chunks = decodes, chunks
    context = rep.context_base + decodes * rep.decode_steps if decodes else 0
    if not decodes and not chunks:
        return 0.0
    if not chunks:
        return times.decode_s(decodes, context)
    if not decodes:
        return times.prefill_s(prefill_tokens, pairs)
    return times.mixed_s(prefill_tokens, pairs, decodes, context)
