"""The serving engine's scheduler: which request each replica admits, prefills and decodes next.

One scheduler plans the whole deployment (every replica, aggregated or disaggregated), on one rank,
iteration by iteration; the engine (``runtime.engine``) broadcasts each plan to every rank, so the
ranks of a replica run the same steps and the replicas agree on every hand-off. Its policies are the
simulator's (``autopar.serving.simulator``), so a measured run and its simulation differ only where
time differs:

- routing: an arrived request goes to the replica of its pool with the least outstanding work (tokens
  still to prefill or produce there), lowest index on ties; so does a prefilled request to the decode pool;
- admission: strict FCFS per replica, into a free cache slot (a slot holds a whole request);
- a step (chunked prefill, Sarathi-Serve): one decode token for every running request past its prefill,
  then prefill chunks in admission order filling ``token_budget`` less the decodes;
- disaggregated: a prefill replica keeps a request's slot after its prefill until the decode replica it
  is routed to admits it; the KV cache then moves at the start of the next iteration, the first token
  with it, and the request decodes in that iteration's decode step.

Scheduling needs only lengths and the clock, never token values (outputs have fixed lengths).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from autopar.errors import InputError


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One request's KV cache moving from a prefill replica's slot to a decode replica's slot."""

    request: int
    """The request's index."""
    src: int
    """Prefill replica."""
    src_slot: int
    """Its cache slot there."""
    dst: int
    """Decode replica."""
    dst_slot: int
    """The slot it is written into there."""
    length: int
    """Cache positions sent: the prompt's."""


@dataclass(kw_only=True)
class ReplicaStep:
    """What one replica runs in an iteration: a decode step, then prefill chunks."""

    decode: list[tuple[int, int, int]] = field(default_factory=list)
    """(request, slot, position of the token fed) of every request decoding a token."""
    prefill: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(request, slot, first position, tokens) of every request prefilling a chunk, in admission order."""

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


@dataclass(kw_only=True)
class Iteration:
    """One iteration of the deployment: transfers first, then each replica's step."""

    steps: dict[int, ReplicaStep]
    """Replica -> its step (replicas with nothing to do are left out)."""
    transfers: list[Transfer] = field(default_factory=list)
    """KV caches moved before the steps."""
    finished: bool = False
    """Every request is done: the engine stops."""


@dataclass(kw_only=True, eq=False)
class _Req:
    index: int
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0
    generated: int = 0
    slot: int = -1


@dataclass(kw_only=True, eq=False)
class _Replica:
    index: int
    role: str
    free: list[int]
    queue: deque[_Req] = field(default_factory=deque)
    running: list[_Req] = field(default_factory=list)
    held: list[_Req] = field(default_factory=list)
    load: int = 0

    def work_of(self, req: _Req) -> int:
        return {"serve": req.prompt + req.output - 1, "prefill": req.prompt, "decode": req.output}[self.role]


class Scheduler:
    """Plans iterations of a deployment (see the module docstring): ``roles`` of the replicas ("serve"
    for aggregated ones, or "prefill" and "decode"), ``slots`` cache slots per replica of ``max_len``
    positions, ``token_budget`` tokens per step; requests as (arrival s, prompt tokens, output tokens)."""

    def __init__(self, requests: list[tuple[float, int, int]], roles: list[str], *, slots: int, max_len: int,
                 token_budget: int) -> None:
        if sorted(set(roles)) not in (["serve"], ["decode", "prefill"]):
            raise InputError(f"replica roles must be all 'serve' or 'prefill' and 'decode' ones, got {roles}")
        if token_budget < slots:
            raise InputError(f"token_budget ({token_budget}) must be >= slots ({slots}): a full batch's decodes "
                             "must fit one step")
        self.reqs = [_Req(index=i, arrival=a, prompt=p, output=o) for i, (a, p, o) in enumerate(requests)]
        for r in self.reqs:  # the last token fed sits at prompt + output - 2; prefill's padding at prompt
            if r.prompt < 1 or r.output < 1 or r.prompt + max(r.output - 1, 1) > max_len:
                raise InputError(f"request {r.index} (prompt {r.prompt}, output {r.output} tokens) does not fit a "
                                 f"cache slot of {max_len} positions")
        if any(b.arrival < a.arrival for a, b in zip(self.reqs, self.reqs[1:])):
            raise InputError("requests must be given in arrival order")
        self.replicas = [_Replica(index=i, role=role, free=list(range(slots))) for i, role in enumerate(roles)]
        self.token_budget = token_budget
        self.arrived = 0
        self.done = 0
        self.last: Iteration | None = None

    def next_arrival(self) -> float | None:
        """When the next request arrives (None: all have)."""
        return self.reqs[self.arrived].arrival if self.arrived < len(self.reqs) else None

    def plan(self, now: float) -> Iteration:
        """The next iteration at ``now`` (s from the start), the previous one counted as done. Its
        ``steps`` and ``transfers`` are empty when nothing can run before the next arrival."""
        if self.last is not None:
            self._complete(self.last)
        while self.arrived < len(self.reqs) and self.reqs[self.arrived].arrival <= now:
            req = self.reqs[self.arrived]
            self.arrived += 1
            self._route(req, "prefill" if self.replicas[0].role != "serve" else "serve")
        transfers = self._transfers()
        for rep in self.replicas:
            self._admit(rep)
        steps = {rep.index: step for rep in self.replicas if (step := self._step(rep))}
        self.last = Iteration(steps=steps, transfers=transfers, finished=self.done == len(self.reqs))
        return self.last

    def _route(self, req: _Req, role: str) -> None:
        rep = min((r for r in self.replicas if r.role == role), key=lambda r: (r.load, r.index))
        rep.queue.append(req)
        rep.load += rep.work_of(req)

    def _admit(self, rep: _Replica) -> None:
        """FCFS into free slots (a decode replica's admissions are pulled by ``_transfers``)."""
        while rep.role != "decode" and rep.queue and rep.free:
            req = rep.queue.popleft()
            req.slot = rep.free.pop(0)
            rep.running.append(req)

    def _transfers(self) -> list[Transfer]:
        """Decode replicas admit what waits for them (FCFS, into free slots), pulling each cache; the
        prefill replica's slot is free again once it is sent (at the start of this iteration)."""
        moves = []
        for rep in self.replicas:
            while rep.role == "decode" and rep.queue and rep.free:
                req = rep.queue.popleft()
                holder = next(r for r in self.replicas if req in r.held)
                holder.held.remove(req)
                moves.append(Transfer(request=req.index, src=holder.index, src_slot=req.slot, dst=rep.index,
                                      dst_slot=rep.free[0], length=req.prompt))
                holder.free.append(req.slot)
                req.slot = rep.free.pop(0)
                rep.running.append(req)
                rep.load -= 1  # the first token, produced by prefill, is delivered with the cache
                self._maybe_finish(rep, req)
        return moves

    def _step(self, rep: _Replica) -> ReplicaStep:
        decodes = [r for r in rep.running if r.prefilled == r.prompt] if rep.role != "prefill" else []
        step = ReplicaStep(decode=[(r.index, r.slot, r.prompt + r.generated - 1) for r in decodes])
        budget = self.token_budget - len(decodes)
        for req in (r for r in rep.running if r.prefilled < r.prompt):
            chunk = min(req.prompt - req.prefilled, budget)
            if chunk <= 0:
                break
            step.prefill.append((req.index, req.slot, req.prefilled, chunk))
            budget -= chunk
        return step

    def _complete(self, it: Iteration) -> None:
        """Count an iteration's work as done: tokens produced, requests finished, prefilled ones routed."""
        for index, step in it.steps.items():
            rep = self.replicas[index]
            for request, *_ in step.decode:
                req = self.reqs[request]
                req.generated += 1
                rep.load -= 1
                self._maybe_finish(rep, req)
            for request, _, _, chunk in step.prefill:
                req = self.reqs[request]
                req.prefilled += chunk
                rep.load -= chunk
                if req.prefilled == req.prompt:
                    req.generated = 1  # prefill's last chunk yields the first token
                    if rep.role == "prefill":
                        rep.running.remove(req)
                        rep.held.append(req)  # its slot is kept until the cache is sent
                        self._route(req, "decode")
                    else:
                        self._maybe_finish(rep, req)

    def _maybe_finish(self, rep: _Replica, req: _Req) -> None:
        if req.generated < req.output:
            return
        rep.running.remove(req)
        rep.free.append(req.slot)
        self.done += 1
