"""Losses: cross_entropy_loss and mse_loss split along the batch (rows).

reduction='none' keeps the split; 'sum' gives a Partial sum. 'mean' is also run as
a Partial: each rank computes the sum over its rows divided by the *global* count
of counted elements (targets != ignore_index for cross entropy); ``local_mean_loss``
is that local computation. The count is known from shapes alone for MSE and for
class probabilities (``static_count``); for class ids it is counted on the whole
targets when every rank has them, else summed over the split mesh dims (one scalar
all-reduce per dim).
Splitting the class dim (vocabulary-parallel cross entropy) is not offered yet.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from autopar.rules.strategy import P, R, DimStrategy, OpCall, S, schema_arg
from autopar.rules.table import RuleTable, Unhandled

aten = torch.ops.aten
TABLE = RuleTable("loss")

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2

MEAN_AS_PARTIAL = {aten.cross_entropy_loss.default, aten.mse_loss.default}
"""Ops whose batch-split 'mean' runs as sum / global count (see ``local_mean_loss``)."""
LOSS_VIEWS = frozenset({"reshape", "view", "flatten", "squeeze", "unsqueeze", "clone", "contiguous", "alias",
                        "_to_copy", "to"})
"""Ops (by overload packet) between a step's loss op and its output that keep its value (a
scalar reshaped, copied or cast): the step returns that op's value."""


def _reduction(call: OpCall) -> int:
    return call.get("reduction", REDUCTION_MEAN)


@TABLE.register(aten.cross_entropy_loss.default)
def cross_entropy_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    x, target = call.args[0], call.args[1]
    if x.ndim < 2 or target.ndim < 1:
        return Unhandled(f"no batch dim to split (input {list(x.shape)}, target {list(target.shape)})")
    has_weight = call.get("weight") is not None
    weight = (R,) if has_weight else ()
    out = S(0) if _reduction(call) == REDUCTION_NONE else P
    return [DimStrategy((out,), (S(0), S(0), *weight))]


@TABLE.register(aten.mse_loss.default)
def mse_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    x, target = call.args[0], call.args[1]
    if x.shape != target.shape:  # [N, 1] vs [N] gives [N, N]: dims do not line up
        return Unhandled(f"input and target broadcast ({list(x.shape)} vs {list(target.shape)})")
    if _reduction(call) == REDUCTION_NONE:
        return [DimStrategy((S(d),), (S(d), S(d))) for d in range(x.ndim)]
    return [DimStrategy((P,), (S(d), S(d))) for d in range(x.ndim)]


def global_count(target_op: object, full_args: tuple) -> torch.Tensor:
    """Elements a 'mean' divides by, over the whole (unsplit) batch."""
    if target_op is aten.cross_entropy_loss.default:
        x, target = full_args[0], full_args[1]
        weight = schema_arg(target_op, full_args, {}, "weight")
        ignore_index = schema_arg(target_op, full_args, {}, "ignore_index", -100)
        if target.is_floating_point():  # class probabilities: every position counts, unweighted
            return torch.tensor(float(x.numel() // x.shape[1] if x.ndim > 1 else 1))
        counted = target != ignore_index
        if weight is not None:  # a weighted mean divides by the counted targets' total weight
            return weight[target[counted]].sum()
        return counted.sum().to(torch.float32)
    return torch.tensor(float(full_args[0].numel()))


def static_count(target_op: object, x_shape: tuple[int, ...], targets_are_ids: bool) -> float | None:
    """The 'mean' divisor when shapes alone fix it (nothing can be ignored), else None."""
    if target_op is aten.cross_entropy_loss.default:
        if targets_are_ids:
            return None  # ignore_index: data-dependent
        return float(math.prod(x_shape) // x_shape[1] if len(x_shape) > 1 else 1)
    return float(math.prod(x_shape))


def counted_mean(target_op: object, args: tuple, kwargs: dict) -> bool:
    """A 'mean' loss dividing by a count the data decides (class ids: ``ignore_index``, class
    weights), not by one shapes fix. Tensors in ``args`` need only ``shape`` and ``dtype``."""
    if target_op not in MEAN_AS_PARTIAL or schema_arg(target_op, args, kwargs, "reduction",
                                                      REDUCTION_MEAN) != REDUCTION_MEAN:
        return False
    x, targets = args[0], args[1]
    return static_count(target_op, tuple(x.shape), not targets.dtype.is_floating_point) is None


def local_mean_loss(target_op: object, local_args: tuple, count: torch.Tensor) -> torch.Tensor:
    """One rank's Partial share of a batch-split 'mean' loss: local sum / global count."""
    if target_op is aten.cross_entropy_loss.default:
        x, target = local_args[0], local_args[1]
        weight = schema_arg(target_op, local_args, {}, "weight")
        ignore_index = schema_arg(target_op, local_args, {}, "ignore_index", -100)
        smoothing = schema_arg(target_op, local_args, {}, "label_smoothing", 0.0)
        total = F.cross_entropy(x, target, weight=weight, reduction="sum",
                                ignore_index=ignore_index, label_smoothing=smoothing)
    else:
        total = F.mse_loss(local_args[0], local_args[1], reduction="sum")
    return (total / count).to(total.dtype)  # a float32 count must not promote a bf16 loss


def is_partial_mean_loss(call: OpCall, strategy: object) -> bool:
    """True when this loss runs as a batch-split 'mean' (local sum / global count)."""
    outputs = getattr(strategy, "outputs", ())
    return (call.target in MEAN_AS_PARTIAL and _reduction(call) == REDUCTION_MEAN and bool(outputs)
            and outputs[0] is not None and any(p.is_partial() for p in outputs[0]))
