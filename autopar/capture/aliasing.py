"""Which captured nodes write into their inputs, and which are views of them (from the op
schemas: ``Tensor(a!)`` is written in place, ``Tensor(a)`` is aliased by the output).

Export's training IR keeps in-place ops (``masked_fill_``, ``copy_`` into a slice, T5's
``_shift_right``). A parallel program stays right only if every rank writes where the
single-device program did: into the tensor as produced, which a reshard would replace
with a copy. So in a storage tree that some op writes into (a root tensor, the views of
it, the in-place ops on them), every view and in-place op takes its input as produced,
and a tensor read after a write is a new version (a reshard made of the old one is stale).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch.fx

from autopar.capture.schema import schema_arg


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
    batch norm's running statistics)."""
    schema = _schema(node)
    if schema is None:
        return []
    values = [schema_arg(node.target, node.args, node.kwargs, name)
              for name in sorted(written_arg_names(node.target, node.args, node.kwargs))]
    return [value for value in values if isinstance(value, torch.fx.Node)]


def viewed_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``node``'s output shares storage with: the viewed (or in-place written)
    first argument, or for ``getitem`` the multi-output view (``split``) it picks from."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return viewed_arg(source) if isinstance(source, torch.fx.Node) else None
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
        if pinned:
            out[node] = pinned
    return out


def read_versions(graph: torch.fx.Graph) -> dict[tuple[torch.fx.Node, torch.fx.Node], int]:
    """(reader, input) -> how many in-place writes into that input's storage came before the
    read; only nonzero versions are listed. Reads of different versions of one tensor must
    not share a reshard: one made before a write holds the old values."""
    writes: dict[torch.fx.Node, int] = {}
    out: dict[tuple[torch.fx.Node, torch.fx.Node], int] = {}
    for node in graph.nodes:
        for arg in _inputs(node):
            version = writes.get(storage_root(arg), 0)
            if version:
                out[(node, arg)] = version
        for target in written_args(node):
            root = storage_root(target)
            writes[root] = writes.get(root, 0) + 1
    return out


def _inputs(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    for a in node.all_input_nodes:
        if a not in seen:
            seen.add(a)
            yield a


__all__ = ["writes_first_arg", "written_arg_names", "written_args", "viewed_arg", "storage_root", "as_produced_args", "read_versions"]
