"""Strided shards where a consumer asks for them: fused projections stay local.

A fused projection (``qkv = x @ [Wq; Wk; Wv].T`` then ``split(h)``, or a view to
``(b, s, 3, heads, head_dim)``) split on its output features by plain ``Shard`` puts
all of q on some ranks and all of v on others, so the split needs the whole tensor
back. Split as ``strided(d, 3)`` (each rank holds its slice of q, of k and of v:
Megatron's interleaved QKV) the split and the heads stay local. The view and split
rules state which strided placement they can consume; this pass offers it upstream.

Walking the graph from the loss back to the parameters, every strided placement some
strategy of a node takes as input becomes a demand on that input's producer. A
producer whose op commutes with permuting that dim (matmuls on a kept index,
elementwise ops, views, dropout: ``EQUIVARIANT_FAMILIES``) gains, for each of its
single-dim strategies that shards the demanded output dim, a twin with every ``Shard``
made strided with the same factor: permuting a dim consistently in all operands that
carry it permutes the output the same way. A parameter or input gains the strided
placement as a leaf choice. The solver then prices strided and plain layouts alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

from torch.distributed.tensor import Placement, Shard

from autopar.cost.model import CostContext, NodeCost, op_cost
from autopar.rules import RuleSet, expand
from autopar.rules.strategy import DimStrategy, Strategy, is_strided, split_factor, strided
from autopar.problem.graph import call_key, leaf_costs, placeholder_strategies
from autopar.problem.nodes import OP, PlanGraph

EQUIVARIANT_FAMILIES = frozenset({"matmul", "pointwise", "view", "dropout"})
"""Op families whose shard-output strategies commute with permuting the sharded dim."""

TwinMemo = dict[Hashable, tuple[list[DimStrategy], list[Strategy], list[NodeCost], str | None]]
"""A node's strategies with their strided twins, costs and fallback reason, per distinct call and
demand: the layers of a deep model ask for the same twins."""

Demand = tuple[int, int, int]
"""(output index, tensor dim, split factor) a consumer can take strided."""


def strided_twin(strategy: DimStrategy, factor: int) -> DimStrategy:
    """The same strategy with every plain Shard strided by ``factor``."""

    def twin(p: Placement) -> Placement:
        return strided(p.dim, factor) if isinstance(p, Shard) else p

    return DimStrategy(tuple(None if p is None else twin(p) for p in strategy.outputs),
                       tuple(twin(p) for p in strategy.inputs))


def _twins(dim_strategies: list[DimStrategy], demands: set[Demand]) -> list[DimStrategy]:
    found: list[DimStrategy] = []
    for index, dim, factor in sorted(demands):
        for s in dim_strategies:
            if s.outputs[index] != Shard(dim):
                continue
            placements = [*s.inputs, *(p for p in s.outputs if p is not None)]
            if any(is_strided(p) for p in placements) or not all(isinstance(p, Shard) for p in s.outputs
                                                                  if p is not None):
                continue  # already strided, or an output Partial/Replicate the twin would not permute
            found.append(strided_twin(s, factor))
    return found


def add_strided_strategies(graph: PlanGraph, rules: RuleSet, ctx: CostContext) -> None:
    """Offer strided layouts upstream of every consumer that can take one (in place)."""
    demands: dict[str, set[Demand]] = defaultdict(set)
    memo: TwinMemo = {}
    for name in reversed(graph.order):
        node = graph.nodes[name]
        wanted = demands.get(name)
        if wanted and node.kind == OP and node.call is not None and \
                rules.family_of(node.call.target) in EQUIVARIANT_FAMILIES:
            key = call_key(node.call)
            key = None if key is None else (key, tuple(sorted(wanted)), node.needs_grad, node.saved, node.kept,
                                            node.grad_sums)
            known = memo.get(key) if key is not None else None
            if known is None:
                twins = [t for t in _twins(node.dim_strategies, wanted) if t not in node.dim_strategies]
                known = (node.dim_strategies, node.strategies, node.costs, node.fallback)
                if twins:
                    dims = [*node.dim_strategies, *twins]
                    strategies = expand(node.call, dims, ctx.mesh.chunks)
                    costs = [op_cost(node.call, s, ctx, backward=node.needs_grad, saved=node.saved,
                                     kept=node.kept, grad_sums=node.grad_sums) for s in strategies]
                    known = (dims, strategies, costs, node.fallback)
                if key is not None:
                    memo[key] = known
            node.dim_strategies, node.strategies, node.costs, _ = known
        elif wanted and node.kind != OP:
            meta = node.outputs[0]
            assert meta is not None
            extra = [strided(dim, factor) for index, dim, factor in sorted(wanted) if index == 0]
            node.strategies = placeholder_strategies(meta, ctx.mesh.chunks, extra)
            node.costs = leaf_costs(node, ctx)
        for s in node.dim_strategies:
            for k, p in enumerate(s.inputs):
                if is_strided(p):
                    src, index = node.args[k]
                    demands[src].add((index, p.dim, split_factor(p)))
