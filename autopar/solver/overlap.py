"""Overlap windows of repeated blocks: prefetched parameter gathers run under the compute
of the neighbouring block, priced per window as the runtime runs them
(``autopar.passes.prefetch_gathers``, ``autopar.runtime.regather``).

A container's blocks ``layers.0 .. layers.L-1`` (``memory.options.block_of``, in graph
order) give, with eff = ``HardwareProfile.grad_sync_overlap``:
- forward: block 0's gathers G_0 wait in full (nothing runs before them to hide under);
  for k >= 1, window k exposes max(0, G_k - eff x F_{k-1}): block k's gathers are issued
  as block k-1 starts computing its forward (F_{k-1} seconds);
- backward (ZeRO-3): block k's regathers R_k are issued as block k+1's backward (B_{k+1}
  seconds) starts, so window k exposes max(0, R_k - eff x B_{k+1}), whatever block k+1
  does with its own parameters (gathers them again, holds them from forward as when only
  the first blocks gather again, ``autopar.memory.regather``, or keeps them replicated):
  the runtime's trigger is a hook on the gradients of the values block k+1 computes for
  later code, which needs none of its parameters. The last block's regathers wait in full.
Windowed are a parameter's gathers whose parameter has a single use, by an op of a block
instance that does not recompute (checkpointed blocks replay their gathers in their
recompute), and whose reshard is one all-gather (``prefetched``); every other collective
is priced in full. The gradients' reduce-scatters, which the runtime leaves running beside
the rest of backward (``runtime.ops``), are not windowed here: in per-block windows
(S_k + R_{k-1} beside B_k) they let a free plan hide most of ZeRO's traffic and HiGHS then
branched for 40 s instead of 3.4 (Llama, 32 layers, hidden 4096, 64 H100s). They join the
gradient buckets' one window over the whole backward instead (``grad_terms``: the last
micro-batch's, for parameters read once; ``EdgeCost.unwaited``), a single row. Seconds are
per step: every micro-batch runs its windows. The same backward compute may hide a
bucket or reduce-scatter and a prefetched regather, an optimistic approximation where a
plan has both.

Memory: in backward a block's prefetched regathers are alive while the block after it
runs, so the peak holds one more block's gathered ZeRO-3 parameters: the largest over the
blocks prefetched, every block that gathers again but a container's last (``prefetched_bytes``).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from autopar.cost.collectives import ALL_GATHER, CollectiveCall, call_time, collective_time
from autopar.cost.model import CostContext, EdgeCost, NodeCost, step_repeats
from autopar.rules.strategy import Strategy
from autopar.problem.folding import Folding
from autopar.problem.graph import price_edge
from autopar.problem.block_paths import block_of
from autopar.solver.milp import INF, MEMORY, RESHARDS, SCALE, WINDOWS, Model
from autopar.problem.nodes import OP, PARAM, PlanGraph
from autopar.memory.regather import regathering_blocks
from autopar.solver.sharing import EdgeKey

WindowUse = tuple[str, int]
"""(consumer node, argument index) of a windowed parameter's one use."""


def windowed_params(graph: PlanGraph) -> dict[str, WindowUse]:
    """Parameter node -> its one use, for parameters whose gathers may be windowed."""
    uses: dict[str, list[WindowUse]] = defaultdict(list)
    for name in graph.order:
        for arg, (src, _) in enumerate(graph.nodes[name].args):
            if graph.nodes[src].kind == PARAM:
                uses[src].append((name, arg))
    out: dict[str, WindowUse] = {}
    for param, found in uses.items():
        if len(found) == 1:
            consumer = graph.nodes[found[0][0]]
            if block_of(consumer.module) is not None and not consumer.recompute:
                out[param] = found[0]
    return out


def prefetched(calls: Iterable[CollectiveCall], ctx: CostContext) -> CollectiveCall | None:
    """The one all-gather a prefetch issues, when the reshard is exactly that (else None)."""
    real = [c for c in calls if ctx.mesh.shape[c.mesh_dim] > 1]
    return real[0] if len(real) == 1 and real[0].kind == ALL_GATHER else None


@dataclass(frozen=True)
class EdgeWindows:
    """What of one windowed edge's price its windows take, per step."""

    gather_s: float
    """Seconds of its forward all-gather (0: not prefetched)."""
    regather_s: float
    """Seconds of its backward regather (ZeRO-3; 0: none, or not prefetched)."""
    regather_bytes: float
    """Bytes of the gathered copy a backward prefetch holds (0 without a regather)."""


def edge_windows(edge: EdgeCost, ctx: CostContext) -> EdgeWindows:
    runs = step_repeats(ctx)
    gather, regather = prefetched(edge.forward, ctx), prefetched(edge.recompute, ctx)
    return EdgeWindows(collective_time(gather, ctx.mesh) * runs if gather else 0.0,
                       collective_time(regather, ctx.mesh) * runs if regather else 0.0,
                       float(regather.nbytes) if regather else 0.0)


def prefetched_blocks(seq: list[str], again: set[str]) -> set[str]:
    """The blocks of ``seq`` whose regathers are prefetched: those gathering ``again`` that a
    block follows (its backward start issues them, ``autopar.runtime.regather``)."""
    return {b for b in seq[:-1] if b in again}


def block_sequences(graph: PlanGraph) -> list[list[str]]:
    """Each container's block instances in graph order (``[['layers.0', 'layers.1'], ...]``)."""
    containers: dict[str, dict[str, None]] = {}  # ordered sets
    for name in graph.order:
        block = block_of(graph.nodes[name].module)
        if block is not None:
            containers.setdefault(block.rsplit(".", 1)[0], {})[block] = None
    return [list(blocks) for blocks in containers.values()]


def exposed(comm_s: float, compute_s: float, eff: float) -> float:
    """Seconds of one window's communication the step waits for."""
    return max(0.0, comm_s - eff * compute_s)


@dataclass(frozen=True, kw_only=True)
class WindowPrices:
    """A plan's windowed communication (``plan_windows``)."""

    windowed_s: float
    """Seconds of the gathers and regathers that run in windows."""
    exposed_s: float
    """Of those, the seconds the step waits for (the rest is hidden under compute)."""
    prefetched_bytes: float
    """Peak bytes the backward prefetch adds: one block's gathered ZeRO-3 parameters."""
    waited: dict[tuple[str, str], float] = field(default_factory=dict)
    """(parameter node, 'forward' for its gather or 'backward' for its regather) -> the share
    of that windowed collective the step waits for: its window's exposed seconds over all of
    the window's seconds, one share for each collective of the window (``result.trace``)."""


def plan_windows(graph: PlanGraph, chosen: dict[str, Strategy], costs: dict[str, NodeCost], ctx: CostContext
                 ) -> WindowPrices:
    """The windows of a chosen plan (``costs``: each node's chosen cost), as the ILP's
    ``OverlapTerms`` prices them."""
    eff = ctx.mesh.hardware.grad_sync_overlap if ctx.train else 0.0
    gather: dict[str, float] = defaultdict(float)
    regather: dict[str, float] = defaultdict(float)
    held: dict[str, float] = defaultdict(float)
    members: dict[str, list[tuple[str, str]]] = defaultdict(list)  # block -> its windowed (param, phase)
    calls: dict[tuple[str, str, int], float] = {}  # (block, phase, mesh dim) -> a group's call, once
    for param, (consumer, arg) in windowed_params(graph).items():
        edge = price_edge(graph, param, 0, consumer, arg, chosen[param], chosen[consumer], ctx)
        w = edge_windows(edge, ctx)
        block = block_of(graph.nodes[consumer].module)
        assert block is not None
        gather[block] += w.gather_s
        regather[block] += w.regather_s
        held[block] += w.regather_bytes
        members[block] += [(param, phase) for phase, t in (("forward", w.gather_s), ("backward", w.regather_s)) if t]
        for phase, c in (("forward", prefetched(edge.forward, ctx)), ("backward", prefetched(edge.recompute, ctx))):
            if c is not None and c.grouped:
                calls[(block, phase, c.mesh_dim)] = call_time(c.kind, c.mesh_dim, ctx.mesh) * step_repeats(ctx)
    for (block, phase, _), seconds in calls.items():  # its block's window holds a group's call too
        (gather if phase == "forward" else regather)[block] += seconds
    forward: dict[str, float] = defaultdict(float)
    backward: dict[str, float] = defaultdict(float)
    for name in graph.order:
        node = graph.nodes[name]
        block = block_of(node.module)
        if node.kind == OP and block is not None:
            cost = costs[name]
            forward[block] += cost.forward
            backward[block] += cost.time - cost.forward
    total = peak = 0.0
    waits: dict[tuple[str, str], float] = {}  # (block, phase) -> the window's exposed seconds
    again = regathering_blocks(graph)
    for seq in block_sequences(graph):
        total += sum(gather[b] + regather[b] for b in seq)
        waits[(seq[0], "forward")] = gather[seq[0]]
        waits.update({(seq[k], "forward"): exposed(gather[seq[k]], forward[seq[k - 1]], eff)
                      for k in range(1, len(seq))})
        ahead = prefetched_blocks(seq, again)
        waits.update({(b, "backward"): exposed(regather[b], backward[seq[k + 1]], eff) if b in ahead else regather[b]
                      for k, b in enumerate(seq)})
        peak = max([peak, *(held[b] for b in ahead)])
    windowed = {"forward": gather, "backward": regather}
    waited = {(param, phase): waits[(block, phase)] / windowed[phase][block]
              for block, found in members.items() for param, phase in found}
    return WindowPrices(windowed_s=total, exposed_s=sum(waits.values()), prefetched_bytes=peak, waited=waited)



class OverlapTerms:
    """The windows in the ILP, priced as ``plan_windows`` prices a plan.

    A windowed edge's gather and regather seconds leave the objective (``edge``) and come
    back per block: the first block's gathers and the regathers no prefetch hides (the last
    block's, ``prefetched_blocks``) in full, every other window as a variable
    e >= comm - eff x compute, e >= 0. Folded blocks share their
    variables, so their windows are identical rows: one row serves them all, its e weighted
    by their number. The memory row gets t >= each prefetched block's regathered bytes.
    """

    def __init__(self, model: Model, graph: PlanGraph, folding: Folding, ctx: CostContext, *, priced: bool) -> None:
        self.model, self.graph, self.folding = model, graph, folding
        self.eff = ctx.mesh.hardware.grad_sync_overlap if priced and ctx.train else 0.0
        self.ctx = ctx
        rep = folding.representative
        self.uses = windowed_params(graph)
        self.keys = {(rep[p], 0, rep[c], arg) for p, (c, arg) in self.uses.items()}
        self.gather: dict[EdgeKey, dict[int, float]] = defaultdict(dict)
        """Windowed edge -> variable -> seconds (x SCALE) of one real edge's gather it selects."""
        self.regather: dict[EdgeKey, dict[int, float]] = defaultdict(dict)
        self.held: dict[EdgeKey, dict[int, float]] = defaultdict(dict)
        """Windowed edge -> variable -> bytes a backward prefetch of it holds."""
        self.calls: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
        """(representative block, 'forward' or 'backward') -> a grouped gather's call variable (``group_terms``)
        -> seconds (x SCALE) of one instance's call: the window holds it as it holds its members."""

    def group_call(self, block: str, phase: str, y: int, seconds: float, instances: int) -> None:
        """Group call ``y`` (``instances`` blocks alike, each ``seconds``) of ``block``'s gathers
        (``phase`` 'forward') or regathers ('backward'): out of the objective, into its windows."""
        if self.eff:
            self.model.add_cost(y, -instances * seconds, RESHARDS)  # to its windows, as its members'
            self.calls[(block, phase)][y] = seconds

    def edge(self, key: EdgeKey, count: int, price: Callable[[int, int], EdgeCost]
             ) -> Callable[[int, int, int], None] | None:
        """For a windowed edge (``count`` real tensors): ``note(j, a, b)`` when variable j selects
        producer group a into consumer group b, whose reshard is ``price(a, b)``."""
        if key not in self.keys:
            return None
        cache: dict[tuple[int, int], EdgeWindows] = {}

        def note(j: int, a: int, b: int) -> None:
            if (a, b) not in cache:
                cache[(a, b)] = edge_windows(price(a, b), self.ctx)
            w = cache[(a, b)]
            if self.eff:  # zeros too: a window's least communication is the sum of its edges' least
                self.model.add_cost(j, -count * (w.gather_s + w.regather_s) * SCALE, RESHARDS)  # to its window
                self.gather[key][j] = w.gather_s * SCALE
                self.regather[key][j] = w.regather_s * SCALE
            if w.regather_bytes:
                self.held[key][j] = w.regather_bytes
        return note

    def add_rows(self, x: dict[str, list[int]]) -> None:
        """The window rows and the boundary blocks' terms (nothing without overlap)."""
        if not self.eff or not any(self.gather.values()) and not any(self.regather.values()):
            return
        sig = self._signatures()
        again = regathering_blocks(self.graph)
        windows: Counter[tuple[str, tuple, tuple]] = Counter()
        first: dict[str, str] = {}  # signature -> a block having it
        for seq in block_sequences(self.graph):
            for b in seq:
                first.setdefault(sig[b], b)
            self._add_to_objective(self._comm(self.gather, seq[0], "forward"))
            windows.update(("forward", sig[seq[k]], sig[seq[k - 1]]) for k in range(1, len(seq)))
            ahead = prefetched_blocks(seq, again)
            for k, b in enumerate(seq):
                if b in ahead:
                    windows[("backward", sig[b], sig[seq[k + 1]])] += 1
                else:
                    self._add_to_objective(self._comm(self.regather, b, "backward"))
        for (phase, comm_sig, compute_sig), n in windows.items():
            self._add_window(self.gather if phase == "forward" else self.regather, first[comm_sig], phase,
                             self._compute(x, first[compute_sig], phase), n)

    def _add_window(self, terms: dict[EdgeKey, dict[int, float]], block: str, phase: str,
                    compute: tuple[dict[int, float], float, float], n: int) -> None:
        """``n`` windows of ``block``'s communication beside ``compute`` (terms, least, most).
        Where every choice hides it all, nothing; where every choice leaves some exposed, the
        exposed seconds are linear and go straight to the objective; else a row (HiGHS solves
        the fewer rows faster)."""
        comm = self._comm(terms, block, phase)
        least, most = self._comm_range(terms, block, phase)
        seconds, fastest, slowest = compute
        if not comm or self.eff * fastest >= most:
            return
        if least >= self.eff * slowest:
            self._add_to_objective({j: n * w for j, w in comm.items()})
            self._add_to_objective({j: -n * self.eff * w for j, w in seconds.items()})
            return
        e = self.model.var(float(n), integer=False, upper=INF, term=WINDOWS)
        row = {e: 1.0, **{j: -w for j, w in comm.items()}}
        for j, w in seconds.items():
            row[j] = row.get(j, 0.0) + self.eff * w
        self.model.rows.append((row, 0.0, INF))

    def add_memory(self, memory_row: dict[int, float], minimize_memory: bool) -> None:
        """t >= the regathered bytes of each prefetched block; t in the memory row."""
        if not any(self.held.values()):
            return
        sig = self._signatures()
        again = regathering_blocks(self.graph)
        rows: dict[tuple, dict[int, float]] = {}
        for seq in block_sequences(self.graph):
            for b in sorted(prefetched_blocks(seq, again), key=seq.index):
                if sig[b] not in rows:
                    rows[sig[b]] = self._comm(self.held, b, "")
        t = self.model.var(1.0 if minimize_memory else 0.0, integer=False, upper=INF, term=MEMORY)
        memory_row[t] = 1.0
        for held in rows.values():
            if held:
                self.model.rows.append(({t: 1.0, **{j: -v for j, v in held.items()}}, 0.0, INF))

    def _signatures(self) -> dict[str, tuple]:
        """Block -> the representatives of its nodes: blocks alike share every row."""
        rep = self.folding.representative
        members: dict[str, list[str]] = defaultdict(list)
        for name in self.graph.order:
            block = block_of(self.graph.nodes[name].module)
            if block is not None:
                members[block].append(rep[name])
        return {b: tuple(names) for b, names in members.items()}

    def _comm(self, terms: dict[EdgeKey, dict[int, float]], block: str, phase: str) -> dict[int, float]:
        """Variable -> what it adds to ``block``'s windowed terms (one per real edge; ``phase``'s
        group calls of the block, once)."""
        rep = self.folding.representative
        out: dict[int, float] = defaultdict(float)
        represented: set[str] = set()
        for p, c, arg in self._block_uses.get(block, ()):
            for j, w in terms.get((rep[p], 0, rep[c], arg), {}).items():
                out[j] += w
            represented.add(block_of(self.graph.nodes[rep[c]].module) or "")
        for j, w in (j_w for b in represented for j_w in self.calls.get((b, phase), {}).items()):
            out[j] += w
        return {j: w for j, w in out.items() if w}

    def _compute(self, x: dict[str, list[int]], block: str, phase: str) -> tuple[dict[int, float], float, float]:
        """Variable -> seconds (x SCALE) of ``block``'s forward or backward compute it selects,
        and the least and most those seconds can be (each op's fastest or slowest strategy)."""
        rep = self.folding.representative
        out: dict[int, float] = defaultdict(float)
        fastest = slowest = 0.0
        for name in self._block_ops.get(block, ()):
            v = rep[name]
            seconds = [(c.forward if phase == "forward" else c.time - c.forward) * SCALE
                       for c in self.graph.nodes[v].costs]
            fastest += min(seconds)
            slowest += max(seconds)
            for j, w in zip(x[v], seconds):
                out[j] += w
        return dict(out), fastest, slowest

    @functools.cached_property
    def _block_uses(self) -> dict[str | None, list[tuple[str, str, int]]]:
        """Block -> its windowed uses (parameter, consumer, argument), in ``uses``' order."""
        out: dict[str | None, list[tuple[str, str, int]]] = defaultdict(list)
        for p, (c, arg) in self.uses.items():
            out[block_of(self.graph.nodes[c].module)].append((p, c, arg))
        return out

    @functools.cached_property
    def _block_ops(self) -> dict[str, list[str]]:
        """Block -> its op nodes, in graph order."""
        out: dict[str, list[str]] = defaultdict(list)
        for name in self.graph.order:
            node = self.graph.nodes[name]
            block = block_of(node.module) if node.kind == OP else None
            if block is not None:
                out[block].append(name)
        return out

    def _comm_range(self, terms: dict[EdgeKey, dict[int, float]], block: str, phase: str) -> tuple[float, float]:
        """The least and most ``block``'s windowed communication can be (each edge's extremes, a
        group's call none or all)."""
        rep = self.folding.representative
        least = most = 0.0
        represented: set[str] = set()
        for p, c, arg in self._block_uses.get(block, ()):
            values = terms.get((rep[p], 0, rep[c], arg))
            if values:
                least += min(values.values())
                most += max(values.values())
                represented.add(block_of(self.graph.nodes[rep[c]].module) or "")
        most += sum(w for b in represented for w in self.calls.get((b, phase), {}).values())
        return least, most

    def _add_to_objective(self, terms: dict[int, float]) -> None:
        for j, w in terms.items():
            self.model.add_cost(j, w, WINDOWS)
