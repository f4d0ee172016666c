"""localize_shapes: size arguments written for the global tensor become this rank's.

view/reshape/expand/unflatten name the output shape: it is divided by the output's
placements. split names the pieces' sizes along the split dim: local ones when a
strided input splits locally. squeeze without dims would also drop a dim that
sharding shrank to size 1 locally, so it names the globally size-1 dims instead. A
grouped convolution split by groups runs this rank's groups only. The subgraph of a
higher-order op (a ``torch.no_grad()`` block) keeps its global sizes: the op must run
replicated, which is checked here.
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.capture.subgraphs import is_higher_order
from autopar.passes.context import PassContext, strategy_of
from autopar.rules.conv import CONV_OPS, local_groups
from autopar.rules.strategy import OpCall, Placements, Strategy, positional_args, shard_dim

aten = torch.ops.aten
SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def local_shape(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> list[int]:
    local = list(shape)
    for p, n in zip(placements, mesh_shape):
        d = shard_dim(p)
        if d is not None:
            local[d] //= n
    return local


def localize_shapes(gm: torch.fx.GraphModule, pc: PassContext) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        strategy = strategy_of(node)
        if node.op != "call_function" or strategy is None:
            continue
        if is_higher_order(node):
            _check_replicated(node, strategy)
            continue
        out = node.meta["val"]
        if node.target in SHAPE_ARG_OPS:
            local = local_shape(tuple(out.shape), strategy.outputs[0], pc.mesh_shape)
            node.args = (node.args[0], _keep_symbolic(local, list(node.args[1]), tuple(out.shape)))
        elif node.target is aten.unflatten.int:
            dim = node.args[1]
            local = local_shape(tuple(out.shape), strategy.outputs[0], pc.mesh_shape)
            dim = dim if dim >= 0 else dim + node.args[0].meta["val"].ndim
            node.args = (node.args[0], node.args[1], local[dim: dim + len(node.args[2])])
        elif node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            x = node.args[0].meta["val"]
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            dim = dim if dim >= 0 else dim + x.ndim
            sizes = [local_shape(tuple(o.shape), pl, pc.mesh_shape)[dim] for o, pl in zip(out, strategy.outputs)]
            node.args = (node.args[0], sizes[0] if node.target is aten.split.Tensor else sizes, *node.args[2:])
        elif node.target in (aten.squeeze.default, aten.squeeze.dim):
            x = node.args[0].meta["val"]
            dims = [d for d in range(x.ndim) if type(x.shape[d]) is int and x.shape[d] == 1]  # noqa: E721
            if node.target is aten.squeeze.dim:
                d = node.args[1] if node.args[1] >= 0 else node.args[1] + x.ndim
                dims = [d] if d in dims else []
            node.target = aten.squeeze.dims
            node.args = (node.args[0], dims)
        elif node.target in CONV_OPS:
            _localize_groups(node, strategy, pc.mesh_shape)
    gm.recompile()
    return gm


def _keep_symbolic(local: list[int], written: list[object], shape: tuple[object, ...]) -> list[object]:
    """``local`` with each data-dependent dim (a SymInt in the captured shape, never split) as the graph
    wrote it (a size node computed at run time): the planning-time size would freeze one routing's count."""
    if len(written) != len(shape):
        return local
    return [w if not isinstance(s, int) else n for n, w, s in zip(local, written, shape)]


def _check_replicated(node: torch.fx.Node, strategy: Strategy) -> None:
    placements = [p for pl in (*strategy.inputs, *strategy.outputs) if pl is not None for p in pl]
    if not all(p.is_replicate() for p in placements):
        raise RuntimeError(f"{node.name} ({node.target}) runs a subgraph written for whole tensors, but the plan "
                           f"places it {strategy}: it must run replicated")


def _localize_groups(node: torch.fx.Node, strategy: Strategy, mesh_shape: tuple[int, ...]) -> None:
    call = OpCall(node.target, node.args, dict(node.kwargs))
    groups = local_groups(call, strategy.inputs[1], mesh_shape)
    if groups == call.get("groups", 1):
        return
    if "groups" in node.kwargs:
        node.update_kwarg("groups", groups)
        return
    args = positional_args(node.target, node.args, node.kwargs)  # kwargs folded in by name
    args[[a.name for a in node.target._schema.arguments].index("groups")] = groups
    node.args, node.kwargs = tuple(args), {}
