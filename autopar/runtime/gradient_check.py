"""Check a plan's trainable parameters against the gradients autograd gives.

The plan syncs, steps and prices the parameters its gradient analysis says get a gradient
(``problem.gradients``). A parameter that autograd gives a gradient while the plan does not
sync it would train apart on each replica, silently. So before a rank's program is built,
the captured step runs once on fake tensors (shapes only, no compute) with autograd on, and
any parameter autograd reaches that the plan leaves out is an error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves

from autopar.errors import GradientPlanError
from autopar.capture.graph import CapturedGraph
from autopar.problem.nodes import PARAM, PlanGraph


def autograd_trained(captured: CapturedGraph) -> set[str]:
    """FQNs of the trainable parameters that autograd gives a gradient in the captured step (once
    per capture: a capture kept for the process, ``capture.kept``, is checked again at no cost)."""
    if captured.trained is None:
        captured.trained = frozenset(_autograd_trained(captured))
    return set(captured.trained)


def _autograd_trained(captured: CapturedGraph) -> set[str]:
    placeholders = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    if mode is None:
        raise GradientPlanError("the captured step has no fake tensors to run autograd on")
    with mode, torch.enable_grad():
        args: list[Any] = []
        params: dict[str, torch.Tensor] = {}
        for node in placeholders:
            value = captured.constants.get(node.name, node.meta.get("val"))
            if isinstance(value, torch.Tensor):
                value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
                fqn = captured.parameters.get(node.name)
                if fqn is not None and getattr(node.meta.get("val"), "requires_grad", True):
                    params[fqn] = value.requires_grad_(True)
            args.append(value)
        loss = tree_leaves(captured.gm(*args))[0]
        if not loss.requires_grad:
            return set()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {fqn for fqn, grad in zip(params, grads) if grad is not None}


def check_trained_parameters(captured: CapturedGraph, graph: PlanGraph) -> None:
    """Raise ``GradientPlanError`` naming each parameter autograd gives a gradient that the plan
    does not train (sync, step): that parameter's replicas would drift apart without an error."""
    if not captured.train:
        return
    planned = {n.fqn for n in graph.nodes.values() if n.kind == PARAM and n.needs_grad}
    missed = sorted(autograd_trained(captured) - planned)
    if missed:
        raise GradientPlanError(
            f"autograd gives {len(missed)} parameter(s) a gradient that the plan does not sync: "
            f"{', '.join(missed[:8])}{' ...' if len(missed) > 8 else ''}; the gradient analysis "
            "(autopar.problem.gradients) missed the path their gradient takes")


__all__ = ["GradientPlanError", "autograd_trained", "check_trained_parameters"]
