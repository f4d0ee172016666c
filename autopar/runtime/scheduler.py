"""The serving engine's scheduler: which request each replica admits, prefills and decodes next.

One scheduler plans the whole deployment (every replica, aggregated or disaggregated) on one rank; the
engine (``runtime.engine``) hands each plan to the ranks of its replica, so they run the same steps and
replicas agree on every hand-off. Each replica is planned on its own, when its previous step is done
(``done``, then ``plan``), so replicas run at their own pace as the simulator's do. Its policies are the
simulator's (``autopar.serving.simulator``), so a measured run and its simulation differ only where
time differs:

- routing: an arrived request goes to the replica of its pool with the least outstanding work (tokens
  still to prefill or produce there), lowest index on ties; so does a prefilled request to the decode pool;
- admission: strict FCFS per replica, into a free cache slot (a slot holds a whole request);
- a step (chunked prefill, Sarathi-Serve): one decode token for every running request past its prefill,
  then prefill chunks in admission order filling ``token_budget`` less the decodes;
- disaggregated: a request whose prefill is done is routed to a decode replica; its prefill replica sends
  its cache (with the first token) at the start of its next plan, which frees the slot (the send buffer
  keeps the rows); the decode replica receives it when it admits the request (FCFS, a free slot), at the
  start of a plan, and decodes it in that plan's step. (The simulator keeps the prefill slot until the
  decode replica pulls the cache; here the rows wait in the send buffer instead.)

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
    """What one replica runs next: its transfers, then a decode step, then prefill chunks."""

    receive: list[Transfer] = field(default_factory=list)
    """Caches to receive first (a decode replica), each into its slot."""
    send: list[Transfer] = field(default_factory=list)
    """Caches to send first (a prefill replica): requests prefilled by its previous steps."""
    decode: list[tuple[int, int, int]] = field(default_factory=list)
    """(request, slot, position of the token fed) of every request decoding a token."""
    prefill: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(request, slot, first position, tokens) of every request prefilling a chunk, in admission order."""

    def __bool__(self) -> bool:
        return bool(self.receive or self.send or self.decode or self.prefill)


@dataclass(kw_only=True, eq=False)
class _Req:
    index: int
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0
    generated: int = 0
    slot: int = -1
    holder: int = -1


@dataclass(kw_only=True, eq=False)
class _Replica:
    index: int
    role: str
    free: list[int]
    queue: deque[_Req] = field(default_factory=deque)
    running: list[_Req] = field(default_factory=list)
    to_send: list[Transfer] = field(default_factory=list)
    load: int = 0
    planned: ReplicaStep | None = None

    def work_of(self, req: _Req) -> int:
        return {"serve": req.prompt + req.output - 1, "prefill": req.prompt, "decode": req.output}[self.role]


class Scheduler:
    """Plans the steps of a deployment's replicas (see the module docstring): ``roles`` of the replicas
    ("serve" for aggregated ones, or "prefill" and "decode"), ``slots`` cache slots per replica of
    ``max_len`` positions, ``token_budget`` tokens per step; requests as (arrival s, prompt, output tokens).
    Requests arrive with ``arrive``; an idle replica is planned with ``plan``; ``done`` counts its step run."""

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
        self.done_requests = 0

    @property
    def finished(self) -> bool:
        """Every request has produced all its tokens."""
        return self.done_requests == len(self.reqs)

    def next_arrival(self) -> float | None:
        """When the next request arrives (None: all have)."""
        return self.reqs[self.arrived].arrival if self.arrived < len(self.reqs) else None

    def arrive(self, now: float) -> None:
        """Route the requests arrived by ``now`` (s from the start)."""
        while self.arrived < len(self.reqs) and self.reqs[self.arrived].arrival <= now:
            req = self.reqs[self.arrived]
            self.arrived += 1
            self._route(req, "prefill" if self.replicas[0].role != "serve" else "serve")

    def plan(self, replica: int) -> ReplicaStep:
        """The idle ``replica``'s next step (empty: nothing to do until something arrives or is done)."""
        rep = self.replicas[replica]
        assert rep.planned is None, f"replica {replica} is still running a step"
        step = ReplicaStep(send=rep.to_send)
        rep.to_send = []
        for transfer in step.send:  # the rows are in the send buffer: the slot is free for this step
            rep.free.append(transfer.src_slot)
        while rep.queue and rep.free:  # FCFS; a decode replica pulls the cache of what it admits
            req = rep.queue.popleft()
            if rep.role == "decode":
                step.receive.append(Transfer(request=req.index, src=req.holder, src_slot=req.slot, dst=replica,
                                             dst_slot=rep.free[0], length=req.prompt))
            req.slot = rep.free.pop(0)
            rep.running.append(req)
        self._fill(rep, step)
        rep.planned = step or None  # an empty step changed nothing: the replica stays idle
        return step

    def _fill(self, rep: _Replica, step: ReplicaStep) -> None:
        """The step's decodes (every running request past its prefill with tokens to go: on a decode
        replica, those received by this plan too) and prefill chunks (the budget left, in admission order)."""
        if rep.role != "prefill":
            step.decode = [(r.index, r.slot, r.prompt + r.generated - 1) for r in rep.running
                           if r.prefilled == r.prompt and r.generated < r.output]
        budget = self.token_budget - len(step.decode)
        for req in (r for r in rep.running if r.prefilled < r.prompt):
            chunk = min(req.prompt - req.prefilled, budget)
            if chunk <= 0:
                break
            step.prefill.append((req.index, req.slot, req.prefilled, chunk))
            budget -= chunk

    def done(self, replica: int) -> None:
        """Count ``replica``'s planned step as run: caches received, tokens produced, requests finished,
        prefilled ones routed to the decode pool (their caches sent with the replica's next plan)."""
        rep = self.replicas[replica]
        step, rep.planned = rep.planned, None
        if step is None:
            return  # an empty plan (the engine sends them now and then to idle replicas)
        for transfer in step.receive:
            req = self.reqs[transfer.request]
            rep.load -= 1  # the first token, produced by prefill, is delivered with the cache
            self._maybe_finish(rep, req)
        for request, *_ in step.decode:
            req = self.reqs[request]
            req.generated += 1
            rep.load -= 1
            self._maybe_finish(rep, req)
        for request, slot, _, chunk in step.prefill:
            req = self.reqs[request]
            req.prefilled += chunk
            rep.load -= chunk
            if req.prefilled < req.prompt:
                continue
            req.generated = 1  # prefill's last chunk yields the first token
            if rep.role == "serve":
                self._maybe_finish(rep, req)
                continue
            rep.running.remove(req)  # its slot is kept until the cache is sent
            req.holder = replica
            dst = self._route(req, "decode")
            rep.to_send.append(Transfer(request=request, src=replica, src_slot=slot, dst=dst, dst_slot=-1,
                                        length=req.prompt))

    def _route(self, req: _Req, role: str) -> int:
        rep = min((r for r in self.replicas if r.role == role), key=lambda r: (r.load, r.index))
        rep.queue.append(req)
        rep.load += rep.work_of(req)
        return rep.index

    def _maybe_finish(self, rep: _Replica, req: _Req) -> None:
        if req.generated < req.output:
            return
        rep.running.remove(req)
        rep.free.append(req.slot)
        self.done_requests += 1
