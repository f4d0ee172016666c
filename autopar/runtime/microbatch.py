"""Micro-batches (gradient accumulation) as a step runs them: forward and backward of each in
turn, their losses weighed as ``problem.micro_losses`` reads them off the captured graph, the
gradients synchronized once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from autopar.problem.micro_losses import COUNT, MEAN
from autopar.runtime.grad_sync import GradSync


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
