"""Micro-batches (gradient accumulation): how a step's micro-batch losses combine into the
whole batch's loss, exactly, read off the captured graph (``runtime.microbatch`` runs it; the
planner asks it before it searches micro-batches or pipelines: ``split_refusal``).

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
without knowing more than the step's output: the planner then searches one micro-batch and no
pipeline, and refuses a pinned ``micro_batches > 1`` or pipeline.
Like every gradient accumulation, this takes the loss to be linear in its per-row terms
(the mean or sum it ends with is the last non-view op before the output).
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.capture.schema import schema_arg
from autopar.errors import InputError
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
    if node.op != "call_function" or node.target not in MEAN_AS_PARTIAL:
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
    kind, why = _kind(gm)
    if kind is None:
        raise InputError(
            f"micro_batches={micro_batches} needs a loss whose whole-batch value is a weighted sum of its "
            f"micro-batches' values: a mean or sum loss (cross_entropy, mse_loss, .mean(), .sum()) computed last; "
            f"but {why}. Compile with micro_batches=1 (or return that loss and combine others outside the step)")
    return kind


def split_refusal(gm: torch.fx.GraphModule) -> str:
    """Why the captured step's loss cannot be split into micro-batches exactly ("" when it can)."""
    kind, why = _kind(gm)
    return "" if kind is not None else (
        f"the step's loss is not a weighted sum of its micro-batches' losses ({why}): one micro-batch and no "
        "pipeline run it exactly")


def _kind(gm: torch.fx.GraphModule) -> tuple[str | None, str]:
    """``loss_kind``'s answer, None with the reason where there is none."""
    root = loss_root(gm)
    if root is None or root.op != "call_function":
        return None, "the step's output is not computed by an op"
    if root.target in MEAN_AS_PARTIAL:
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
            return None, f"the step computes {len(counted)} cross entropies counting their targets ({counted})"
    return kind, why
