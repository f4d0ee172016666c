"""A step captured once with its micro-batch size symbolic, priced at any micro-batch size.

A pipeline's stages are planned for one micro-batch; the search over micro-batch counts
(``search.pipeline``) needs the stages' costs at each count's micro-batch size. torch.export
keeps a dim symbolic when told (``torch.export.Dim``): every size derived from it is a sympy
expression in one symbol (the view of a linear's output to (b, seq, heads, head dim) reads
``sym_size(tokens, 0)``, a flattened (b x seq, hidden) is ``2048*b``). One such capture, its symbol
bound to a size in ``CapturedGraph.size_hints`` (``TensorMeta.of`` substitutes it into every
shape), gives the graph at any micro-batch size without tracing again, so the cost functions
price a stage plan at every count from the same expressions.

Only for pricing: the per-rank program is built from a concrete capture (the step at the chosen
count), never from this one (``runtime.program`` refuses it). Export may name its nodes apart from a
concrete capture's (the symbol's own arithmetic takes names), so a plan is mapped onto it by place in
graph order (``search.planned.repriced``). Refused (a ``SymbolicRefused`` naming why: the search then solves each
count) where the graph's sizes do not follow from the symbol alone: export specialized the batch (a
guard on its value), sizes the data decides (``capture.unbacked``), floats or conditions computed from
the size, or higher-order subgraphs (priced from their own shapes, ``cost.blocks``, which read no hints).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import Dim

from autopar.capture.graph import CapturedGraph
from autopar.capture.subgraphs import nested_graph_modules
from autopar.capture.unbacked import unbacked_nodes

BATCH_DIM = "micro_batch"
"""The name of the symbolic micro-batch dim given to torch.export."""


class SymbolicRefused(Exception):
    """The step cannot be priced from one symbolic capture (the message says why)."""


def batch_rows(flat: tuple[Any, ...]) -> int:
    """The micro-batch size of a symbolic capture: the first input's leading dim."""
    first = next((v for v in flat if isinstance(v, torch.Tensor) and v.ndim), None)
    if first is None:
        raise SymbolicRefused("the step has no tensor input with a batch dim")
    return int(first.shape[0])


def at_rows(captured: CapturedGraph, rows: int | None) -> CapturedGraph:
    """A reused capture; a symbolic one priced at ``rows`` (its graph shared, never changed by planning)."""
    if rows is None or captured.batch_symbol is None:
        return captured
    return replace(captured, size_hints={**captured.size_hints, captured.batch_symbol: rows},
                   notes=list(captured.notes))


def batch_shapes(flat: tuple[Any, ...], rows: int) -> tuple[dict[int, Dim] | None, ...]:
    """``dynamic_shapes`` for the step's flat inputs: dim 0 of each tensor of ``rows`` rows (the
    leaves ``memory.options.slice_batch`` cuts into micro-batches) is one symbolic dim."""
    if rows < 2:  # export specializes sizes 0 and 1: a symbol needs an example of 2 rows or more
        raise SymbolicRefused(f"a micro-batch of {rows} row cannot be captured symbolic (export specializes 1)")
    dim = Dim(BATCH_DIM, min=1, max=1 << 30)
    shapes = tuple({0: dim} if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else None for v in flat)
    if not any(shapes):
        raise SymbolicRefused(f"no input has a leading dim of {rows} rows")
    return shapes


def batch_symbol(gm: torch.fx.GraphModule, user_inputs: list[str], shapes: tuple[dict[int, Dim] | None, ...]
                 ) -> sympy.Symbol:
    """The symbol export gave the micro-batch dim, checked to be the only free one in the graph."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    sizes = [placeholders[name].meta["val"].shape[0] for name, s in zip(user_inputs, shapes) if s]
    exprs = {s.node.expr for s in sizes if isinstance(s, torch.SymInt)}
    if len(exprs) != 1 or not isinstance(next(iter(exprs)), sympy.Symbol):
        raise SymbolicRefused("export specialized the micro-batch size (the model guards on its value)")
    if unbacked_nodes(gm):
        raise SymbolicRefused("the step makes data-dependent sizes (capture.unbacked)")
    if next(iter(nested_graph_modules(gm)), None) is not None:
        raise SymbolicRefused("the step has higher-order subgraphs, priced from their own shapes")
    (symbol,) = exprs
    leaves = [leaf for node in gm.graph.nodes for leaf in pytree.tree_leaves(node.meta.get("val"))]
    if any(isinstance(leaf, (torch.SymFloat, torch.SymBool)) for leaf in leaves):
        raise SymbolicRefused("the step computes floats or conditions from the micro-batch size")
    others = {sym for leaf in leaves if isinstance(leaf, (torch.Tensor, torch.SymInt)) for sym in _symbols(leaf)} \
        - {symbol}
    if others:
        raise SymbolicRefused(f"sizes depend on more than the micro-batch ({sorted(map(str, others))[0]})")
    return symbol


def _symbols(leaf: torch.Tensor | torch.SymInt) -> set[sympy.Symbol]:
    sizes = leaf.shape if isinstance(leaf, torch.Tensor) else (leaf,)
    return {sym for s in sizes if isinstance(s, torch.SymInt) for sym in s.node.expr.free_symbols}


def named_as(symbolic: CapturedGraph, concrete: CapturedGraph) -> bool:
    """Name ``symbolic``'s nodes as ``concrete`` names the same nodes (in place), so that a plan made on one
    names the nodes of the other; False, renaming nothing, where the graphs do not align: the symbolic one's
    nodes must be the concrete one's, by op and target in order, with only the symbol's own size arithmetic
    (nodes computing a ``SymInt``: ``sym_size(tokens, 0)``) between them, whose names export gave away.
    The symbolic graph is only priced, never run nor recompiled: its names are set on the nodes and in the
    graph's namespace, not made again by FX."""
    twins = list(concrete.gm.graph.nodes)
    names: dict[torch.fx.Node, str] = {}
    for node in symbolic.gm.graph.nodes:
        twin = twins[len(names)] if len(names) < len(twins) else None
        if twin is not None and (node.op, node.target) == (twin.op, twin.target):
            names[node] = twin.name
        elif node.op != "call_function" or not isinstance(node.meta.get("val"), torch.SymInt):
            return False
    if len(names) != len(twins):
        return False
    taken = set(names.values())
    sizes = (n for n in symbolic.gm.graph.nodes if n not in names)
    spare = (name for k in range(len(symbolic.gm.graph.nodes)) if (name := f"micro_batch_size_{k}") not in taken)
    for node, name in [*names.items(), *((n, next(spare)) for n in sizes)]:
        _set_name(node, name)
    return True


def _set_name(node: torch.fx.Node, name: str) -> None:
    namespace = node.graph._graph_namespace
    node.name = name
    namespace._obj_to_name[node] = name
    namespace._used_names.add(name)
