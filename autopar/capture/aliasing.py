"""Which captured nodes write into their inputs, and which are views of them (from the op
schemas: ``Tensor(a!)`` is written in place, ``Tensor(a)`` is aliased by the output).

Export's training IR keeps in-place ops (``masked_fill_``, ``copy_`` into a slice, T5's
``_shift_right``). A parallel program stays right only if every rank writes where the
single-device program did: into the tensor as produced, which a reshard would replace
with a copy. So in a storage tree that some op writes into (a root tensor, the views of
it, the in-place ops on them), every view and in-place op takes its input as produced,
and a tensor read after a write is a new version (a reshard made of the old one is stale).

A higher-order op (a ``torch.no_grad()`` block, ``capture.subgraphs``) writes into the
operands its subgraph writes into, directly or through views or nested blocks, and an
output of it that returns an operand's storage is a view of that operand.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx

from autopar.capture.schema import schema_arg
from autopar.capture.subgraphs import is_higher_order, operands, placeholders, subgraph_call, subgraphs


def _schema(node: torch.fx.Node) -> Any:
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def writes_first_arg(target: Any) -> bool:
    """True for an in-place op (``Tensor(a!) self``): it writes into and returns its first input."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def written_arg_names(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
    """Schema names of the arguments a call writes in place: those marked ``Tensor(a!)``,
    and batch norm's running statistics in training mode, which the composite
    ``batch_norm`` updates although its schema does not say so."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return set()
    names = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    if target is torch.ops.aten.batch_norm.default and schema_arg(target, args, kwargs, "training"):
        names |= {n for n in ("running_mean", "running_var") if schema_arg(target, args, kwargs, n) is not None}
    return names


def written_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensors ``node`` writes into in place (``self`` of ``copy_``, ``out`` of an out= op,
    batch norm's running statistics, what a higher-order op's subgraph writes into)."""
    if is_higher_order(node):
        return _written_operands(node)
    schema = _schema(node)
    if schema is None:
        return []
    values = [schema_arg(node.target, node.args, node.kwargs, name)
              for name in sorted(written_arg_names(node.target, node.args, node.kwargs))]
    return [value for value in values if isinstance(value, torch.fx.Node)]


def written_placeholders(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The placeholders of a subgraph whose storage it writes into."""
    return {root for root in _written_roots(gm.graph) if root.op == "placeholder"}


def _written_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    call = subgraph_call(node)
    if call is not None:
        gm, values = call
        written = written_placeholders(gm)
        return [v for p, v in zip(placeholders(gm), values) if p in written and isinstance(v, torch.fx.Node)]
    # An op whose operands autopar cannot match to its subgraphs' placeholders: any may be written.
    return operands(node) if any(written_placeholders(sub) for sub in subgraphs(node)) else []


def _returned_operand(node: torch.fx.Node, index: int, follow: Callable[[torch.fx.Node], torch.fx.Node] | None = None
                      ) -> torch.fx.Node | None:
    """The operand of higher-order op ``node`` whose storage its output ``index`` is, if any
    (with ``follow=same_tensor``: the operand that output is, as a tensor object)."""
    call = subgraph_call(node)
    if call is None:
        return None
    gm, values = call
    returned = gm.graph.output_node().args[0]
    value = returned[index] if isinstance(returned, (list, tuple)) else returned
    if not isinstance(value, torch.fx.Node) or (root := (follow or storage_root)(value)).op != "placeholder":
        return None
    operand = values[placeholders(gm).index(root)]
    return operand if isinstance(operand, torch.fx.Node) else None


def same_tensor(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor object ``node`` is at run time: an in-place op returns its input
    itself, a block (higher-order op) can return an operand itself. A view is a new tensor
    (with its own autograd identity: one made under no_grad needs no gradient)."""
    while True:
        if node.op == "call_function" and writes_first_arg(node.target) and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and \
                isinstance(source := node.args[0], torch.fx.Node) and is_higher_order(source) and \
                (operand := _returned_operand(source, node.args[1], same_tensor)) is not None:
            node = operand
        else:
            return node


def returned_operand(node: torch.fx.Node, index: int) -> torch.fx.Node | None:
    """The operand that output ``index`` of higher-order op ``node`` is, as a tensor object
    (``self.w.clamp_(-1, 1)`` inside a no_grad block returns the parameter itself)."""
    return _returned_operand(node, index, same_tensor)


def _returned_operands(node: torch.fx.Node) -> set[torch.fx.Node]:
    outputs = node.meta.get("val")
    count = len(outputs) if isinstance(outputs, (list, tuple)) else 1
    return {a for i in range(count) if (a := _returned_operand(node, i)) is not None}


def viewed_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``node``'s output shares storage with: the viewed (or in-place written)
    first argument, or for ``getitem`` the multi-output view (``split``) it picks from, or
    the operand of a higher-order op that the picked output returns."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            return None
        return _returned_operand(source, node.args[1]) if is_higher_order(source) else viewed_arg(source)
    schema = _schema(node)
    if schema is None or not schema.arguments or schema.arguments[0].alias_info is None:
        return None
    first = node.args[0] if node.args else None
    return first if isinstance(first, torch.fx.Node) else None


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node that owns ``node``'s storage (itself unless it is a view or written in place)."""
    while (up := viewed_arg(node)) is not None:
        node = up
    return node


def _written_roots(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    return {storage_root(t) for node in graph.nodes for t in written_args(node)}


def as_produced_args(graph: torch.fx.Graph) -> dict[torch.fx.Node, set[torch.fx.Node]]:
    """Per node, the inputs it must receive exactly as produced: what it writes into, and,
    in a storage tree something writes into, the tensor a view (or in-place op) aliases."""
    roots = _written_roots(graph)
    out: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    if not roots:
        return out
    for node in graph.nodes:
        pinned = set(written_args(node))
        source = viewed_arg(node)
        if source is not None and node.target is not operator.getitem and storage_root(source) in roots:
            pinned.add(source)
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and \
                storage_root(node) in roots:
            pinned.add(node.args[0])
        if is_higher_order(node):  # an operand it returns is viewed by its output
            pinned |= {a for a in _returned_operands(node) if storage_root(a) in roots}
        if pinned:
            out[node] = pinned
    return out


def prior_writes(graph: torch.fx.Graph) -> dict[tuple[torch.fx.Node, torch.fx.Node], tuple[torch.fx.Node, ...]]:
    """(reader, input) -> the in-place writes into that input's storage that came before the
    read, in order; only reads after some write are listed. Autograd routes the reader's
    gradient into the values those writes wrote (``out[:, t] = f(w)`` into a ``zeros_like``)."""
    writes: dict[torch.fx.Node, tuple[torch.fx.Node, ...]] = {}
    out: dict[tuple[torch.fx.Node, torch.fx.Node], tuple[torch.fx.Node, ...]] = {}
    for node in graph.nodes:
        for arg in _inputs(node):
            before = writes.get(storage_root(arg), ())
            if before:
                out[(node, arg)] = before
        for target in written_args(node):
            root = storage_root(target)
            writes[root] = (*writes.get(root, ()), node)
    return out


def read_versions(graph: torch.fx.Graph) -> dict[tuple[torch.fx.Node, torch.fx.Node], int]:
    """(reader, input) -> how many in-place writes into that input's storage came before the
    read; only nonzero versions are listed. Reads of different versions of one tensor must
    not share a reshard: one made before a write holds the old values."""
    return {key: len(writes) for key, writes in prior_writes(graph).items()}


def _inputs(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    for a in node.all_input_nodes:
        if a not in seen:
            seen.add(a)
            yield a


__all__ = ["writes_first_arg", "written_arg_names", "written_args", "written_placeholders", "viewed_arg",
           "storage_root", "same_tensor", "returned_operand", "as_produced_args", "prior_writes",
           "read_versions"]
