"""Planning sizes for torch.export's unbacked (data-dependent) sizes.

A loop over experts, each taking the tokens routed to it (``token, slot = torch.where(chosen == e)``),
gives each expert's batch a size only the routing knows: export carries it as an unbacked symbol
(``u0``). The graph keeps it symbolic (the per-rank program runs eagerly, so real sizes flow at run
time); planning needs numbers, so each symbol gets a hint, its size when the captured graph runs
once on the example inputs (a random router's sample of its expectation, tokens x k / experts).
A dim of such a size is never split (``TensorMeta.ragged``): a rank's share of a ragged dim is no
contiguous shard, and its producer (``where``/``nonzero``) must see its whole input for global indices.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from autopar.errors import CaptureError

SizeHints = dict[sympy.Symbol, int]
"""Unbacked symbol -> its size on the example inputs."""


def unbacked_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes whose value has a size (or is a size) that export could not tie to the input shapes."""
    return [node for node in gm.graph.nodes if any(
        isinstance(leaf, (torch.Tensor, torch.SymInt)) and _free(leaf)
        for leaf in pytree.tree_leaves(node.meta.get("val")))]


def _free(leaf: torch.Tensor | torch.SymInt) -> set[sympy.Symbol]:
    sizes = leaf.shape if isinstance(leaf, torch.Tensor) else (leaf,)
    return {sym for s in sizes if isinstance(s, torch.SymInt) for sym in free_unbacked_symbols(s)}


def size_hints(gm: torch.fx.GraphModule, args: list[Any]) -> SizeHints:
    """Each unbacked symbol's size when ``gm`` runs on ``args`` (placeholders' values, in order).

    Run without gradients on copies of what the graph writes in place, so neither the model's
    buffers nor the inputs change. A symbol standing alone as a size is bound to the real size there.
    """
    hints: SizeHints = {}
    wanted = set(unbacked_nodes(gm))

    class _Binder(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            result = super().run_node(node)
            if node in wanted:
                _bind(node.meta.get("val"), result, hints)
            return result

    copies = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        _Binder(gm).run(*copies)
    return hints


def _bind(val: Any, real: Any, hints: SizeHints) -> None:
    for fake, got in zip(pytree.tree_leaves(val), pytree.tree_leaves(real)):
        sizes = fake.shape if isinstance(fake, torch.Tensor) else (fake,)
        reals = got.shape if isinstance(got, torch.Tensor) else (got,)
        for s, r in zip(sizes, reals):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol) and free_unbacked_symbols(s):
                hints.setdefault(s.node.expr, int(r))


def placeholder_values(gm: torch.fx.GraphModule, model: nn.Module, parameters: dict[str, str],
                       buffers: dict[str, str], constants: dict[str, torch.Tensor],
                       user_inputs: list[str], flat: tuple[Any, ...]) -> list[Any]:
    """The captured graph's placeholders' values: the model's parameters and buffers, the lifted
    constants and the step's flat inputs (``user_inputs`` in order)."""
    inputs = dict(zip(user_inputs, [v for v in flat]))
    out: list[Any] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in parameters:
            out.append(model.get_parameter(parameters[node.name]))
        elif node.name in constants:
            out.append(constants[node.name])
        elif node.name in buffers:
            out.append(model.get_buffer(buffers[node.name]))
        else:
            out.append(inputs[node.name])
    return out


def routed_expectations(gm: torch.fx.GraphModule) -> SizeHints:
    """Hints read off the graph's structure, where no values can run it (a meta-device model): the
    positions where a top-k choice picks one expert, ``torch.where(chosen == e)``, number the choices
    over the experts on average (tokens x k / experts, a balanced router's expectation)."""
    hints: SizeHints = {}
    for node in gm.graph.nodes:
        if node.target not in (torch.ops.aten.where.default, torch.ops.aten.nonzero.default):
            continue
        mask = node.args[0]
        chosen = mask.args[0] if mask.target is torch.ops.aten.eq.Scalar else None
        topk = chosen.args[0] if chosen is not None and chosen.target is operator.getitem else None
        if topk is None or topk.target is not torch.ops.aten.topk.default or chosen.args[1] != 1:
            continue
        scores = topk.args[0].meta["val"]
        dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
        experts = int(scores.shape[dim])
        size = pytree.tree_leaves(node.meta["val"])[0].shape[0]
        if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
            hints[size.node.expr] = max(1, chosen.meta["val"].numel() // experts)
    return hints


def hint_or_refuse(gm: torch.fx.GraphModule, values: list[Any] | None) -> tuple[SizeHints, str]:
    """Hints for ``gm``'s unbacked sizes ({} when it has none) and where they come from: each size on the
    example inputs, or where the graph cannot run (a meta-device model has no values to route) each
    expert's expected share of the routed tokens (``routed_expectations``); else a CaptureError naming
    the first op that makes a size neither knows."""
    nodes = unbacked_nodes(gm)
    if not nodes:
        return {}, ""
    on_meta = values is None or any(isinstance(v, torch.Tensor) and v.is_meta for v in values)
    hints = routed_expectations(gm) if on_meta else size_hints(gm, values)  # type: ignore[arg-type]
    for node in nodes:
        missing = {sym for leaf in pytree.tree_leaves(node.meta.get("val"))
                   if isinstance(leaf, (torch.Tensor, torch.SymInt)) for sym in _free(leaf)} - set(hints)
        if missing:
            why = ("the model is on the meta device, so the example inputs cannot be routed to learn it, and it is "
                   "no top-k choice of one expert" if on_meta else "the example inputs did not size it")
            raise CaptureError(_refusal(node, f"no size is known for {sorted(map(str, missing))[0]} ({why})"))
    return hints, ("the expected tokens per expert (tokens x k / experts)" if on_meta
                   else "their size on the example inputs")


def _refusal(node: torch.fx.Node, why: str) -> str:
    modules = list((node.meta.get("nn_module_stack") or {}).values())
    where = f"\n  in module {modules[-1][0]!r} ({modules[-1][1]})" if modules else ""
    return (f"{node.target} makes a tensor of data-dependent size (torch.export's unbacked size), which autopar "
            f"plans at a known size; {why}: capture a model with weights, or write the step with sizes fixed "
            f"by the input shapes (as examples/moe.py dispatches tokens into experts x seq slots){where}")
