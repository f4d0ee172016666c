"""Copy the last traced block of a cut stack (``capture.replicate``) once per missing block.

Works on torch.export's program before ``capture.export`` cleans it up: every node the
tracer made is still there, so node names can be given exactly as a full trace names them
(FX numbers each op name in creation order: ``linear``, ``linear_1``, ... and a copied block
makes the same ops in the same order) and plans keyed by node name match a full capture's.

The traced graph is: placeholders (parameters, buffers, constants, user inputs), the nodes
before the stack (the prefix: embeddings, rotary tables, masks), blocks 0..K-1 one after the
other (each followed by the loop's own ops, if any: ``x = x + block(x)``), the nodes after
(the suffix: final norm, head, loss) and the output. Block K-1 is the
template; the checks make sure that copying it is what a full trace would give: blocks K-2
and K-1 run the same ops on the same shapes, and wherever block K-2 reads block K-3 (or its
own nodes, its own parameters, a node from before the stack) block K-1 reads block K-2 (its
own nodes, its own parameters, the same node). The suffix may read block K-1's values (they
become the last block's) and anything before the stack, nothing else of the blocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.fx.node import Node, map_arg
from torch.utils._pytree import tree_flatten

from autopar.capture.subgraphs import is_higher_order

_BLOCK_INPUTS = (InputKind.PARAMETER, InputKind.BUFFER)
_PREFIXES = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_"}
"""torch.export's placeholder names: kind prefix + the FQN, lower case, other characters as ``_``."""
_SUFFIX = re.compile(r"_\d+$")


@dataclass
class Traced:
    """The traced graph cut into its parts (see the module docstring)."""

    placeholders: list[Node]
    prefix: list[Node]
    blocks: list[list[Node]]
    """Per traced block: its nodes, then the ops outside any block that run before the next."""
    suffix: list[Node]
    """Nodes after the stack, the output last."""
    position: dict[Node, tuple[int, int]] = field(default_factory=dict)
    """Block node -> (block, index in the block)."""
    block_inputs: dict[Node, tuple[int, str]] = field(default_factory=dict)
    """Block parameter or buffer placeholder -> (block, FQN inside the block)."""
    inputs_of: list[dict[str, Node]] = field(default_factory=list)
    """Per block: FQN inside the block -> its placeholder."""


class Pattern:
    """Names of one stack's blocks: ``model.<path>.<i>`` in the training step's module paths."""

    def __init__(self, path: str) -> None:
        head = "model." + (path + "." if path else "")
        self.module = re.compile(rf"^({re.escape(head)})(\d+)(?=\.|$)")
        self.target = re.compile(rf"^{re.escape(head)}(\d+)\.(.+)$")
        self.head = head

    def block_of(self, node: Node) -> int | None:
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            match = self.module.match(path)
            if match:
                return int(match.group(2))
        return None

    def restack(self, stack: dict[str, tuple[str, Any]] | None, old: int, new: int
                ) -> dict[str, tuple[str, Any]] | None:
        """A node's ``nn_module_stack`` as block ``new``'s copy of block ``old``'s node has it."""
        if stack is None:
            return None
        out = {}
        for key, (path, kind) in stack.items():
            match = self.module.match(path)
            if match and int(match.group(2)) == old:
                moved = f"{match.group(1)}{new}{path[match.end():]}"
                key = key[: -len(path)] + moved if key.endswith(path) else key
                path = moved
            out[key] = (path, kind)
        return out


def split(graph: torch.fx.Graph, specs: list[InputSpec], pattern: Pattern, traced: int) -> Traced | str:
    """The graph's parts, or why it does not have the expected shape."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if nodes[: len(placeholders)] != placeholders or nodes[-1].op != "output":
        return "the graph's inputs are not all first"
    if any(s.kind not in (*_BLOCK_INPUTS, InputKind.CONSTANT_TENSOR, InputKind.USER_INPUT) for s in specs):
        return "the step has inputs other than tensors (tokens, script objects)"
    body = nodes[len(placeholders):-1]
    index = [pattern.block_of(n) for n in body]
    first = next((i for i, b in enumerate(index) if b is not None), None)
    if first is None:
        return "no traced op lies in a block"
    sizes = _size_arithmetic(body[:first], body[first:])
    kept = [(n, b) for n, b in zip(body[first:], index[first:]) if n not in sizes]
    units = _units([n for n, _ in kept], [b for _, b in kept], traced)
    if isinstance(units, str):
        return units
    blocks, rest = units
    result = Traced(placeholders, [*body[:first], *sizes], blocks, [*rest, nodes[-1]])
    result.position = {n: (b, i) for b, block in enumerate(blocks) for i, n in enumerate(block)}
    return _find_block_inputs(result, specs, pattern, traced)


def _size_arithmetic(prefix: list[Node], after: list[Node]) -> dict[Node, None]:
    """The nodes among ``after`` that compute a symbolic size (``1280*s0``) from the graph's inputs alone,
    in order. The tracer makes each such expression once, in the first block that needs it, and the
    later blocks read it there; taken out of the blocks (they run before them, pure) every block reads
    it alike and the blocks repeat."""
    outside = set(prefix)
    sizes: dict[Node, None] = {}
    for node in after:
        scalar = isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
        if node.op == "call_function" and scalar and \
                all(x.op == "placeholder" or x in outside or x in sizes for x in node.all_input_nodes):
            sizes[node] = None
    return sizes


def _units(body: list[Node], index: list[int | None], traced: int) -> tuple[list[list[Node]], list[Node]] | str:
    """The blocks, each with the ops outside any block that run after it and before the next
    (``x = x + block(x)`` written in the loop), and the nodes after the stack. The last block
    takes as many of the nodes after it as the others have such ops: the check that it
    repeats the block before it tells whether they are the same ops."""
    units: list[list[Node]] = [[] for _ in range(traced)]
    gaps = [0] * traced
    current = 0
    for node, b in zip(body, index):
        if b is None:
            units[current].append(node)
            gaps[current] += 1
        elif b == current + 1 and b < traced:
            current = b
            units[b].append(node)
        elif b != current or gaps[current]:
            return f"the ops of blocks {current} and {b} interleave"
        else:
            units[b].append(node)
    if current != traced - 1:
        return f"only {current + 1} of {traced} traced blocks have ops"
    gap = gaps[-2] if traced > 1 else 0
    cut = len(units[-1]) - gaps[-1] + gap
    units[-1], rest = units[-1][:cut], units[-1][cut:]
    if gaps[-1] < gap:
        return "the last traced block is not followed by the ops that follow the others"
    return units, rest


def _find_block_inputs(t: Traced, specs: list[InputSpec], pattern: Pattern, traced: int) -> Traced | str:
    by_name = {s.arg.name: s for s in specs}  # type: ignore[union-attr]
    t.inputs_of = [{} for _ in range(traced)]
    for node in t.placeholders:
        spec = by_name.get(node.name)
        match = pattern.target.match(spec.target or "") if spec is not None and spec.kind in _BLOCK_INPUTS else None
        if match is None:
            continue
        if _PREFIXES[spec.kind] + re.sub(r"[^a-zA-Z0-9]", "_", spec.target.lower()) != node.name:  # type: ignore
            return f"input {node.name} is not named as torch.export names {spec.target}"  # type: ignore[union-attr]
        block, rest = int(match.group(1)), match.group(2)
        t.block_inputs[node] = (block, rest)
        t.inputs_of[block][rest] = node
    if any(list(d) != list(t.inputs_of[0]) for d in t.inputs_of):
        return "the blocks' parameters and buffers differ"
    return t


def check(t: Traced, pattern: Pattern) -> str | None:
    """Why block K-1 cannot stand for the blocks after it (None: it can)."""
    for j in range(1, len(t.blocks)):
        why = _check_pair(t, j, pattern, strict=j == len(t.blocks) - 1)
        if why:
            return why
    last = len(t.blocks) - 1
    for node in t.prefix:
        if any(t.block_inputs.get(x, (0,))[0] != 0 for x in node.all_input_nodes):
            return f"{node.name}, before the blocks, reads a later block's parameters"
    for node in t.suffix:
        for x in node.all_input_nodes:
            if x in t.block_inputs or t.position.get(x, (last,))[0] != last:
                return f"{node.name}, after the blocks, reads a block other than the last or its parameters"
    return None


def _check_pair(t: Traced, j: int, pattern: Pattern, strict: bool) -> str | None:
    """Block j repeats block j-1: same ops on the same shapes, wired one block later. Not
    strict (j-1 is the first block): reads from before the stack may become block j-1's."""
    prev, cur = t.blocks[j - 1], t.blocks[j]
    if len(prev) != len(cur):
        return f"blocks {j - 1} and {j} trace to {len(prev)} and {len(cur)} ops"
    for a, b in zip(prev, cur):
        if a.op != "call_function" or is_higher_order(a):
            return f"block {j - 1} holds {a.name} ({a.op} {a.target}), not a plain op"
        if b.op != a.op or b.target != a.target:
            return f"block {j} runs {b.target} where block {j - 1} runs {a.target}"
        if not _same_value(a.meta.get("val"), b.meta.get("val")):
            return f"{b.name} in block {j} has another shape, dtype or stride than {a.name} in block {j - 1}"
        if pattern.restack(a.meta.get("nn_module_stack"), j - 1, j) != b.meta.get("nn_module_stack"):
            return f"{b.name} in block {j} lies in other modules than {a.name} in block {j - 1}"
        why = _check_args(t, a, b, j, strict)
        if why:
            return why
    return None


def _check_args(t: Traced, a: Node, b: Node, j: int, strict: bool) -> str | None:
    left, left_spec = tree_flatten((a.args, a.kwargs))
    right, right_spec = tree_flatten((b.args, b.kwargs))
    if left_spec != right_spec:
        return f"{b.name} in block {j} takes other arguments than {a.name} in block {j - 1}"
    for x, y in zip(left, right):
        if isinstance(x, Node):
            want = _counterpart(t, x, j)
            loose = not strict and want is x and (y is x or t.position.get(y, (-1,))[0] == j - 1)  # type: ignore
            if want is not y and not loose:
                return f"{b.name} in block {j} reads {getattr(y, 'name', y)} where block {j - 1}'s wiring says " \
                       f"{getattr(want, 'name', want)}"
        elif type(x) is not type(y) or not (x is y or x == y):
            return f"{b.name} in block {j} has argument {y!r} where block {j - 1} has {x!r}"
    return None


def _counterpart(t: Traced, x: Node, j: int) -> Node | None:
    """What block j reads where block j-1 reads ``x``, if block j is block j-1 one block on."""
    if x in t.position:
        block, i = t.position[x]
        if block in (j - 1, j - 2):
            return t.blocks[block + 1][i]
        return None
    if x in t.block_inputs:
        block, rest = t.block_inputs[x]
        return t.inputs_of[j].get(rest) if block == j - 1 else None
    return x


def _same_value(a: object, b: object) -> bool:
    left, left_spec = tree_flatten(a)
    right, right_spec = tree_flatten(b)
    if left_spec != right_spec:
        return False
    for x, y in zip(left, right):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape \
                    or x.dtype != y.dtype or x.stride() != y.stride() or x.device != y.device \
                    or x.requires_grad != y.requires_grad:
                return False
        elif type(x) is not type(y) or not (x is y or x == y):
            return False
    return True


def rebuild(gm: torch.fx.GraphModule, t: Traced, specs: list[InputSpec], pattern: Pattern, count: int
            ) -> list[InputSpec]:
    """Replace ``gm``'s graph with one of ``count`` blocks, the missing ones copies of the last
    traced block; returns the input specs of the new graph's placeholders, in order. The caller
    regenerates ``gm``'s code (``gm.recompile()``).

    A fresh graph built in order numbers every node as a full trace would (see the module
    docstring); new parameters and buffers come right after the last traced block's, as
    ``named_parameters()`` orders them (which is what export's placeholders follow).
    """
    old = gm.graph
    graph = torch.fx.Graph(tracer_cls=old._tracer_cls, tracer_extras=old._tracer_extras)
    graph._codegen = old._codegen
    env: dict[Node, Node] = {}
    by_name = {s.arg.name: s for s in specs}  # type: ignore[union-attr]
    last = len(t.blocks) - 1
    ends = {kind: [n for n in t.placeholders if t.block_inputs.get(n, (-1,))[0] == last
                   and by_name[n.name].kind == kind][-1:] for kind in _BLOCK_INPUTS}
    inputs: dict[int, dict[str, Node]] = {i: {} for i in range(last + 1, count)}
    new_specs: list[InputSpec] = []
    for node in t.placeholders:
        env[node] = _copy(graph, node, env.__getitem__, name=node.name)
        new_specs.append(by_name[node.name])
        for kind, end in ends.items():
            if end and end[0] is node:
                new_specs += _new_inputs(graph, t, by_name, kind, pattern, inputs)
    for node in (*t.prefix, *(n for block in t.blocks for n in block)):  # made as traced: names kept
        env[node] = _copy(graph, node, env.__getitem__, name=node.name)
    prev = [env[n] for n in t.blocks[last]]
    for i in range(last + 1, count):
        prev = _copy_block(graph, t, pattern, i, prev, inputs[i], env)
    copied = {_SUFFIX.sub("", n.name) for n in t.blocks[last]}
    for node in t.suffix:  # numbered after the copies where they share a name, else (get_attr ``submod_3``) kept
        base = _SUFFIX.sub("", node.name)
        env[node] = _copy(graph, node, lambda x: prev[t.position[x][1]] if x in t.position else env[x],
                          name=base if base in copied else node.name)
    # GraphModule.graph's setter, less its recompile: ``capture`` rewrites the graph further and
    # recompiles once at the end (Python code for an 80-block graph costs ~0.2 s each time)
    gm._graph = graph
    graph.owning_module = gm
    return new_specs


def _new_inputs(graph: torch.fx.Graph, t: Traced, by_name: dict[str, InputSpec], kind: InputKind,
                pattern: Pattern, inputs: dict[int, dict[str, Node]]) -> list[InputSpec]:
    """Placeholders of ``kind`` for every missing block, made like the last traced block's."""
    specs = []
    template = t.inputs_of[len(t.blocks) - 1]
    for i, made in inputs.items():
        for rest, node in template.items():
            spec = by_name[node.name]
            if spec.kind != kind:
                continue
            target = f"{pattern.head}{i}.{rest}"
            name = _PREFIXES[kind] + re.sub(r"[^a-zA-Z0-9]", "_", target.lower())
            made[rest] = _copy(graph, node, lambda x: x, name=name)
            specs.append(InputSpec(kind=kind, arg=TensorArgument(name=made[rest].name), target=target,
                                   persistent=spec.persistent))
    return specs


def _copy_block(graph: torch.fx.Graph, t: Traced, pattern: Pattern, i: int, prev: list[Node],
                inputs: dict[str, Node], env: dict[Node, Node]) -> list[Node]:
    """Block ``i`` as a copy of the last traced block: its reads of itself and of its parameters
    become block i's, of the block before it ``prev``'s, of anything else the same node."""
    last = len(t.blocks) - 1
    made: list[Node] = []

    def arg(x: Node) -> Node:
        if x in t.position:
            block, k = t.position[x]
            return made[k] if block == last else prev[k]
        if x in t.block_inputs:
            return inputs[t.block_inputs[x][1]]
        return env[x]

    for node in t.blocks[last]:
        made.append(_copy(graph, node, arg, stack=pattern.restack(node.meta.get("nn_module_stack"), last, i)))
    return made


def _copy(graph: torch.fx.Graph, node: Node, arg: Callable[[Node], Node], name: str | None = None,
          stack: dict[str, tuple[str, Any]] | None = None) -> Node:
    """``node`` made anew in ``graph``, named by its op (FX adds the next free number) or ``name``
    (FX keeps it: it is free); its meta shared but for ``stack`` (the FakeTensor values of a copy are
    those of the node copied: same shape, dtype and strides)."""
    target = name if node.op == "placeholder" else node.target  # a placeholder's target is its argument name
    out = graph.create_node(node.op, target, map_arg(node.args, arg), map_arg(node.kwargs, arg),
                            name=name or _SUFFIX.sub("", node.name), type_expr=node.type)
    out.meta = dict(node.meta)
    if stack is not None:
        out.meta["nn_module_stack"] = stack
    return out


__all__ = ["Traced", "Pattern", "split", "check", "rebuild"]
