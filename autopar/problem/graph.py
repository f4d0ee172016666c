"""The planning graph: every captured node with its candidate strategies and costs."""

from __future__ import annotations

import itertools
from dataclasses import replace
import operator
from collections.abc import Hashable
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Placement
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.capture.aliasing import writes_first_arg, written_args
from autopar.capture.graph import CapturedGraph, TensorMeta, hinted
from autopar.errors import CaptureError
from autopar.capture.subgraphs import runs_without_grad, subgraph_call
from autopar.cost.blocks import block_cost
from autopar.cost.collectives import ALL_REDUCE, CollectiveCall, collective_time, reshard
from autopar.cost.collectives import transfer_time as collective_transfer
from autopar.cost.moe import is_moe, moe_collectives
from autopar.cost.ring import ring_waited_time
from autopar.cost.model import (CostContext, EdgeCost, NodeCost, edge_cost, input_cost, op_cost, parameter_cost,
                                step_repeats, zero1_gather_call)
from autopar.cost.summed_loss import loss_summed_once
from autopar.cost.zero1 import zero1_dim
from autopar.rules.attention import ATTENTION_OPS
from autopar.rules.loss import MEAN_AS_PARTIAL, is_partial_mean_loss, static_count
from autopar.rules import RuleSet, expand
from autopar.rules.strategy import R, DimStrategy, OpCall, S, Strategy, call_key, divides
from autopar.problem.loss_collectives import (loss_count_reductions, loss_replication, mark_loss_root,
                                             summed_count_root)
from autopar.problem.gradients import differentiable, mark_written_storage, may_need_grad, settle_gradients
from autopar.problem.nodes import BUFFER, INPUT, OP, PARAM, PlanGraph, PlanNode, ProbeMemo
from autopar.problem.saved_activations import cached_probe
from autopar.problem.shared import BuildMemo, GraphFacts

FOLLOWER_FAMILIES = {"view", "pointwise", "dropout"}
_aten = torch.ops.aten
SAME_ELEMENTS = frozenset({
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.flatten.using_ints,
    _aten.unflatten.int, _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default, _aten.unsqueeze.default,
    _aten.transpose.int, _aten.t.default, _aten.permute.default, _aten.clone.default, _aten.contiguous.default,
})
"""Ops whose output holds exactly their input's elements (a count over them is the same)."""


def placeholder_strategies(meta: TensorMeta, mesh_shape: tuple[int, ...],
                           extra: list[Placement] | None = None) -> list[Strategy]:
    """Replicate or Shard(d) on each mesh dim (a leaf cannot start out Partial), plus ``extra`` choices;
    Replicate alone on a mesh dim of one rank (``rules.strategy.expand``)."""
    choices = [R, *(S(d) for d in range(meta.ndim) if meta.shape[d] > 1), *(extra or [])]
    out = []
    for combo in itertools.product(*(choices if n > 1 else [R] for n in mesh_shape)):
        if divides(meta, combo, mesh_shape):
            out.append(Strategy((tuple(combo),), ()))
    return out


def leaf_costs(node: PlanNode, ctx: CostContext) -> list[NodeCost]:
    """Cost of each strategy of a parameter, buffer or input node (what its placement keeps)."""
    meta = node.outputs[0]
    assert meta is not None
    if node.kind == PARAM:  # a parameter that gets no gradient keeps its weights alone
        return [parameter_cost(meta, s.outputs[0], ctx, trainable=node.needs_grad, offloaded=s.offload,
                               zero1=s.zero1) for s in node.strategies]
    return [input_cost(meta, s.outputs[0], ctx) for s in node.strategies]


def priced_parameter(node: PlanNode, ctx: CostContext) -> PlanNode:
    """A parameter node priced again under ``ctx``'s offload and ZeRO-1: its state per
    strategy, and the transfer of a ZeRO-1 parameter's all-gather after the update (the
    bucket calls are the ILP's ``GradSyncTerms.add_gather_rows``). A trainable parameter's
    placements come with their offloaded or ZeRO-1 twins (``state_twins``)."""
    meta = node.outputs[0]
    assert meta is not None
    node = replace(node, strategies=state_twins(node, ctx))
    calls = [zero1_gather_call(meta, s, ctx) if node.needs_grad else None for s in node.strategies]
    return replace(node, costs=leaf_costs(node, ctx),
                   comm_times=[0.0 if c is None else collective_transfer(c, ctx.mesh) for c in calls])


def state_twins(node: PlanNode, ctx: CostContext) -> list[Strategy]:
    """A parameter's strategies with ZeRO-1 and offload decided per parameter by the ILP: each
    placement followed by the same placement with its optimizer state in host memory (where
    ``ctx.offload`` allows it) or, replicated on a ZeRO-1 dim (``zero1_dim``), sharding it
    there; each priced apart (state and update, ZeRO-1's all-gather after it and
    reduce-scatter instead of all-reduce, offload's copies and host update). Edges group
    strategies by placement, so a twin adds one column per placement and no edge variables.
    Pinned (``offload_pinned``, ``zero1_pinned``): the twin replaces the placement's plain strategy."""
    if not (ctx.train and node.needs_grad and (ctx.zero1 or ctx.offload)):
        return node.strategies
    out: list[Strategy] = []
    for s in node.strategies:
        placements = s.outputs[0]
        d = None if placements is None or not ctx.zero1 else zero1_dim(placements, ctx.zero1, ctx.mesh.shape)
        twins = ([replace(s, offload=True)] if ctx.offload else []) + ([replace(s, zero1=d)] if d is not None else [])
        pinned = (ctx.offload and ctx.offload_pinned) or (d is not None and ctx.zero1_pinned)
        out += twins if pinned else [s, *twins]
    return out


def build_plan_graph(captured: CapturedGraph, rules: RuleSet, ctx: CostContext,
                     shared: BuildMemo | None = None) -> PlanGraph:
    """Candidate strategies and their node costs for every tensor-producing node; ``shared``: what
    the builds of one search share (``problem.shared``; one of its own when None)."""
    shared = BuildMemo(rules) if shared is None else shared
    assert shared.rules is rules, "a BuildMemo serves one rule set"
    facts, metas = shared.facts(captured.gm), shared.metas(captured)
    nodes: dict[str, PlanNode] = {}
    order: list[str] = []
    loss: str | None = None
    output_names: list[str] = []
    blocks: dict[str, torch.fx.Node] = {}  # higher-order ops priced by their subgraphs
    trees: dict[str, list[str]] = {}  # storage root -> the planned nodes sharing its storage
    for node in captured.gm.graph.nodes:
        if node.op == "output":
            flat = torch.utils._pytree.tree_leaves(node.args[0])
            output_names = [a.name for a in flat if isinstance(a, torch.fx.Node)]
            loss = output_names[0] if captured.train and output_names else None
            continue
        outputs = metas[node.name]
        if all(o is None for o in outputs) and not written_args(node):
            continue  # placed only for what it writes (a no_grad block updating buffers, returning nothing)
        if node.op == "placeholder":
            pn = _leaf_node(node, captured, ctx, outputs)
        else:
            pn = _op_node(node, nodes, ctx, outputs, facts.modules[node.name], shared, captured.size_hints)
            pn.as_produced = frozenset(k for k, (src, _) in enumerate(pn.args)
                                       if src in facts.pinned.get(pn.name, ()))
            if any((pn.name, src) in facts.writes for src, _ in pn.args):
                pn.written_before = tuple(facts.writes.get((pn.name, src), ()) for src, _ in pn.args)
                pn.read_versions = tuple(len(w) for w in pn.written_before)
        if subgraph_call(node) is not None:
            blocks[pn.name] = node
        nodes[pn.name] = pn
        order.append(pn.name)
        trees.setdefault(facts.roots[node.name], []).append(pn.name)
        if node.op == "call_function" and writes_first_arg(node.target) and isinstance(node.args[0], torch.fx.Node):
            mark_written_storage(nodes, pn, trees.get(facts.roots[node.args[0].name], []))
    mark_loss_root(nodes, loss)
    _check_buffer_writes(captured, nodes, facts)  # before settling: autograd records what may need a gradient
    probes = ProbeMemo(shared.probes)  # kept by the PlanGraph: edge pricing asks the same probes again
    settle_gradients(nodes, order, loss, ctx, leaf_costs, probes)
    _price_ops(nodes, order, ctx)
    for name, fx_node in blocks.items():  # priced by their subgraphs, with or without their backward
        nodes[name].costs = [block_cost(fx_node, ctx, backward=nodes[name].needs_grad)] * len(nodes[name].strategies)
    _price_own_collectives(nodes, order, loss, output_names, ctx)
    return PlanGraph(nodes, order, loss, output_names, saved_probes=probes)


def _leaf_node(node: torch.fx.Node, captured: CapturedGraph, ctx: CostContext,
               outputs: tuple[TensorMeta | None, ...]) -> PlanNode:
    """A parameter, buffer or input placeholder with its placements and what each keeps."""
    kind = PARAM if node.name in captured.parameters else BUFFER if node.name in captured.buffers else INPUT
    fqn = captured.parameters.get(node.name) or captured.buffers.get(node.name)
    module = fqn.rsplit(".", 1)[0] if fqn and "." in fqn else ""
    trainable = kind == PARAM and bool(getattr(node.meta.get("val"), "requires_grad", True))
    pn = PlanNode(node.name, kind, "parameter" if kind == PARAM else kind, module, None, outputs, [],
                  needs_grad=trainable and ctx.train, fqn=fqn, frozen=kind == PARAM and not trainable)
    pn.strategies = placeholder_strategies(outputs[0], ctx.mesh.chunks)  # split dims divide the chunks
    pn.costs = leaf_costs(pn, ctx)
    return pn


def _price_ops(nodes: dict[str, PlanNode], order: list[str], ctx: CostContext) -> None:
    """Each op's cost per strategy, with its backward as settled (``settle_gradients``): once per
    list of strategies (one per distinct call) and what the backward keeps and sums, which the
    layers of a stack share."""
    priced: dict[Hashable, list[NodeCost]] = {}
    for name in order:
        node = nodes[name]
        if node.kind != OP or node.call is None:
            continue
        key = (id(node.strategies), node.needs_grad, node.saved, node.kept, node.grad_sums) if ctx.train \
            else id(node.strategies)
        if key not in priced:
            phases = dict(backward=node.needs_grad, saved=node.saved, kept=node.kept, grad_sums=node.grad_sums) \
                if ctx.train else {}
            priced[key] = [op_cost(node.call, s, ctx, **phases) for s in node.strategies]
        node.costs = priced[key]


def _price_own_collectives(nodes: dict[str, PlanNode], order: list[str], loss: str | None,
                           output_names: list[str], ctx: CostContext) -> None:
    """A loss's own collectives (its count, the whole loss), an expert layer's all-to-alls, ring
    attention's waited sends, a forward step's outputs gathered on zig-zag axes."""
    gathered = set(output_names) if not ctx.train and ctx.mesh.zigzag_dims() else set()
    counted = summed_count_root(nodes, ctx) is not None
    waited: dict[int, list[float]] = {}  # by strategy list (one per distinct call, as ``_price_ops`` prices)
    for name in order:
        node = nodes[name]
        if name == loss or name in gathered or (node.call is not None and (node.call.target in MEAN_AS_PARTIAL
                                                                           or is_moe(node.call.target))):
            node.comm_times = [_own_seconds(node, s, ctx, name == loss, name in gathered, counted)
                               for s in node.strategies]
        elif node.call is not None and node.call.target in ATTENTION_OPS:  # ring attention's sends, as waited for
            times = waited.get(id(node.strategies))
            if times is None:
                times = waited[id(node.strategies)] = [
                    ring_waited_time(node.call, s, ctx.mesh, ctx.precision, ctx.train) * step_repeats(ctx)
                    for s in node.strategies]
            if any(times):
                node.comm_times = times


def _check_buffer_writes(captured: CapturedGraph, nodes: dict[str, PlanNode], facts: GraphFacts) -> None:
    """Refuse a buffer written in place from values that need a gradient: the buffer would
    carry each step's autograd graph into the next (whose backward then fails, or which
    keeps every step's graph alive). In eager code such a write is usually inside
    ``torch.inference_mode()``, which torch.export does not record (it records
    ``torch.no_grad()``), so the captured step differs from the model."""
    for node in captured.gm.graph.nodes:
        plan_node = nodes.get(node.name)
        if plan_node is None or not plan_node.needs_grad or node.op != "call_function" \
                or not writes_first_arg(node.target):
            continue
        root = facts.roots[node.name]
        if root in captured.buffers and root not in captured.constants:
            raise CaptureError(
                f"buffer {captured.buffers[root]!r} is written in place ({node.target}) from values that need a "
                "gradient, so it would carry this step's autograd graph into the next; update buffers under "
                "torch.no_grad() (torch.export does not record torch.inference_mode() blocks)")


def own_collectives(node: PlanNode, strategy: Strategy, ctx: CostContext, is_output: bool = False
                    ) -> list[CollectiveCall]:
    """Collectives a node's strategy runs by itself once per micro-batch: a batch-split mean loss
    summing its count, an expert-parallel layer's all-to-alls (``cost.moe``, forward and
    backward), and a forward step's output gathered on its zig-zag axes."""
    calls = loss_count_reductions(node, strategy, ctx)
    if node.call is not None:
        calls += [c.call for c in moe_collectives(node.call, strategy, ctx.mesh, ctx.precision, ctx.train)]
    if is_output:
        calls += zigzag_output_gathers(node, strategy, ctx)
    return calls


def _own_seconds(node: PlanNode, strategy: Strategy, ctx: CostContext, is_loss: bool, is_output: bool,
                 counted: bool) -> float:
    """Seconds per step of a node's own collectives (``own_collectives``), and for the loss of its
    reduction so that every rank returns all of it: once per micro-batch, or once per step
    (``cost.summed_loss``; ``counted``: with its count)."""
    replicated = loss_replication(node, strategy, ctx, counted) if is_loss else []
    summed = loss_summed_once(ctx)
    per_micro_batch = [*own_collectives(node, strategy, ctx, is_output), *([] if summed else replicated)]
    once = sum(collective_time(c, ctx.mesh) for c in replicated) if summed else 0.0
    return sum(collective_time(c, ctx.mesh) for c in per_micro_batch) * step_repeats(ctx) + once


def zigzag_output_gathers(node: PlanNode, strategy: Strategy, ctx: CostContext) -> list[CollectiveCall]:
    """A forward step's output split on a zig-zag axis is gathered there before the user sees it
    (``ParallelModule._wrap``: a DTensor's shards are contiguous chunks): the steps it runs."""
    out, meta = strategy.outputs[0], node.outputs[0]
    zigzag = ctx.mesh.zigzag_dims()
    if ctx.train or out is None or meta is None or not zigzag:
        return []
    whole = tuple(R if d in zigzag and p.is_shard() else p for d, p in enumerate(out))
    return reshard(meta, out, whole, ctx.mesh, ctx.precision) if whole != tuple(out) else []


def _op_node(node: torch.fx.Node, nodes: dict[str, PlanNode], ctx: CostContext, outputs: tuple[TensorMeta | None, ...],
             module: str, shared: BuildMemo, hints: dict[Any, int]) -> PlanNode:
    """An op node of ``module`` with its strategies (priced once its backward is settled: ``_price_ops``)."""
    producers: list[tuple[str, int]] = []
    if node.target is operator.getitem:
        src, index = node.args[0], node.args[1]
        producers.append((src.name, index))
        call = OpCall(node.target, (nodes[src.name].outputs[index], index), {}, outputs)
    else:
        args = tuple(_to_meta(a, nodes, hints, producers) for a in node.args)
        kwargs = {k: _to_meta(v, nodes, hints, producers) for k, v in node.kwargs.items()}
        call = OpCall(node.target, args, kwargs, outputs)
    rules = shared.rules
    source = nodes[node.args[0].name] if node.target is operator.getitem else None
    needs_grad = may_need_grad(node.target, rules.family_of(node.target), producers, nodes, outputs, ctx.train,
                               source, node.args[1] if source is not None else 0) \
        and not runs_without_grad(node)
    pn = PlanNode(node.name, "op", str(node.target), module, call, outputs, producers, needs_grad)
    pn.family = rules.family_of(node.target)
    pn.differentiable = differentiable(node.target, pn.family)
    pn.follower = pn.family in FOLLOWER_FAMILIES and len(producers) == 1
    if node.target in MEAN_AS_PARTIAL and len(producers) > 1:
        pn.targets_input = _view_root(producers[1][0], nodes)
    pn.dim_strategies, pn.strategies, pn.fallback = _strategies(call, ctx, shared)
    return pn


def _to_meta(a: Any, nodes: dict[str, PlanNode], hints: dict[Any, int], producers: list[tuple[str, int]]) -> Any:
    """An op's argument with each node it reads replaced by that node's output meta (noted in ``producers``).
    Not a closure: a recursive one is a reference cycle, which keeps the graph's nodes for the cyclic
    collector rather than reference counting to free."""
    if isinstance(a, torch.fx.Node):
        src = nodes.get(a.name)
        if src is None:  # non-tensor value: a symbolic size, priced at its hint where it has one
            val = a.meta.get("val")
            return hinted(val, hints) if isinstance(val, torch.SymInt) and not free_unbacked_symbols(val) else val
        producers.append((a.name, 0))
        return src.outputs[0]
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta(x, nodes, hints, producers) for x in a)
    return a


def _strategies(call: OpCall, ctx: CostContext, shared: BuildMemo) -> tuple[list[DimStrategy], list[Strategy],
                                                                            str | None]:
    """The rule's strategies for ``call``, expanded on the mesh (split dims divide its chunks), with
    the rule's fallback reason; once per distinct call and mesh (``BuildMemo.strategies``)."""
    key = call_key(call)
    memo_key = None if key is None else (key, ctx.mesh.chunks)
    known = shared.strategies.get(memo_key) if memo_key is not None else None
    if known is None:
        dim_strategies, fallback = shared.rules.strategies(call)
        known = (dim_strategies, expand(call, dim_strategies, ctx.mesh.chunks), fallback)
        if memo_key is not None:
            shared.strategies[memo_key] = known
    return known


def _view_root(name: str, nodes: dict[str, PlanNode]) -> str | None:
    """The user input ``name`` holds the same elements as (through reshapes only), if any."""
    node = nodes[name]
    while node.kind == OP and node.call is not None and node.call.target in SAME_ELEMENTS and len(node.args) == 1:
        node = nodes[node.args[0][0]]
    return node.name if node.kind == INPUT else None


def price_edge(graph: PlanGraph, producer: str, out_index: int, consumer: str, arg: int,
               produced: Strategy, chosen: Strategy, ctx: CostContext) -> EdgeCost:
    src = graph.nodes[producer]
    meta = src.outputs[out_index]
    assert meta is not None
    produced_pl = produced.outputs[out_index]
    assert produced_pl is not None
    return edge_cost(meta, produced_pl, chosen.inputs[arg], chosen, ctx, **edge_flags(graph, producer, consumer, arg))


def edge_flags(graph: PlanGraph, producer: str, consumer: str, arg: int) -> dict[str, bool]:
    """What ``edge_cost`` and ``held_reshard_bytes`` need to know about an edge besides
    placements: a parameter's edge, whether a gradient flows back, whether the consumer
    recomputes in backward, whether its backward (if it runs one) keeps this input, whether
    it gathers its parameters again for that instead of holding them, and whether the
    parameter is read once, so that its collectives join its block's (``cost.groups``)."""
    node = graph.nodes[consumer]
    return {"from_parameter": graph.nodes[producer].kind == PARAM,
            "needs_grad": graph.sends_gradient(producer, consumer), "recomputed": node.recompute,
            "saves_input": node.needs_grad and _saves_input(graph, node, arg), "regathered": node.regather,
            "grouped": producer in graph.read_once}


def _saves_input(graph: PlanGraph, node: PlanNode, arg: int) -> bool:
    """Whether the op's backward keeps its ``arg``-th tensor input (``cost.saved``, read off
    autograd on meta tensors): an embedding keeps its indices, not its table. Where the probe
    cannot tell (a subgraph call, arguments it cannot lay out): kept, never underpriced."""
    saved = cached_probe(node, graph.nodes, graph.saved_probes)
    return True if saved is None or arg >= len(saved.inputs) else saved.inputs[arg]


__all__ = ["PlanNode", "PlanGraph", "build_plan_graph", "price_edge", "placeholder_strategies", "leaf_costs"]
