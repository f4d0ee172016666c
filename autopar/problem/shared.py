"""What the plan-graph builds of one search share.

A search prepares one captured step at many places (each pipeline depth's stage mesh, each
micro-batch count), and several places read one capture: a symbolic capture serves every
micro-batch size, a concrete one every mesh. What a capture's graph alone decides (which
inputs alias, which writes come before a read, the module each node ran in) is worked out
once per graph; its tensors' shapes once per graph and size; an op call's strategies once per
call and mesh shape; autograd's saved-tensor probes once per call. Prices are not shared:
they read the whole cost context.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from autopar.capture.aliasing import as_produced_args, prior_writes, storage_root
from autopar.capture.graph import CapturedGraph, TensorMeta
from autopar.cost.saved import SavedTensors
from autopar.rules import RuleSet
from autopar.rules.strategy import DimStrategy, Strategy


def module_path(node: torch.fx.Node) -> str:
    """The module ``node`` ran in, as the user's model names it ("" at the top)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    for prefix in ("L__self__.", "model."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    return "" if path in ("L__self__", "model") else path


@dataclass(frozen=True)
class GraphFacts:
    """What planning reads of a captured graph that no mesh, size or price changes (by node name)."""

    pinned: dict[str, frozenset[str]]
    """Node -> the inputs it must receive exactly as produced (``capture.aliasing.as_produced_args``)."""
    writes: dict[tuple[str, str], tuple[str, ...]]
    """(reader, input) -> the in-place writes into the input's storage before the read (``prior_writes``)."""
    roots: dict[str, str]
    """Node -> the node that owns its storage (``storage_root``)."""
    modules: dict[str, str]
    """Node -> the module path it ran in (``module_path``)."""

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> GraphFacts:
        graph = gm.graph
        return cls(pinned={n.name: frozenset(a.name for a in args) for n, args in as_produced_args(graph).items()},
                   writes={(reader.name, arg.name): tuple(w.name for w in ws)
                           for (reader, arg), ws in prior_writes(graph).items()},
                   roots={n.name: storage_root(n).name for n in graph.nodes},
                   modules={n.name: module_path(n) for n in graph.nodes})


Metas = dict[str, tuple[TensorMeta | None, ...]]
"""Node -> the metas of its outputs at one capture's size hints."""

StrategyKey = tuple[Hashable, tuple[int, ...]]
"""(an op call's ``call_key``, the mesh's chunks per dim)."""


def output_metas(value: Any, hints: dict[Any, int]) -> tuple[TensorMeta | None, ...]:
    """The metas of a node's ``meta["val"]`` (one per output; None where an output is no tensor)."""
    if isinstance(value, (list, tuple)):
        return tuple(TensorMeta.of(v, hints) for v in value)
    return (TensorMeta.of(value, hints),)


class BuildMemo:
    """The share of plan-graph builds for one rule set: facts per captured graph, metas per graph
    and size hints, strategies per op call and mesh, saved-tensor probes per call. Kept by the
    search that prepares the places (``search.problem.Problems``); its graphs stay alive with it."""

    def __init__(self, rules: RuleSet) -> None:
        self.rules = rules
        self._facts: dict[torch.fx.GraphModule, GraphFacts] = {}
        self._metas: dict[tuple[torch.fx.GraphModule, tuple[tuple[str, int], ...]], Metas] = {}
        self.strategies: dict[StrategyKey, tuple[list[DimStrategy], list[Strategy], str | None]] = {}
        """An op call's rule strategies, their expansion on the mesh, and the rule's fallback reason:
        lists shared by every node and build that asks, never changed in place."""
        self.probes: dict[Hashable, SavedTensors | None] = {}
        """``saved_activations.node_saved_tensors`` by (call key, inputs' ``needs_grad``)."""

    def facts(self, gm: torch.fx.GraphModule) -> GraphFacts:
        if gm not in self._facts:
            self._facts[gm] = GraphFacts.of(gm)
        return self._facts[gm]

    def metas(self, captured: CapturedGraph) -> Metas:
        """Every node's output metas at ``captured``'s size hints."""
        key = (captured.gm, tuple(sorted(((str(k), v) for k, v in captured.size_hints.items()))))
        if key not in self._metas:
            hints = captured.size_hints
            self._metas[key] = {n.name: output_metas(n.meta.get("val"), hints) for n in captured.gm.graph.nodes}
        return self._metas[key]
