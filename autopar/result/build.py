"""The plan a solution gives: every node's chosen strategy priced by the functions the ILP's objective uses
(compute, the reshards the placements imply, gradient buckets, overlap windows, memory), listed as
collectives and predicted figures."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autopar.cost.collectives import ALL_REDUCE, CollectiveCall, bytes_moved, call_time, collective_time
from autopar.cost.buckets import GradBucket, gradient_buckets
from autopar.cost.groups import GroupKey, edge_groups, group_call
from autopar.cost.moe import moe_collectives
from autopar.cost.ring import ring_transfers
from autopar.cost.summed_loss import SUMMED_LOSS, loss_summed_once
from autopar.cost.zero1 import chunk_elements
from autopar.cost.model import (CostContext, EdgeCost, NodeCost, backward_time, exposed_sync_time, grad_placements,
                                grad_sync_dims, step_repeats)
from autopar.rules.strategy import Strategy, local_numel, placement_str
from autopar.problem.folding import Folding
from autopar.memory.options import MemoryPlan
from autopar.solver.grad_terms import single_use_params
from autopar.problem.groups import group_names
from autopar.problem.graph import edge_flags, zigzag_output_gathers
from autopar.problem.loss_collectives import loss_count_reductions, loss_replication, summed_count_root
from autopar.problem.nodes import OP, PARAM, PlanGraph
from autopar.problem.reshards import reshard_key
from autopar.solver.overlap import plan_windows
from autopar.cost.backward import gradient_bytes
from autopar.memory.backward import backward_peak, transient_rows
from autopar.memory.recompute import block_peak, freed_before_recompute, recompute_peak
from autopar.solver.edge_prices import EdgePrices
from autopar.solver.ilp import Solution
from autopar.memory.zero1 import plan_shard_buckets, zero1_dims
from autopar.result.plan import Plan
from autopar.result.record import Fallback, NodePlacement, PlannedCollective, Predicted


def fallback_groups(graph: PlanGraph) -> list[Fallback]:
    """Fallback nodes grouped by (op, reason), sorted so every rank and run lists them alike."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in graph.order:
        reason = graph.nodes[name].fallback
        if reason is not None:
            groups.setdefault((graph.nodes[name].op, reason), []).append(name)
    return [Fallback(op=op, reason=reason, nodes=nodes) for (op, reason), nodes in sorted(groups.items())]


def param_sync_dims(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext) -> dict[str, frozenset[int]]:
    """Per parameter, the mesh dims its gradient is reduced over (any consumer's Partial):
    all-reduced, or reduce-scattered on a ZeRO-1 parameter's ZeRO-1 dim."""
    out: dict[str, frozenset[int]] = {}
    if not ctx.train:
        return out
    for name in graph.order:
        for arg, (src, idx) in enumerate(graph.nodes[name].args):
            if graph.nodes[src].kind != PARAM or not graph.sends_gradient(src, name):
                continue
            produced = chosen[src].outputs[idx]
            grad_in, _ = grad_placements(produced, chosen[name].inputs[arg], chosen[name])
            out[src] = out.get(src, frozenset()) | grad_sync_dims(produced, grad_in, ctx.mesh.shape)
    return out


def plan_buckets(graph: PlanGraph, chosen: dict[str, Strategy], sync_dims: dict[str, frozenset[int]],
                 ctx: CostContext) -> list[GradBucket]:
    """The gradient all-reduce buckets of a plan: each synchronized parameter's local
    gradient, per sync dim but its ZeRO-1 dim (reduce-scattered: ``plan_shard_buckets``)."""
    params = []
    zero1 = zero1_dims(graph, chosen, ctx)
    for name in graph.order:
        dims = sync_dims.get(name, frozenset()) - {zero1.get(name)}
        if dims:
            meta = graph.nodes[name].outputs[0]
            assert meta is not None
            params.append((name, local_numel(meta, chosen[name].outputs[0], ctx.mesh.shape), dims))
    return gradient_buckets(params, itemsize=ctx.precision.reduce_bytes_per_param, cap=ctx.bucket_bytes)


class _Ledger:
    """The collectives a plan lists, and the bytes each mesh axis sends for them."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.collectives: list[PlannedCollective] = []
        self.comm_bytes = {axis: 0.0 for axis in mesh.names}
        self.hidden_s = 0.0
        """Seconds of the recorded calls that run under their op's compute (ring attention's sends)."""

    def record(self, call: CollectiveCall, phase: str, tensor: str, consumer: str, module: str, count: int = 1,
               waited: float = 1.0, data_dependent: bool = False, time: float | None = None) -> None:
        """``waited``: the share of the call the step waits for; ``data_dependent``: its bytes are an
        expectation; ``time``: its seconds where known (a group's, which are not ``collective_time``'s, or
        ones priced already), else ``collective_time``'s."""
        axis = self.mesh.names[call.mesh_dim]
        time = collective_time(call, self.mesh) if time is None else time
        self.collectives.append(PlannedCollective(
            kind=call.kind, axis=axis, bytes=call.nbytes, phase=phase, tensor=tensor, consumer=consumer,
            module=module, time_s=time, count=count, waited_s=None if waited == 1.0 else time * waited,
            data_dependent=data_dependent))
        self.comm_bytes[axis] += bytes_moved(call, self.mesh) * count


def _shared_prices(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, prices: EdgePrices,
                   keys: dict[tuple[str, int], tuple]) -> dict[tuple, tuple[EdgeCost, float, str]]:
    """Per shared reshard, the price of its dearest consumer (the ILP's ``_add_shared``: the
    copy is held if any consumer saves it, replayed if any recomputes it): its edge cost,
    held bytes and the consumer. ``keys``: each (consumer, argument)'s ``reshard_key``."""
    best: dict[tuple, tuple[EdgeCost, float, str]] = {}
    for name in graph.order:
        for arg, (src, out_index) in enumerate(graph.nodes[name].args):
            key = keys[name, arg]
            meta, produced = graph.nodes[src].outputs[out_index], chosen[src].outputs[out_index]
            assert meta is not None and produced is not None
            edge, held = prices.chosen(meta, edge_flags(graph, src, name, arg), produced, chosen[name], arg)
            if key not in best or (edge.time, held) > (best[key][0].time, best[key][1]):
                best[key] = (edge, held, name)
    return best


def _record_reshards(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext, ledger: _Ledger,
                     waited: dict[tuple[str, str], float], prices: EdgePrices) -> tuple[float, set[str], list[int]]:
    """Every reshard the step runs (once per tensor, version and placement among its
    consumers, listed at its first consumer) and every loss count reduction; returns the
    bytes resharded copies keep until backward, the parameters gathered again in backward
    and the ledger entries of the gradient reduce-scatters left running beside backward
    (``EdgeCost.unwaited``, parameters read once: ``single_use_params``).
    ``waited``: the windowed gathers' waited shares (``WindowPrices.waited``); ``prices``: the edges'
    prices as the ILP kept them."""
    reshards = {(name, arg): reshard_key(graph, chosen, ctx, name, arg)
                for name in graph.order for arg in range(len(graph.nodes[name].args))}
    prices = _shared_prices(graph, chosen, ctx, prices, reshards)
    single = single_use_params(graph)
    recorded: set[tuple] = set()
    held = 0.0
    regathered: set[str] = set()
    unwaited: list[int] = []
    groups, names = _Groups(), group_names(graph, ctx.pipelined)
    for name in graph.order:
        node = graph.nodes[name]
        for arg, (src, out_index) in enumerate(node.args):
            key = reshards[name, arg]
            if key in recorded:  # shared with an earlier consumer
                continue
            recorded.add(key)
            edge, kept, dearest = prices[key]
            ragged = getattr(graph.nodes[src].outputs[out_index], "ragged", None)
            held += kept
            replays = graph.nodes[dearest].recompute
            if edge.recompute and not replays:
                regathered.add(graph.nodes[src].fqn or src)
            again = "recompute" if replays else "backward"  # a block's replay, or a parameter gathered again
            meta = graph.nodes[src].outputs[out_index]
            keys = iter(edge_groups(edge.forward, edge.backward, edge.recompute, names[name], replays,
                                    str(meta.dtype))) if meta is not None else iter(())
            for phase, calls, window in (("forward", edge.forward, "forward"), ("backward", edge.backward, None),
                                         (again, edge.recompute, "backward")):
                share = waited.get((src, window), 1.0) if window else 1.0  # one all-gather when windowed
                for call in calls:  # a data-dependent size (``TensorMeta.ragged``) at its planning hint
                    if call.grouped:  # listed once for its whole group, below
                        groups.add(next(keys)[0], call, (src, name), share, phase == "backward" and
                                   edge.unwaited > 0 and window is None and src in single)
                        continue
                    ledger.record(call, phase, src, name, node.module, step_repeats(ctx), share,
                                  data_dependent=bool(ragged))
                if phase == "backward" and window is None and edge.unwaited and src in single and calls \
                        and not calls[-1].grouped:
                    unwaited.append(len(ledger.collectives) - 1)  # the last backward call
        for call in loss_count_reductions(node, chosen[name], ctx):
            ledger.record(call, "forward", name, name, node.module, step_repeats(ctx))
        if node.call is not None:  # an expert-parallel layer's all-to-alls, at the expected bytes
            for phase, call, data_dependent in moe_collectives(node.call, chosen[name], ctx.mesh, ctx.precision,
                                                               ctx.train):
                ledger.record(call, phase, name, name, node.module, step_repeats(ctx), data_dependent=data_dependent)
                if phase == "forward" and node.recompute:  # no policy keeps the op: its block's replay runs it
                    ledger.record(call, "recompute", name, name, node.module, step_repeats(ctx),
                                  data_dependent=data_dependent)
            for phase, call, exposed in ring_transfers(node.call, chosen[name], ctx.mesh, ctx.precision, ctx.train):
                for ran in (phase, "recompute") if phase == "forward" and node.recompute else (phase,):
                    ledger.record(call, ran, name, name, node.module, step_repeats(ctx), exposed)
                    ledger.hidden_s += collective_time(call, ctx.mesh) * (1.0 - exposed) * step_repeats(ctx)
    unwaited += groups.record(ledger, step_repeats(ctx))
    return held, regathered, unwaited


class _Groups:
    """The grouped calls of a plan's edges, by group (``cost.groups``): each group is listed as its
    one collective, its call paid once, waited for at its window's share (``plan_windows``)."""

    def __init__(self) -> None:
        self.members: dict[GroupKey, list[tuple[CollectiveCall, tuple[str, str], float]]] = {}
        """Group -> (call, (tensor, consumer), waited share) of each member."""
        self.beside: set[GroupKey] = set()
        """Groups of reduce-scatters left running beside backward (``EdgeCost.unwaited``)."""

    def add(self, key: GroupKey, call: CollectiveCall, edge: tuple[str, str], share: float, beside: bool) -> None:
        self.members.setdefault(key, []).append((call, edge, share))
        if beside:
            self.beside.add(key)

    def record(self, ledger: _Ledger, runs: int) -> list[int]:
        """List each group's collective; returns the ledger entries left running beside backward."""
        beside = []
        for key, members in sorted(self.members.items()):
            call = group_call(key, [c for c, _, _ in members])
            # its call, then each member's transfer (and copy: ``copy_time``) as priced on its edge
            transfers = [(collective_time(c, ledger.mesh), share) for c, _, share in members]
            whole = call_time(key.kind, key.mesh_dim, ledger.mesh) + sum(t for t, _ in transfers)
            # the call waits as its members do: a prefetched block's window holds them all (one share)
            waited = (whole - sum(t for t, _ in transfers)) * members[0][2] + sum(t * share for t, share in transfers)
            ledger.record(call, key.phase, ",".join(t for _, (t, _), _ in members),
                          ",".join(c for _, (_, c), _ in members), key.group or "(root)", runs,
                          waited / whole if whole else 1.0, time=whole)
            if key in self.beside:
                beside.append(len(ledger.collectives) - 1)
        return beside


def _beside_backward(ledger: _Ledger, buckets: list[GradBucket], unwaited: list[int], backward_s: float,
                     ctx: CostContext) -> float:
    """Record the gradient buckets and price what runs beside the last micro-batch's backward:
    the buckets and that micro-batch's unwaited reduce-scatters (ledger entries ``unwaited``;
    earlier micro-batches' wait in full), as the ILP's exposed-time row (``exposed_sync_time``).
    Each gets the pool's waited share; returns the seconds hidden."""
    calls = [CollectiveCall(ALL_REDUCE, b.mesh_dim, b.nbytes, bucketed=True) for b in buckets]
    times = [collective_time(c, ctx.mesh) for c in calls]
    pool = sum(times) + sum(ledger.collectives[i].time_s for i in unwaited)
    exposed = exposed_sync_time(pool, backward_s, ctx)
    share = exposed / pool if pool else 1.0
    for bucket, call, time in zip(buckets, calls, times):
        ledger.record(call, "backward", ",".join(bucket.params), "", "(gradient buckets)", waited=share, time=time)
    runs = step_repeats(ctx)
    for i in unwaited:
        c = ledger.collectives[i]
        ledger.collectives[i] = replace(c, waited_s=c.time_s * (runs - 1 + share) / runs)
    return pool - exposed


def bucket_buffer_bytes(buckets: list[GradBucket], ctx: CostContext) -> float:
    """Bytes of the gradient-bucket buffers held for the whole step: with micro-batches the
    runtime accumulates synchronized gradients there (beside ``.grad``) until the last
    micro-batch's backward reduces them (``GradSyncTerms.add_buffer_memory``)."""
    return float(sum(b.nbytes for b in buckets)) if ctx.train and ctx.micro_batches > 1 else 0.0


def model_state_parts(graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext) -> dict[str, float]:
    """Weights, gradients and optimizer state per device, as ``parameter_cost`` prices them
    (an offloaded parameter keeps its weights and gradient on the device, a ZeRO-1 one the
    optimizer state of its chunk)."""
    parts = {"weights": 0.0, "gradients": 0.0, "optimizer state": 0.0}
    precision = ctx.precision
    zero1 = zero1_dims(graph, chosen, ctx)
    for name in graph.order:
        node = graph.nodes[name]
        if node.kind != PARAM:
            continue
        meta = node.outputs[0]
        assert meta is not None
        numel = local_numel(meta, chosen[name].outputs[0], ctx.mesh.shape)
        if not (ctx.train and node.needs_grad):  # frozen, or a forward-only step: the weights alone
            parts["weights"] += numel * precision.weight_bytes_per_param
            continue
        parts["weights"] += numel * precision.master_bytes_per_param
        parts["gradients"] += gradient_bytes(meta, chosen[name].outputs[0], ctx)  # as the backward rows discount it
        if not chosen[name].offload:  # else on the host, not in the device's peak
            stepped = chunk_elements(numel, ctx.mesh.shape[zero1[name]]) if name in zero1 else numel
            parts["optimizer state"] += stepped * (precision.state_bytes_per_param - precision.master_bytes_per_param
                                                 - precision.grad_bytes_per_param)
    return parts


def _with_state(memory: MemoryPlan, graph: PlanGraph, chosen: dict[str, Strategy], ctx: CostContext) -> MemoryPlan:
    """``memory`` with the plan's offloaded parameters, ZeRO-1 parameters and axes (stage 1
    where nothing higher is pinned)."""
    names = ctx.mesh.names
    zero1 = {graph.nodes[n].fqn or n: names[d] for n, d in zero1_dims(graph, chosen, ctx).items()}
    trainable = sum(1 for n in graph.order if graph.nodes[n].kind == PARAM and graph.nodes[n].needs_grad)
    offload = sorted(graph.nodes[n].fqn or n for n in graph.order if graph.nodes[n].kind == PARAM and chosen[n].offload)
    return replace(memory, zero1=dict(sorted(zero1.items())), trainable_parameters=trainable if ctx.train else 0,
                   offload=offload,
                   zero={**{axis: 1 for axis in sorted(set(zero1.values()), key=names.index)}, **memory.zero})


def _node_placements(graph: PlanGraph, chosen: dict[str, Strategy], costs: list[NodeCost], ctx: CostContext
                     ) -> list[NodePlacement]:
    out = []
    for n, cost in zip(graph.order, costs):
        node = graph.nodes[n]
        op = node.kind == OP
        out.append(NodePlacement(
            name=n, op=node.op, module=node.module, outputs=[placement_str(p) for p in chosen[n].outputs],
            inputs=[placement_str(p) for p in chosen[n].inputs], fallback=node.fallback,
            shapes=[list(m.shape) for m in node.outputs if m is not None],
            forward_s=cost.forward / step_repeats(ctx) if op else 0.0,
            backward_s=backward_time(cost, ctx) if op else 0.0, update_s=0.0 if op else cost.time))
    return out


def build_plan(graph: PlanGraph, folding: Folding, solution: Solution, ctx: CostContext,
               timings: dict[str, float], pinned: dict[str, str], *, memory_limit: float | None = None,
               notes: list[str] | None = None, memory: MemoryPlan | None = None,
               prices: EdgePrices | None = None) -> Plan:
    """The plan of a solution, priced by the same functions as the ILP's objective; ``prices``: the
    edge prices its solve kept (``search.problem.Problem.edge_prices``), or priced here alone."""
    mesh = ctx.mesh
    chosen: dict[str, Strategy] = {
        n: graph.nodes[n].strategies[solution.choice[folding.representative[n]]] for n in graph.order}
    costs = [graph.nodes[n].costs[solution.choice[folding.representative[n]]] for n in graph.order]
    compute = sum(c.time for c in costs)
    param_mem = sum(c.memory for n, c in zip(graph.order, costs) if graph.nodes[n].kind == PARAM)
    act_mem = sum(c.memory for n, c in zip(graph.order, costs) if graph.nodes[n].kind != PARAM)
    ledger = _Ledger(mesh)
    windows = plan_windows(graph, chosen, dict(zip(graph.order, costs)), ctx)
    prices = EdgePrices(ctx) if prices is None else prices
    assert prices.key == EdgePrices.key_of(ctx), "edge prices kept for another context"
    held, regathered, unwaited = _record_reshards(graph, chosen, ctx, ledger, windows.waited, prices)
    act_mem += held
    memory = replace(memory or MemoryPlan(), regather=sorted(regathered))
    freed = freed_before_recompute(graph)
    act_mem += recompute_peak(
        block_peak(graph, {n: graph.nodes[n].recompute_memory[solution.choice[folding.representative[n]]]
                           for n in graph.order if graph.nodes[n].recompute_memory}),
        sum(c.memory for n, c in zip(graph.order, costs) if n in freed))
    act_mem += windows.prefetched_bytes  # one block's regathers prefetched in backward
    act_mem += backward_peak(transient_rows(graph, folding, ctx), solution.choice)  # as the ILP's row prices it
    sync_dims = param_sync_dims(graph, chosen, ctx)
    buckets = plan_buckets(graph, chosen, sync_dims, ctx)
    act_mem += bucket_buffer_bytes(buckets, ctx)
    backward = sum(backward_time(c, ctx) for n, c in zip(graph.order, costs) if graph.nodes[n].kind == OP)
    beside = _beside_backward(ledger, buckets, unwaited, backward, ctx)
    shard_buckets = plan_shard_buckets(graph, chosen, sync_dims, ctx)
    for sb in shard_buckets:  # at the optimizer step: never beside backward
        ledger.record(CollectiveCall(sb.kind, sb.mesh_dim, sb.nbytes, bucketed=True), "optimizer",
                      ",".join(sb.params), "optimizer", "(ZeRO-1 buckets)")
    memory = _with_state(memory, graph, chosen, ctx)
    if graph.loss is not None:  # every rank returns the whole loss
        loss = graph.nodes[graph.loss]
        once = loss_summed_once(ctx)
        for call in loss_replication(loss, chosen[graph.loss], ctx, summed_count_root(graph.nodes, ctx) is not None):
            ledger.record(call, "forward", graph.loss, SUMMED_LOSS if once else "output", loss.module,
                          1 if once else step_repeats(ctx))
    for name in dict.fromkeys(graph.output_names):  # a forward step's outputs, gathered on zig-zag axes
        for call in zigzag_output_gathers(graph.nodes[name], chosen[name], ctx):
            ledger.record(call, "forward", name, "output", graph.nodes[name].module, step_repeats(ctx))
    total_comm = sum(c.time_s * c.count for c in ledger.collectives)
    # buckets and reduce-scatters behind the last backward; prefetched gathers behind their neighbouring blocks
    hidden = beside + windows.windowed_s - windows.exposed_s + ledger.hidden_s  # and ring sends under their blocks
    comm_time = total_comm - hidden
    parameters = {graph.nodes[n].fqn or n: placement_str(chosen[n].outputs[0])
                  for n in graph.order if graph.nodes[n].kind == PARAM}
    assert solution.terms, "a plan's predicted step is its ILP's objective by term (solve(fixed=...) without a search)"
    predicted = Predicted(step_time_s=sum(solution.terms.values()), terms=dict(solution.terms),
                          compute_time_s=compute, comm_time_s=comm_time,
                          hidden_comm_time_s=hidden, memory_parts={**model_state_parts(graph, chosen, ctx),
                                                                  "activations": act_mem},
                          peak_memory_bytes=param_mem + act_mem, parameter_memory_bytes=param_mem,
                          activation_memory_bytes=act_mem, comm_bytes=ledger.comm_bytes)
    solver = {"status": solution.status, "gap": solution.gap, "time_limit_s": solution.time_limit_s,
              "variables": solution.num_variables, "constraints": solution.num_constraints,
              "objective_s": solution.objective_s, "folded_blocks": folding.blocks,
              "distinct_nodes": len(solution.choice), "nodes": len(graph.order),
              **({"memory_search": dict(solution.search)} if solution.search else {})}
    return Plan(mesh=mesh.to_json(), precision=ctx.precision.name, train=ctx.train, parameters=parameters,
                nodes=_node_placements(graph, chosen, costs, ctx), collectives=ledger.collectives, predicted=predicted,
                fallbacks=fallback_groups(graph), grad_buckets=buckets, shard_buckets=shard_buckets, solver=solver,
                timings=timings, pinned=pinned, memory_limit_bytes=memory_limit, notes=list(notes or []),
                memory=memory)
