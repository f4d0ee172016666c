"""Which nodes of a training step get a gradient, as autograd will run it.

Forward, a node may need a gradient when some input does and the op is differentiable
(``may_need_grad``), and a tensor needs one once a write into its storage does
(``mark_written_storage``: ``out[:, t] = f(w, x)`` into a ``zeros_like``, as autograd rebases
the buffer's history onto the write). Backward decides what actually runs: a node gets a gradient only on a
differentiable path to the loss, so a parameter that reaches the loss only through a
comparison (``(gate(x) > 0).float()``), ``detach`` or a factory gets none: no gradient
reduction waits for it, no optimizer state is priced for it, and no backward op or saved
activation is priced along a path no gradient takes (``settle_gradients``); along the
others, only what autograd keeps is (``saved_activations``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from autopar.capture.graph import TensorMeta
from autopar.cost.compute import SHAPE_ONLY_ARGS
from autopar.cost.model import CostContext
from autopar.problem.nodes import OP, PARAM, PlanNode
from autopar.problem.saved_activations import ProbeMemo, saved_activations

aten = torch.ops.aten

NO_GRADIENT = frozenset({aten.detach.default, aten.rand_like.default, aten.randn_like.default,
                         aten.randint_like.default})
"""Ops through which no gradient flows to their inputs (besides the factory family, which
builds new tensors from shapes and values)."""

VIEW_OF_EACH_INPUT = frozenset({aten.broadcast_tensors.default})
"""Multi-output ops whose output i is a view of input i alone: it needs a gradient only if
that input does (F.mse_loss broadcasts its target, which needs none, with its input)."""


def carries_gradient(dtype: torch.dtype) -> bool:
    """Autograd differentiates floating and complex tensors (a complex rotary embedding's)."""
    return dtype.is_floating_point or dtype.is_complex


def differentiable(target: Any, family: str | None) -> bool:
    """Whether backward sends a gradient through the op to its inputs: not a factory, which
    builds a new tensor from its input's shape alone, nor ``detach`` or a random draw."""
    return target not in NO_GRADIENT and family != "factory"


def mark_written_storage(nodes: dict[str, PlanNode], writer: PlanNode, members: list[str]) -> None:
    """After an in-place write that needs a gradient, the storage it writes into needs one:
    ``members``, its root and the views of it planned so far (later reads find them so).
    Reads before the write keep what they had, as in autograd."""
    if not writer.needs_grad:
        return
    for name in members:
        node = nodes[name]
        if any(o is not None and carries_gradient(o.dtype) for o in node.outputs):
            node.needs_grad = True


def may_need_grad(target: Any, family: str | None, producers: list[tuple[str, int]],
                  nodes: dict[str, PlanNode], outputs: tuple[TensorMeta | None, ...], train: bool,
                  source: PlanNode | None = None, index: int = 0) -> bool:
    """Forward: a floating output of a differentiable op with an input that needs a gradient.
    For ``operator.getitem`` of ``source``'s output ``index``, per output where it differs."""
    if not differentiable(target, family):
        return False
    if not train or not any(o is not None and carries_gradient(o.dtype) for o in outputs):
        return False
    if target is operator.getitem and source is not None and source.call is not None \
            and source.call.target in VIEW_OF_EACH_INPUT:
        src, _ = source.args[index]
        return nodes[src].needs_grad
    return any(nodes[p].needs_grad for p, _ in producers)


def settle_gradients(nodes: dict[str, PlanNode], order: list[str], loss: str | None, ctx: CostContext,
                     leaf_costs: Any, probes: ProbeMemo) -> None:
    """Keep ``needs_grad`` only where a gradient arrives from the loss (repricing a parameter that
    gets none), and record per op what its backward keeps and sums (``probes``: the plan's memo of
    autograd's saved-tensor probes); ops are priced after (``problem.graph``)."""
    if not ctx.train:
        return
    receives: set[str] = {loss} if loss is not None and nodes[loss].needs_grad else set()
    for name in reversed(order):
        node = nodes[name]
        if name in receives and node.differentiable:
            for k, (src, _) in enumerate(node.args):
                writes = node.written_before[k] if node.written_before else ()
                receives.update(s for s in (src, *writes) if nodes[s].needs_grad)
    for name in order:
        node = nodes[name]
        if node.needs_grad and name not in receives:
            node.needs_grad = False
            if node.kind == PARAM:
                node.costs = leaf_costs(node, ctx)
    kept = saved_activations(nodes, order, receives, probes)
    sums = gradient_sums(nodes, order, receives)
    for name in order:
        node = nodes[name]
        if node.kind == OP and node.call is not None:
            node.kept = kept[name]
            node.saved = any(node.kept.outputs) or node.kept.internal_bytes > 0
            node.grad_sums = sums.get(name, ())


def gradient_sums(nodes: dict[str, PlanNode], order: list[str], receives: set[str]) -> dict[str, tuple[int, ...]]:
    """Per op node, per tensor input, 1 where autograd adds the gradient the op sends back for that
    input to those its earlier readers sent (``PlanNode.grad_sums``): a value read by n ops (or n
    times by one) has its n gradients summed by n - 1 additions, priced at every reader but the first
    in graph order (a residual stream read by a block's norm and its residual add: the add's; a norm's
    output read by three projections: the second's and third's), so that the repeated blocks of a
    stack price alike. Counted as autograd sends gradients: by each op a gradient reaches, for each
    input that needs one, except inputs read for their dtype or shape alone (``x.type_as(y)``'s y)."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, tuple[int, ...]] = {}
    for name in order:
        node = nodes[name]
        if name not in receives or not node.differentiable or node.call is None:
            continue
        shape_only = SHAPE_ONLY_ARGS.get(node.call.target, ())
        sums = []
        for k, (src, index) in enumerate(node.args):
            sends = k not in shape_only and nodes[src].kind == OP and nodes[src].needs_grad
            sums.append(int(sends and (src, index) in seen))
            if sends:
                seen.add((src, index))
        if any(sums):
            out[name] = tuple(sums)
    return out