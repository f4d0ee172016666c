"""Fold repeated blocks (transformer layers) so each distinct block is solved once.

Nodes are grouped by the indexed container they live in (``layers.3`` -> container
``layers``, instance 3), from the module path torch.export records. Instances whose
node sequences match exactly (ops, shapes, dtypes, wiring inside the instance, and
any pinned placements) share one set of decision variables: the first instance's.
The solver then weighs each shared node and edge by how many real ones it stands
for, so the problem size does not grow with depth.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from autopar.problem.nodes import PlanGraph

_INSTANCE = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass
class Folding:
    representative: dict[str, str]
    """Node name -> the node whose decision it shares (itself when not folded)."""
    multiplicity: dict[str, int]
    """Representative node -> how many nodes it stands for."""
    blocks: dict[str, int]
    """Container path -> number of folded instances (for reporting)."""
    tied: dict[str, str] = field(default_factory=dict)
    """Representative -> the representative that must choose the same strategy: a class
    split apart by checkpointing (or gathering again) in only its first instances
    (``split_folding``) still runs one plan in every instance, as the unsplit class does."""


def _instance_of(module: str) -> tuple[str, int] | None:
    match = _INSTANCE.match(module)
    if match is None:
        return None
    return match.group(1), int(match.group(2))


def fold_repeated_blocks(graph: PlanGraph, pins: dict[str, object] | None = None) -> Folding:
    pins = pins or {}
    members: dict[tuple[str, int], list[str]] = defaultdict(list)
    for name in graph.order:
        inst = _instance_of(graph.nodes[name].module)
        if inst is not None:
            members[inst].append(name)

    by_object: dict[int, int] = {}  # strategy lists are shared between identical calls: hash each once
    by_content: dict[tuple, int] = {}

    def strategies_id(strategies: list) -> int:
        if id(strategies) not in by_object:
            by_object[id(strategies)] = by_content.setdefault(tuple(strategies), len(by_content))
        return by_object[id(strategies)]

    def signature(names: list[str]) -> tuple:
        position = {n: i for i, n in enumerate(names)}
        sig = []
        for n in names:
            node = graph.nodes[n]
            wiring = tuple((position.get(src, -1), idx) for src, idx in node.args)
            # costs differ with what gets a gradient (frozen, no backward) even where strategies match,
            # and with whether its inputs do: a linear whose input needs none keeps no weight
            grads_in = tuple(graph.nodes[src].needs_grad for src, _ in node.args)
            sig.append((node.kind, node.op, node.outputs, wiring, strategies_id(node.strategies), repr(pins.get(n)),
                        node.needs_grad, grads_in, node.saved, node.frozen, node.grad_sums))
        return tuple(sig)

    representative = {n: n for n in graph.order}
    blocks: dict[str, int] = {}
    by_container: dict[str, list[int]] = defaultdict(list)
    for container, index in members:
        by_container[container].append(index)
    for container, indices in by_container.items():
        classes: dict[tuple, list[str]] = {}
        for index in sorted(indices):
            names = members[(container, index)]
            sig = signature(names)
            if sig in classes:
                for rep, n in zip(classes[sig], names):
                    representative[n] = rep
                blocks[container] = blocks.get(container, 1) + 1
            else:
                classes[sig] = names
    return Folding(representative, _multiplicity(representative), blocks)


def split_folding(folding: Folding, graph: PlanGraph) -> Folding:
    """``folding`` with the instances a checkpointed block recomputes (``PlanNode.block``),
    or whose parameters are gathered again in backward (``PlanNode.regather``), apart from
    those that do not: their costs differ, so they are priced apart. Each part of a class is
    represented by its first node, and every part is tied to the class's first part, one
    strategy for all (free, the parts made the ILP twice as large and far harder: a partly
    checkpointed stack solved dozens of times slower than a wholly checkpointed one). The ILP
    prices tied parts on one set of columns (``solver.ilp``, ``solver.edge_links``)."""
    representative: dict[str, str] = {}
    first: dict[tuple[str, bool, bool], str] = {}
    head: dict[str, str] = {}  # class -> its first part's representative
    for name in graph.order:
        node = graph.nodes[name]
        rep = folding.representative[name]
        representative[name] = first.setdefault((rep, node.block is not None, node.regather), name)
        head.setdefault(rep, representative[name])
    tied = {part: head[rep] for (rep, _, _), part in first.items() if part != head[rep]}
    return Folding(representative, _multiplicity(representative), dict(folding.blocks), tied)


def _multiplicity(representative: dict[str, str]) -> dict[str, int]:
    multiplicity: dict[str, int] = defaultdict(int)
    for rep in representative.values():
        multiplicity[rep] += 1
    return dict(multiplicity)
