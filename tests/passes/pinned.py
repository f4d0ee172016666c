"""Graphs with pinned strategies: what a pass receives, built without the planner.

A test builds an FX graph of a few nodes by hand, gives its nodes values (``propagate``: the
``meta["val"]`` torch.export leaves, here real tensors of the example inputs' shapes), and
pins a strategy per node (``pin``): ``node.meta`` as ``annotate_placements`` leaves it, and a
``PassContext`` whose planning graph lists the nodes as ``problem.graph.build_plan_graph``
would (kinds, producers, calls) but carries no candidates and no costs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_map

from autopar.capture.graph import TensorMeta
from autopar.cost.model import CostContext
from autopar.cost.precision import PRECISIONS
from autopar.mesh import Mesh
from autopar.passes.context import PLAN_NAME, STRATEGY, PassContext
from autopar.rules.loss import MEAN_AS_PARTIAL
from autopar.rules.strategy import OpCall, Strategy, parse_placements
from autopar.problem.shared import module_path, output_metas
from autopar.problem.nodes import BUFFER, INPUT, OP, PARAM, PlanGraph, PlanNode

RUNTIME_MODULES = ("reshard", "regather", "prefetch", "gather_group", "backward_starts", "partial_mean_loss", "vocab_embedding",
                   "context_attention", "ring_attention", "moe_dispatch_combine", "random", "recompute")
"""The modules the passes write calls of (``passes.parallelize_graph``'s ``modules``)."""
RESHARDS = ("reshard", "regather")
"""Calls insert_reshards writes: the planner never saw them (``plan_graph`` looks through them)."""


class SliceRows(nn.Module):
    """What ``self.reshard(x, 'R', 'S(0)')`` hands the rank at ``rank`` of ``ways`` (its rows of a
    whole tensor): lets a test run a program whose inputs arrive whole, without a process group."""

    def __init__(self, rank: int, ways: int) -> None:
        super().__init__()
        self.rank, self.ways = rank, ways

    def forward(self, x: torch.Tensor, src: str, dst: str, *grad: str, **kwargs: Any) -> torch.Tensor:
        assert (src, dst) == ("R", "S(0)"), (src, dst)
        return x.chunk(self.ways)[self.rank]


class NotRun(nn.Module):
    """Stands in for a runtime module a test only reads the calls of (a reshard needs a process group)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pass test's stand-in runtime module was called")


def strategy(out: str | tuple[str | None, ...] | None, *inputs: str) -> Strategy:
    """A strategy in plans' notation, one letter per mesh dim: ``strategy("S(0)R", "S(0)R", "RR")``
    is an output placed ``S(0)R`` from inputs placed ``S(0)R`` and ``RR``; a tuple of outputs for
    a multi-output op, None for an op without tensor outputs; no inputs for a leaf."""
    outs = out if isinstance(out, tuple) else () if out is None else (out,)
    return Strategy(tuple(None if o is None else parse_placements(o) for o in outs),
                    tuple(parse_placements(i) for i in inputs))


def graph_module(graph: torch.fx.Graph, **modules: nn.Module) -> torch.fx.GraphModule:
    """``graph`` in a module holding every runtime module the passes call: ``modules`` where
    given (a test that runs the program), else a ``NotRun``."""
    root = nn.Module()
    every = {name: NotRun() for name in RUNTIME_MODULES} | modules
    for name, module in every.items():
        root.add_module(name, module)
    gm = torch.fx.GraphModule(root, graph)  # keeps only the modules ``graph`` names
    for name, module in every.items():  # the passes' calls need the others
        gm.add_submodule(name, module)
    return gm


class _Recorder(torch.fx.Interpreter):
    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(self.module.get_submodule(target), NotRun):
            return args[0]  # a reshard's global value is its input's
        return super().call_module(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        if n.op != "output":
            n.meta["val"] = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)
        return value


def propagate(gm: torch.fx.GraphModule, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    """Run ``gm`` on ``inputs`` (the whole, global tensors) and keep each node's value in
    ``meta["val"]``: the shapes and dtypes the passes read. A call of a ``NotRun`` runtime module
    (a reshard written by hand) passes its first argument through."""
    with torch.no_grad():
        _Recorder(gm).run(*inputs)
    return gm


def op(graph: torch.fx.Graph, name: str, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
    """``graph``'s call of ``target`` named ``name``, as export names it (``mm``, not ``mm_default``)."""
    return graph.create_node("call_function", target, args, kwargs, name=name)


def in_module(node: torch.fx.Node, path: str) -> torch.fx.Node:
    """Mark ``node`` as computed inside module ``path`` (``layers.0.mlp``), as export's ``nn_module_stack``."""
    node.meta["nn_module_stack"] = {path: (path, "torch.nn.Module")}
    return node


def pin(gm: torch.fx.GraphModule, strategies: dict[str, Strategy], mesh: dict[str, int], *,
        params: dict[str, str] | None = None, buffers: dict[str, str] | None = None, train: bool = False,
        loss: str | None = None, micro_batches: int = 1, size_hints: dict[Any, int] | None = None,
        **options: Any) -> PassContext:
    """Pin ``strategies`` (node name -> strategy) on ``gm``'s nodes and return the PassContext
    the passes read. ``params`` / ``buffers``: placeholder name -> FQN (other placeholders are
    user inputs); ``loss``: the node holding a training step's loss; ``size_hints``: the planning
    size of each data-dependent size symbol (``CapturedGraph.size_hints``); ``options``: the other
    PassContext fields (``input_sharded``, ``memory``, ``sync_dims``, ...)."""
    params, buffers = params or {}, buffers or {}
    for node in gm.graph.nodes:
        if node.name in strategies:
            node.meta[STRATEGY] = strategies[node.name]
            node.meta[PLAN_NAME] = node.name
    graph = plan_graph(gm, set(strategies), params, buffers, train, loss, size_hints or {})
    ctx = CostContext(mesh=Mesh(mesh, "cpu"), precision=PRECISIONS["fp32"], train=train,
                      inputs_whole=not options.get("input_sharded", False), micro_batches=micro_batches)
    options.setdefault("sync_dims", {})
    return PassContext(graph=graph, chosen=dict(strategies), ctx=ctx, **options)


def plan_graph(gm: torch.fx.GraphModule, planned: set[str], params: dict[str, str], buffers: dict[str, str],
               train: bool, loss: str | None, hints: dict[Any, int]) -> PlanGraph:
    """The planning graph of ``gm``'s ``planned`` nodes, without strategies or costs: what the
    passes read of it (kinds, FQNs, producers, calls, outputs, whether gradients flow)."""
    nodes: dict[str, PlanNode] = {}
    for node in gm.graph.nodes:
        if node.name not in planned:
            continue
        outputs = output_metas(node.meta.get("val"), hints)
        if node.op == "placeholder":
            kind = PARAM if node.name in params else BUFFER if node.name in buffers else INPUT
            fqn = params.get(node.name) or buffers.get(node.name)
            needs_grad = train and kind == PARAM
            nodes[node.name] = PlanNode(node.name, kind, kind, "", None, outputs, [], needs_grad, fqn=fqn)
        else:
            nodes[node.name] = _op_node(node, nodes, outputs, train)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    names = [a.name for a in torch.utils._pytree.tree_leaves(output.args[0]) if isinstance(a, torch.fx.Node)]
    return PlanGraph(nodes, list(nodes), loss, names)


def _op_node(node: torch.fx.Node, nodes: dict[str, PlanNode], outputs: tuple[TensorMeta | None, ...],
             train: bool) -> PlanNode:
    """An op's plan node: its planned tensor arguments as producers, the others as they are."""
    producers: list[tuple[str, int]] = []

    def to_meta(a: Any) -> Any:
        while isinstance(a, torch.fx.Node) and a.op == "call_module" and a.target in RESHARDS:
            a = a.args[0]  # the captured graph the planner saw had no reshards
        if isinstance(a, torch.fx.Node) and a.name in nodes:
            producers.append((a.name, 0))
            return nodes[a.name].outputs[0]
        if isinstance(a, (list, tuple)):
            return type(a)(to_meta(x) for x in a)
        return a

    if node.target is operator.getitem:
        src, index = node.args
        producers.append((src.name, index))  # type: ignore[union-attr]
        call = OpCall(node.target, (nodes[src.name].outputs[index], index), {}, outputs)  # type: ignore[union-attr]
    else:
        call = OpCall(node.target, tuple(to_meta(a) for a in node.args),
                      {k: to_meta(v) for k, v in node.kwargs.items()}, outputs)
    needs_grad = train and any(nodes[src].needs_grad for src, _ in producers)
    plan_node = PlanNode(node.name, OP, str(node.target), module_path(node), call, outputs, producers, needs_grad)
    if node.target in MEAN_AS_PARTIAL and len(producers) > 1 and nodes[producers[1][0]].kind == INPUT:
        plan_node.targets_input = producers[1][0]
    return plan_node
