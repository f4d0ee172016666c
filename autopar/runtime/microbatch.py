"""Micro-batches (gradient accumulation): how a step's micro-batch losses combine into the
whole batch's loss, exactly.

A step of m micro-batches must give the loss and gradients of the single-device step on
the whole batch. The loss a micro-batch's program returns is a reduction over its rows:

- a mean over a number of elements that shapes fix (``mse_loss``, cross entropy on class
  probabilities, ``.mean()``): the whole batch's mean is the micro-batches' mean, so
  micro-batch i's backward is seeded with 1/m (``MEAN``);
- a sum (``reduction='sum'``, ``.sum()``): the micro-batches' sum, seed 1 (``SUM``);
- cross entropy on class ids, whose mean divides by the targets not equal to
  ``ignore_index`` (or by their total class weight), a count that depends on the data
  (``COUNT``): the whole batch's loss is (sum of the micro-batches' sums) / (sum of their
  counts), i.e. micro-batch i weighs count_i / total. The total is known only after the
  last micro-batch's forward, so micro-batch i's backward is seeded with count_i (the
  gradient of its sum: count_i x sum_i / count_i) and the accumulated gradients are
  divided by the total once at the end. The count is the one the program already divides
  by (``PartialMeanLoss``, summed over the ranks splitting the batch), so nothing extra
  runs.

Any other loss (a sum of two losses, a loss scaled by data, ``nll_loss``, a function of a
mean) cannot be split into micro-batches exactly by a weight per micro-batch, or not
without knowing more than the step's output: ``micro_batches > 1`` refuses it at compile.
Like every gradient accumulation, this takes the loss to be linear in its per-row terms
(the mean or sum it ends with is the last non-view op before the output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from autopar.capture.schema import schema_arg
from autopar.errors import InputError
from autopar.runtime.grad_sync import GradSync
from autopar.rules.loss import LOSS_VIEWS, MEAN_AS_PARTIAL, REDUCTION_MEAN, REDUCTION_SUM, counted_mean

MEAN, SUM, COUNT = "mean", "sum", "count"
"""How micro-batch losses combine (see the module docstring)."""

aten = torch.ops.aten
_MEANS = {aten.mean.default, aten.mean.dim}
_SUMS = {aten.sum.default, aten.sum.dim_IntList}


def _packet(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else str(node.target)


def is_counted_mean(node: torch.fx.Node) -> bool:
    """A 'mean' loss op dividing by a data-dependent count (cross entropy on class ids)."""
    if node.op != "call_function":
        return False
    args = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args)
    return len(args) > 1 and counted_mean(node.target, args, node.kwargs)


def loss_root(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The op that computes the step's loss: the output's producer, seen through views and casts."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    node = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and _packet(node) in LOSS_VIEWS:
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) else None


def loss_kind(gm: torch.fx.GraphModule, micro_batches: int) -> str:
    """How the captured step's (forward) graph combines its micro-batches' losses; raises
    ``InputError`` for a loss no weight per micro-batch makes exact."""
    root = loss_root(gm)
    if root is None or root.op != "call_function":
        kind, why = None, "the step's output is not computed by an op"
    elif root.target in MEAN_AS_PARTIAL:
        reduction = schema_arg(root.target, root.args, root.kwargs, "reduction", REDUCTION_MEAN)
        kind = COUNT if is_counted_mean(root) else MEAN if reduction == REDUCTION_MEAN else \
            SUM if reduction == REDUCTION_SUM else None
        why = f"{root.target} with reduction={reduction}"
    else:
        kind = MEAN if root.target in _MEANS else SUM if root.target in _SUMS else None
        why = f"the step's loss is computed last by {root.target}"
    if kind == COUNT:
        counted = [n.name for n in gm.graph.nodes if is_counted_mean(n)]
        if len(counted) > 1:
            kind, why = None, f"the step computes {len(counted)} cross entropies counting their targets ({counted})"
    if kind is None:
        raise InputError(
            f"micro_batches={micro_batches} needs a loss whose whole-batch value is a weighted sum of its "
            f"micro-batches' values: a mean or sum loss (cross_entropy, mse_loss, .mean(), .sum()) computed last; "
            f"but {why}. Compile with micro_batches=1 (or return that loss and combine others outside the step)")
    return kind


def run_micro_batches(run: Callable[[list[Any]], torch.Tensor], micro: list[list[Any]], kind: str,
                      grad_sync: GradSync, params: list[nn.Parameter],
                      counter: Callable[[], torch.Tensor | None],
                      backward: Callable[[torch.Tensor, torch.Tensor], None] = torch.Tensor.backward) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn (one micro-batch's activations alive
    at a time), gradients synchronized once, in the last one's backward; the step's loss
    (this rank's replicated value, detached). ``run`` returns a micro-batch's loss (this
    rank's copy of the replicated value); ``counter`` the count its loss divided by;
    ``backward(loss, seed)`` runs a micro-batch's backward."""
    m = len(micro)
    stashed = stash_grads(params) if kind == COUNT and m > 1 else None
    weighted: torch.Tensor | None = None
    total: torch.Tensor | None = None
    for i, leaves in enumerate(micro):
        with grad_sync.no_sync() if i < m - 1 else contextlib.nullcontext():
            loss = run(leaves)
            if m == 1:
                seed = torch.ones((), dtype=torch.float32)
            elif kind == COUNT:  # the gradient of this micro-batch's sum; divided by the total below
                seed = counter()
                if seed is None:
                    raise RuntimeError("the step's loss divides by a count, but the program recorded none")
                total = seed if total is None else total + seed
            else:
                seed = torch.tensor(1.0 / m if kind == MEAN else 1.0)
            backward(loss, seed.to(loss.dtype).expand_as(loss))
            share = weighed(loss.detach().float(), seed)
            weighted = share if weighted is None else weighted + share
    assert weighted is not None
    if stashed is not None:
        assert total is not None
        restore_grads(stashed, total)
        weighted = weighted / total
    return weighted.to(loss.dtype)


def weighed(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A micro-batch's ``loss x weight``, its share of the step's weighted sum. A micro-batch
    that counts no target (every one ``ignore_index``, as padding rows can be) has a loss of
    0 / 0 = NaN but sums nothing: its share is 0, so the step's loss is NaN only where the
    whole batch's is (a total count of 0)."""
    product = loss * weight.to(loss.dtype)
    return torch.where(weight != 0, product, torch.zeros_like(product))


def stash_grads(params: list[nn.Parameter]) -> dict[nn.Parameter, torch.Tensor | None]:
    """Set gradients held before the step aside, so that the step's own sum can be scaled alone."""
    stashed = {}
    for p in params:
        stashed[p], p.grad = p.grad, None
    return stashed


def restore_grads(stashed: dict[nn.Parameter, torch.Tensor | None], total: torch.Tensor) -> None:
    """Each gradient := what it held before the step + the step's sum / the step's count. The
    step's sum is divided in place when nothing was held (the same quotient, without a second
    gradient-sized tensor: ``.grad`` is the step's own, made by its backward or its buckets)."""
    for p, before in stashed.items():
        if p.grad is None:
            p.grad = before
            continue
        divisor = total.to(p.grad.device)
        if before is None and type(p.grad) is torch.Tensor and torch.result_type(p.grad, divisor) == p.grad.dtype:
            p.grad.div_(divisor)
            continue
        step = p.grad / divisor
        p.grad = step.to(p.grad.dtype) if before is None else before + step.to(p.grad.dtype)
