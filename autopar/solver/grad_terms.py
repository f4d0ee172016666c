"""Gradient synchronization in the ILP: priced once per parameter and per bucket, as it runs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from autopar.cost.buckets import bucket_count
from autopar.cost.collectives import ALL_GATHER, ALL_REDUCE, call_time, grad_placement_at_consumer, transfer_time
from autopar.cost.model import CostContext, EdgeCost, grad_sync_dims, param_sync_calls, zero1_gather_call
from autopar.cost.zero1 import shard_bucket_cap
from autopar.problem.nodes import PARAM, PlanGraph
from autopar.solver.milp import GRAD_SYNC, INF, RESHARDS, SCALE, Model


class GradSyncTerms:
    """The gradient all-reduces, priced per parameter (not per consuming edge) and per bucket.

    y[p, a, d] is 1 when parameter p, stored as placement a, has its gradient reduced on
    mesh dim d: at least one consumer edge sends it back Partial there (``grad_sync_dims``),
    so y >= each edge's indicator of such a pairing. y carries the transfer time of p's
    gradient on d. Per mesh dim, the integer k[d] >= (bytes reduced on d) / bucket size is
    the number of buckets ``gradient_buckets`` cuts them into, each paying a call's fixed cost
    and latency (``call_time``).

    All-reduce buckets run beside backward, so where the hardware hides them
    (``grad_sync_overlap`` > 0) their seconds go into one exposed-time variable instead of
    the objective: e >= (sync seconds) - overlap x (the last micro-batch's backward seconds),
    e >= 0 (``exposed_sync_time`` prices the plan the same way).

    A parameter's gradient reduce-scatter on its edge (ZeRO-2/3: the backward of its gather)
    runs beside backward too (``EdgeCost.unwaited``): the last micro-batch's joins the row
    (``unwaited``), for parameters read once; earlier micro-batches' are priced in full.

    A ZeRO-1 parameter's sync on its ZeRO-1 dim is a reduce-scatter at the optimizer step
    (``cost.zero1``): its own bucket stream, never hidden, with its own variable
    y[p, a, d, RS]. Edges group a parameter's strategies by placement, so a placement and its
    ZeRO-1 twin on d (``Strategy.zero1``) share the edge's selectors: the all-reduce on d is
    owed when a selector is set and the twin is not chosen, the reduce-scatter when it is
    (``_EdgeSync.close``). The all-gathers after the update depend on the strategy alone:
    their transfers are on the parameter's strategies (``PlanNode.comm_times``), their
    per-bucket calls counted by ``add_gather_rows``.
    """

    def __init__(self, model: Model, graph: PlanGraph, ctx: CostContext, mult: dict[str, int],
                 x: dict[str, list[int]], *, priced: bool) -> None:
        self.model, self.graph, self.ctx, self.mult, self.x, self.priced = model, graph, ctx, mult, x, priced
        self.y: dict[tuple[str, object, int, bool], int] = {}
        self.bytes_on: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)  # (kind, dim) -> {y: bytes}
        self.overlap = ctx.mesh.hardware.grad_sync_overlap if priced and ctx.train else 0.0
        self.seconds: dict[int, float] = {}  # sync variable -> objective units it adds, when overlapped
        self.single_use = single_use_params(graph)

    def edge(self, producer: str, groups_p: dict[object, list[int]], keys_c: list, sends_gradient: bool
             ) -> "_EdgeSync":
        """The sync terms of one edge out of ``producer`` (``groups_p``: its strategies by
        placement at this edge); none unless its consumer sends a gradient back."""
        keys_p = list(groups_p)
        node = self.graph.nodes[producer]
        dims: dict[tuple[int, int], frozenset[int]] = {}
        if node.kind == PARAM and sends_gradient and self.ctx.train:
            for a, produced in enumerate(keys_p):
                for b, (required, active) in enumerate(keys_c):
                    grad_in = tuple(grad_placement_at_consumer(r, act) for r, act in zip(required, active))
                    dims[(a, b)] = grad_sync_dims(produced, grad_in, self.ctx.mesh.shape)
        return _EdgeSync(self, producer, groups_p, dims)

    def var(self, producer: str, produced: object, dim: int, scattered: bool = False) -> int:
        """y[p, a, d]: the all-reduce of p's gradient on d, or (``scattered``) its ZeRO-1 reduce-scatter."""
        key = (producer, produced, dim, scattered)
        if key not in self.y:
            node = self.graph.nodes[producer]
            meta = node.outputs[0]
            assert meta is not None
            call, = param_sync_calls(meta, produced, frozenset({dim}), self.ctx,  # type: ignore[arg-type]
                                     dim if scattered else None)
            weight = self.mult[producer] * transfer_time(call, self.ctx.mesh) * SCALE if self.priced else 0.0
            self.y[key] = self._priced_var(weight, integer=False, upper=1.0, hidden=call.kind == ALL_REDUCE)
            self.bytes_on[(call.kind, dim)][self.y[key]] = float(self.mult[producer] * call.nbytes)
        return self.y[key]

    def add_bucket_rows(self) -> None:
        """k[kind, d] >= bytes of that stream on d / bucket bytes, k integer."""
        for (kind, dim), row in self.bytes_on.items():
            self._bucket_row(kind, dim, row, self.ctx.precision.grad_bytes_per_param)

    def add_gather_rows(self, x: dict[str, list[int]]) -> None:
        """The ZeRO-1 all-gather buckets: k[d] >= bytes of the strategies that gather on d / bucket bytes."""
        rows: dict[int, dict[int, float]] = defaultdict(dict)
        for v, js in x.items():
            node = self.graph.nodes[v]
            if node.kind != PARAM or not node.needs_grad:
                continue
            meta = node.outputs[0]
            assert meta is not None
            for j, strategy in zip(js, node.strategies):
                call = zero1_gather_call(meta, strategy, self.ctx)
                if call is not None:
                    rows[call.mesh_dim][j] = rows[call.mesh_dim].get(j, 0.0) + float(self.mult[v] * call.nbytes)
        for dim, row in rows.items():
            self._bucket_row(ALL_GATHER, dim, row, self.ctx.precision.master_bytes_per_param)

    def _bucket_row(self, kind: str, dim: int, row: dict[int, float], itemsize: int) -> None:
        cap = self.ctx.bucket_bytes if kind == ALL_REDUCE else \
            shard_bucket_cap(self.ctx.bucket_bytes, itemsize, self.ctx.mesh.shape[dim])
        most = bucket_count(sum(row.values()), cap)
        per_call = call_time(kind, dim, self.ctx.mesh)
        k = self._priced_var(per_call * SCALE if self.priced else 0.0, integer=True, upper=float(most),
                             hidden=kind == ALL_REDUCE)
        # in buckets, not bytes: coefficients near 1 keep HiGHS's numerics sound on big models
        self.model.rows.append(({k: 1.0, **{y: -b / cap for y, b in row.items()}}, 0.0, INF))


    def _priced_var(self, weight: float, *, integer: bool, upper: float, hidden: bool) -> int:
        """A variable costing ``weight``: in the objective, or (``hidden``: an all-reduce bucket
        beside backward, where the hardware overlaps them) in the exposed-time row."""
        if not self.overlap or not hidden:
            return self.model.var(weight, integer=integer, upper=upper, term=GRAD_SYNC)
        j = self.model.var(0.0, integer=integer, upper=upper)
        self.seconds[j] = weight
        return j

    def beside_backward(self, objective: float, beside: float, term: str) -> int:
        """A variable in [0, 1] costing ``objective`` and ``beside`` (objective units, of ``term``) that
        run beside the last micro-batch's backward: those in the exposed-time row where the hardware
        hides them, else in the objective too (a group of unwaited reduce-scatters' call, ``group_terms``)."""
        if not self.overlap:
            return self.model.var(objective + beside, integer=False, upper=1.0, term=term)
        j = self.model.var(objective, integer=False, upper=1.0, term=term)
        self.seconds[j] = beside
        return j

    def add_buffer_memory(self, memory_row: dict[int, float]) -> None:
        """With micro-batches the runtime accumulates the synchronized gradients in its bucket
        buffers (one flat buffer per mesh dim) from the first micro-batch's backward to the
        last: their bytes are held beside ``.grad`` for the whole step (``bucket_buffer_bytes``)."""
        if self.ctx.train and self.ctx.micro_batches > 1:
            for (kind, _), row in self.bytes_on.items():
                for y, nbytes in row.items() if kind == ALL_REDUCE else ():  # reduce-scatters read .grad
                    memory_row[y] = memory_row.get(y, 0.0) + nbytes

    def unwaited(self, producer: str, count: int, price: Callable[[int, int], EdgeCost]
                 ) -> Callable[[int, int, int], None] | None:
        """For an edge out of a parameter read once (``single_use_params``): ``note(j, a, b)``
        moves the last micro-batch's unwaited reduce-scatter of pair (a, b) (``price(a, b)``,
        ``count`` real edges) from the objective into the exposed-time row."""
        if not self.overlap or producer not in self.single_use:
            return None
        cache: dict[tuple[int, int], float] = {}

        def note(j: int, a: int, b: int) -> None:
            if (a, b) not in cache:
                cache[(a, b)] = price(a, b).unwaited * count * SCALE
            if cache[(a, b)]:
                self.model.add_cost(j, -cache[(a, b)], RESHARDS)  # the edge's, now priced as exposed
                self.seconds[j] = self.seconds.get(j, 0.0) + cache[(a, b)]
        return note

    def add_overlap_row(self, backward: dict[int, float]) -> None:
        """e >= sync - overlap x backward (both in objective units), e >= 0, e in the objective.
        ``backward``: variable -> the last micro-batch's backward seconds (x SCALE) it selects."""
        if not self.seconds:
            return
        e = self.model.var(1.0, integer=False, upper=INF, term=GRAD_SYNC)
        row = {e: 1.0, **{j: -w for j, w in self.seconds.items()}}
        for j, w in backward.items():
            row[j] = row.get(j, 0.0) + self.overlap * w
        self.model.rows.append((row, 0.0, INF))


class _EdgeSync:
    """Collects, for one edge, which variables select a pairing that syncs on each dim."""

    def __init__(self, terms: GradSyncTerms, producer: str, groups_p: dict[object, list[int]],
                 dims: dict[tuple[int, int], frozenset[int]]) -> None:
        self.terms, self.producer, self.dims = terms, producer, dims
        self.keys_p, self.groups_p = list(groups_p), list(groups_p.values())
        self.selectors: dict[tuple[int, int], list[int]] = defaultdict(list)

    def note(self, j: int, a: int, b: int) -> None:
        for d in self.dims.get((a, b), ()):
            self.selectors[(a, d)].append(j)

    def close(self) -> None:
        """y[p, a, d] >= the sum of this edge's selectors (at most one of them is 1), split by
        the chosen strategy of group a where it holds both a plain placement and its ZeRO-1
        twin on d: the all-reduce is owed less the twin's column, the reduce-scatter less the
        plain one's (the selectors sum to at most their two columns' sum)."""
        x = self.terms.x[self.producer]
        strategies = self.terms.graph.nodes[self.producer].strategies
        for (a, d), js in self.selectors.items():
            twins = [x[s] for s in self.groups_p[a] if strategies[s].zero1 == d]
            plain = [x[s] for s in self.groups_p[a] if strategies[s].zero1 != d]
            for scattered, mine, others in ((False, plain, twins), (True, twins, plain)):
                if not mine:
                    continue  # no strategy of the group syncs this way
                row = {self.terms.var(self.producer, self.keys_p[a], d, scattered): 1.0}
                for j in js:
                    row[j] = row.get(j, 0.0) - 1.0
                for j in others:
                    row[j] = row.get(j, 0.0) + 1.0
                self.terms.model.rows.append(({j: c for j, c in row.items() if c}, 0.0, INF))


def single_use_params(graph: PlanGraph) -> set[str]:
    """Trainable parameters read by one op: the reduce-scatter ending their gradient's way
    back runs beside backward (``EdgeCost.unwaited``) and is theirs alone (a parameter read
    twice sums two gradients, which waits, and may share a reshard between its readers)."""
    uses: dict[str, int] = defaultdict(int)
    for name in graph.order:
        for src, _ in graph.nodes[name].args:
            uses[src] += 1
    return {p for p, n in uses.items() if n == 1 and graph.nodes[p].kind == PARAM and graph.nodes[p].needs_grad}
