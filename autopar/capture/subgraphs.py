"""Higher-order ops: calls that run a subgraph of the captured GraphModule.

torch.export puts a ``torch.no_grad()`` block inside forward (an EMA of activations, a
step counter) into ``wrap_with_set_grad_enabled(False, submod, *operands)`` and an
autocast region into ``wrap_with_autocast(device, dtype, enabled, cache, submod,
*operands)``: the subgraph is a ``get_attr`` of a child GraphModule whose placeholders
take the operands in order, and may itself call such ops (nested blocks). The subgraph
can write into its operands in place, so the op writes into them; what it returns can be
an operand itself (``e = self.ema`` inside the block), so its outputs may alias them.

Later stages place such a call as a whole (replicated: its subgraph is written for
global tensors) and never rewrite inside it except where noted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

_hop = torch.ops.higher_order
WRAPPERS: dict[Any, int] = {_hop.wrap_with_set_grad_enabled: 1, _hop.wrap_with_autocast: 4}
"""Higher-order op -> position of its subgraph argument; the subgraph's placeholders take
the arguments after it, one each."""


def is_higher_order(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def module_of(node: torch.fx.Node) -> torch.fx.GraphModule | None:
    """The GraphModule a ``get_attr`` node names, if it is one."""
    root = node.graph.owning_module
    if node.op != "get_attr" or root is None:
        return None
    value: Any = root
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.fx.GraphModule) else None


def subgraphs(node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """Every subgraph a higher-order op runs (its ``get_attr`` arguments), in argument order."""
    if not is_higher_order(node):
        return []
    found = (module_of(a) for a in node.all_input_nodes)
    return [gm for gm in found if gm is not None]


def subgraph_call(node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[Any]] | None:
    """For a wrapper (``WRAPPERS``): its subgraph and the value bound to each of the
    subgraph's placeholders, in order. None for any other node."""
    if node.op != "call_function" or node.target not in WRAPPERS:
        return None
    at = WRAPPERS[node.target]
    graph_arg = node.args[at] if len(node.args) > at else None
    gm = module_of(graph_arg) if isinstance(graph_arg, torch.fx.Node) else None
    if gm is None:
        return None
    return gm, list(node.args[at + 1:])


def placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors a higher-order op hands its subgraphs (its inputs that are not subgraphs)."""
    return [a for a in node.all_input_nodes if module_of(a) is None]


def runs_without_grad(node: torch.fx.Node) -> bool:
    """A ``torch.no_grad()`` block: no gradient flows through it to its operands."""
    return node.op == "call_function" and node.target is _hop.wrap_with_set_grad_enabled \
        and node.args[0] is False


def nested_graph_modules(gm: torch.fx.GraphModule) -> Iterator[torch.fx.GraphModule]:
    """Every subgraph ``gm``'s higher-order ops run, and theirs, depth first (each once)."""
    seen: set[int] = set()
    stack = [gm]
    while stack:
        for node in stack.pop().graph.nodes:
            for sub in subgraphs(node):
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield sub
                    stack.append(sub)


__all__ = ["WRAPPERS", "is_higher_order", "module_of", "subgraphs", "subgraph_call", "placeholders", "operands",
           "runs_without_grad", "nested_graph_modules"]
