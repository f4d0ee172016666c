"""A continuous-batching serving engine on ranks: replicas of one ``ServingModule``, aggregated or
disaggregated (prefill replicas handing each request's KV cache to decode replicas point to point).

How the ranks agree: the deployment's first rank (global rank 0) runs the ``Scheduler`` in a thread,
from its clock, and pushes each replica's next plan, when the replica is done with its last one, to a
queue per rank in the process group's store (the control plane: vLLM's driver worker broadcasts the
scheduler's output the same way); every rank of a replica pops the same plans in the same order, so they
run the same steps, and no rank decides anything from its own clock. Replicas run at their own pace;
each replica's first rank reports a finished plan on a queue the scheduler waits on. The schedule needs
only lengths and the clock; token values stay on the replicas (the first token travels with its cache).

How KV moves: when a request's prefill is done, its prefill replica's next plan sends its cache: prefill
rank i sends decode rank i (the same tp index, so the same shard) first a metadata tensor (request,
length, first token), then every cache buffer's rows ``[slot, :length]`` packed in one tensor (``isend``:
the replica goes on; the packed copy frees the slot). The decode replica's plan that admits the request
receives both (tagged by request), checks the metadata and writes the rows into its slot.

Times (s since a barrier at the start, each replica's first rank's clock): a request's first token
when its prefill's step ends (aggregated) or when its cache has arrived (disaggregated, as the
simulator counts it), each later token when its decode step ends.
"""

from __future__ import annotations

import itertools
import pickle
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import InputError
from autopar.runtime.rank_errors import gather_errors
from autopar.runtime.generate import whole
from autopar.runtime.scheduler import ReplicaStep, Scheduler, Transfer
from autopar.runtime.serving import ServingModule


@dataclass(frozen=True, kw_only=True)
class ServeRequest:
    """One request to serve."""

    prompt: list[int]
    """Prompt tokens."""
    max_new_tokens: int
    """Tokens to generate (the first by the prefill), >= 1."""
    arrival_s: float
    """When it arrives, s from the start of the run."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the replicas were compiled and how they batch."""

    slots: int
    """Cache slots per replica: the decode step's compiled batch."""
    chunk: int
    """Tokens of the compiled prefill step (one request's chunk per call)."""
    max_len: int
    """Cache positions per slot."""
    token_budget: int
    """Tokens one step of a replica processes at most (decodes + prefill chunks)."""
    cache_buffers: tuple[str, ...]
    """FQNs of the KV-cache buffers, laid out (slot, position, ...): what a transfer sends."""
    pad_token: int = 0
    """Token filling a padded prefill chunk."""


@dataclass(kw_only=True)
class EngineRecord:
    """What one rank saw of a run (times are its replica's first rank's; other ranks' are empty)."""

    replica: int
    """This rank's replica."""
    tokens: dict[int, list[int]] = field(default_factory=dict)
    """Request -> the tokens it generated here (a decode replica's include the first, received)."""
    token_s: dict[int, list[float]] = field(default_factory=dict)
    """Request -> when each of its tokens reached the user here."""
    prefill_calls_s: list[float] = field(default_factory=list)
    """Duration of each prefill call (one compiled chunk)."""
    decode_calls_s: list[float] = field(default_factory=list)
    """Duration of each decode call (every slot)."""
    steps: list[tuple[int, int, int, float]] = field(default_factory=list)
    """Per step of this replica: (decode rows, prefill tokens, prefill calls, duration s)."""
    gaps_s: list[float] = field(default_factory=list)
    """Between two steps of this replica in consecutive plans: the time from one's end to the next's start
    (reporting, planning, handing the plan over, transfers)."""
    transfers: list[tuple[int, float]] = field(default_factory=list)
    """Per cache received: (positions, s from the first metadata byte waited for to the cache written)."""


IDLE_S = 1.0
"""Longest a replica goes without a plan: an idle one gets an empty plan then, so that its ranks, waiting
on the store, hear from the scheduler well within the store's timeout however far apart requests arrive."""
_RUNS = itertools.count()
"""``serve`` calls made by this process: the same sequence on every rank, naming each run's store keys."""


def serve(serving: ServingModule, requests: list[ServeRequest], replicas: list[list[int]], roles: list[str],
          config: EngineConfig) -> EngineRecord:
    """Serve ``requests`` on the deployment (call on every rank with the same arguments): ``replicas``
    lists each replica's global ranks in their mesh order (``serving`` is this rank's replica's
    module), ``roles`` each replica's role ("serve", or "prefill" and "decode"). Returns this rank's
    record. Bad input is refused on every rank; so is a failure of the scheduler."""
    me = dist.get_rank()
    replica = next((i for i, ranks in enumerate(replicas) if me in ranks), -1)
    error = _input_error(serving, requests, replicas, roles, config, replica)
    scheduler = None
    if not error:
        try:
            scheduler = Scheduler([(r.arrival_s, len(r.prompt), r.max_new_tokens) for r in requests], roles,
                                  slots=config.slots, max_len=config.max_len, token_budget=config.token_budget)
        except InputError as exc:
            error = str(exc)
    gather_errors("starting the serving engine", error, InputError)
    assert scheduler is not None
    store, prefix = dist.distributed_c10d._get_default_store(), f"autopar/engine/{next(_RUNS)}"
    runner = _Runner(serving, requests, replicas, replica, config)
    dist.barrier()
    runner.t0 = time.perf_counter()
    thread = None
    if me == 0:
        arrivals = [r.arrival_s for r in requests]
        thread = threading.Thread(target=_schedule, args=(scheduler, store.clone(), replicas, prefix, runner.t0,
                                                          arrivals), daemon=True)
        thread.start()
    switch = sys.getswitchinterval()
    if thread is not None:  # the scheduler thread takes the interpreter within 0.5 ms of a report
        sys.setswitchinterval(min(switch, 5e-4))
    try:
        while (plan := pickle.loads(store.queue_pop(f"{prefix}/plan/{me}"))) is not None:
            if isinstance(plan, str):
                raise RuntimeError(f"the serving scheduler failed on rank 0: {plan}")
            runner.run(plan)
            if runner.leader:
                store.queue_push(f"{prefix}/done", pickle.dumps(replica))
    finally:
        sys.setswitchinterval(switch)
        if thread is not None:
            thread.join()
    runner.finish()
    dist.barrier()
    return runner.record


def _schedule(scheduler: Scheduler, store: Any, replicas: list[list[int]], prefix: str, t0: float,
              arrivals: list[float]) -> None:
    """The scheduler thread: plans each idle replica and waits for reports (and ticks: each arrival, and
    every ``IDLE_S / 2``, from a timer thread, so that the wait needs no timeout); ends with a None plan
    on every rank (an error's text when it fails, so every rank raises rather than waits)."""
    def publish(replica: int, plan: Any) -> None:
        for rank in replicas[replica]:
            store.queue_push(f"{prefix}/plan/{rank}", pickle.dumps(plan))
    stop = threading.Event()
    timer = threading.Thread(target=_ticks, args=(store.clone(), f"{prefix}/done", arrivals, t0, stop), daemon=True)
    timer.start()
    try:
        _schedule_loop(scheduler, store, len(replicas), f"{prefix}/done", t0, publish)
        last: Any = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        last = f"{type(exc).__name__}: {exc}"
    stop.set()
    timer.join()
    for replica in range(len(replicas)):
        publish(replica, last)


def _schedule_loop(scheduler: Scheduler, store: Any, replicas: int, key: str, t0: float, publish: Any) -> None:
    busy, quiet = [False] * replicas, [0.0] * replicas  # running a plan; when each was last given one
    while True:
        now = time.perf_counter() - t0
        scheduler.arrive(now)
        if scheduler.finished:
            return
        for replica in (r for r in range(replicas) if not busy[r]):
            step = scheduler.plan(replica)
            if step or now - quiet[replica] >= IDLE_S:
                publish(replica, step)
                busy[replica], quiet[replica] = True, now
        reports = [pickle.loads(store.queue_pop(key))]  # a replica's report or a tick
        reports += [pickle.loads(store.queue_pop(key)) for _ in range(store.queue_len(key))]
        for replica in (r for r in reports if r >= 0):
            scheduler.done(replica)
            busy[replica] = False


def _ticks(store: Any, key: str, arrivals: list[float], t0: float, stop: threading.Event) -> None:
    """Push a tick (-1) on the scheduler's queue at each arrival and at least every ``IDLE_S / 2``."""
    pending = deque(arrivals)
    while True:
        now = time.perf_counter() - t0
        while pending and pending[0] <= now:
            pending.popleft()
        if stop.wait(min(pending[0] - now, IDLE_S / 2) if pending else IDLE_S / 2):
            return
        store.queue_push(key, pickle.dumps(-1))


def _input_error(serving: ServingModule, requests: list[ServeRequest], replicas: list[list[int]],
                 roles: list[str], config: EngineConfig, replica: int) -> str:
    """What keeps the engine from starting ("" if nothing); the same on every rank but this rank's place."""
    if replica < 0 or sorted(r for ranks in replicas for r in ranks) != list(range(dist.get_world_size())):
        return f"replicas {replicas} must hold every rank of the world once"
    if len(roles) != len(replicas) or len({len(ranks) for ranks in replicas}) != 1:
        return f"give one role per replica and replicas of one size; got roles {roles} for replicas {replicas}"
    if sorted(serving.device_mesh.mesh.flatten().tolist()) != sorted(replicas[replica]):
        return f"this rank's module runs on ranks {serving.device_mesh.mesh.flatten().tolist()}, its replica is " \
               f"{replicas[replica]}"
    if not requests or any(not r.prompt for r in requests):
        return "serve takes at least one request, each with a non-empty prompt"
    missing = [name for name in config.cache_buffers if name not in dict(serving.decode_module.named_buffers())]
    if missing or not config.cache_buffers:
        return f"cache_buffers {missing or '()'} are not buffers of the serving module"
    return ""


class _Runner:
    """One rank's execution of the plans: its replica's steps and its side of the transfers."""

    def __init__(self, serving: ServingModule, requests: list[ServeRequest], replicas: list[list[int]],
                 replica: int, config: EngineConfig) -> None:
        self.serving, self.requests, self.replicas, self.config = serving, requests, replicas, config
        self.replica = replica
        self.position = replicas[replica].index(dist.get_rank())  # tp index: the same shard on every replica
        self.leader = self.position == 0
        buffers = dict(serving.decode_module.named_buffers())
        self.caches = [buffers[name] for name in config.cache_buffers]
        self.record = EngineRecord(replica=replica)
        self.t0 = 0.0
        self.plans = 0
        self.last_step = (-2, 0.0)  # (plan, end) of this replica's last step
        self.sending: list[tuple[dist.Work, torch.Tensor]] = []  # isends in flight, their buffers kept

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, plan: ReplicaStep) -> None:
        for transfer in plan.send:
            self._send(transfer)
        for transfer in plan.receive:
            self._receive(transfer)
        if plan.decode or plan.prefill:
            self._step(plan)
        self.plans += 1

    def finish(self) -> None:
        """Wait for the caches sent (each received by now: every request has finished)."""
        for work, _ in self.sending:
            work.wait()
        self.sending = []

    def _emit(self, request: int, token: int, at: float) -> None:
        self.record.tokens.setdefault(request, []).append(token)
        if self.leader:
            self.record.token_s.setdefault(request, []).append(at)

    def _step(self, step: ReplicaStep) -> None:
        start = self.now()
        produced: list[tuple[int, int]] = []
        if step.decode:
            produced += self._decode(step.decode)
        for request, slot, first, tokens in step.prefill:
            token = self._prefill(request, slot, first, tokens)
            if token is not None:
                produced.append((request, token))
        end = self.now()
        for request, token in produced:  # a step's tokens reach the user when it ends
            self._emit(request, token, end)
        if self.leader and self.last_step[0] == self.plans - 1:
            self.record.gaps_s.append(start - self.last_step[1])
        self.last_step = (self.plans, end)
        if self.leader:
            calls = sum(-(-t // self.config.chunk) for *_, t in step.prefill)
            self.record.steps.append((len(step.decode), sum(t for *_, t in step.prefill), calls, end - start))

    def _decode(self, rows: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """One decode call over every slot: the requests' rows at their slots; the other slots write a
        throwaway key at their last position, which their own request (if any) writes before reading."""
        slots = self.config.slots
        tokens = torch.full((slots, 1), self.config.pad_token, dtype=torch.long)
        positions = torch.full((slots, 1), self.config.max_len - 1, dtype=torch.long)
        for request, slot, position in rows:
            tokens[slot, 0], positions[slot, 0] = self.record.tokens[request][-1], position
        start = time.perf_counter()
        logits = whole(self.serving.decode(tokens, positions, torch.arange(slots)))[:, -1]
        if self.leader:
            self.record.decode_calls_s.append(time.perf_counter() - start)
        return [(request, int(logits[slot].argmax())) for request, slot, _ in rows]

    def _prefill(self, request: int, slot: int, first: int, count: int) -> int | None:
        """Prefill ``count`` prompt tokens from position ``first`` in compiled chunks; the first token
        if they end the prompt. A chunk's padding writes positions no real row reads before its own
        token is written there (as ``generate`` pads: at most the first position after the prompt)."""
        prompt, chunk = self.requests[request].prompt, self.config.chunk
        last = first + count
        logits = torch.empty(0)
        for start in range(first, last, chunk):
            real = prompt[start:min(start + chunk, last)]
            tokens = torch.tensor([real + [self.config.pad_token] * (chunk - len(real))])
            positions = torch.tensor([[min(p, len(prompt)) for p in range(start, start + chunk)]])
            began = time.perf_counter()
            logits = whole(self.serving.prefill(tokens, positions, torch.tensor([slot])))[0, len(real) - 1]
            if self.leader:
                self.record.prefill_calls_s.append(time.perf_counter() - began)
        return int(logits.argmax()) if last == len(prompt) else None

    def _peer(self, replica: int) -> int:
        return self.replicas[replica][self.position]

    def _send(self, transfer: Transfer) -> None:
        meta = torch.tensor([transfer.request, transfer.length, self.record.tokens[transfer.request][-1]])
        rows = torch.cat([c[transfer.src_slot, :transfer.length].flatten() for c in self.caches])
        peer = self._peer(transfer.dst)
        for tag, tensor in enumerate((meta, rows)):
            self.sending.append((dist.isend(tensor, peer, tag=2 * transfer.request + tag), tensor))

    def _receive(self, transfer: Transfer) -> None:
        began = self.now()
        peer = self._peer(transfer.src)
        meta = torch.empty(3, dtype=torch.long)
        dist.recv(meta, peer, tag=2 * transfer.request)
        request, length, first = meta.tolist()
        if (request, length) != (transfer.request, transfer.length):
            raise RuntimeError(f"rank {dist.get_rank()} expected request {transfer.request}'s cache ({transfer}) "
                               f"from rank {peer}, got request {request}'s of length {length}")
        sizes = [c[0, :length].numel() for c in self.caches]
        rows = torch.empty(sum(sizes), dtype=self.caches[0].dtype)
        dist.recv(rows, peer, tag=2 * transfer.request + 1)
        slot = transfer.dst_slot
        for cache, part in zip(self.caches, rows.split(sizes)):
            cache[slot, :length] = part.view_as(cache[slot, :length])
        end = self.now()
        self._emit(request, first, end)
        if self.leader:
            self.record.transfers.append((length, end - began))
