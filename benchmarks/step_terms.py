"""A plan's predicted step split by what runs (``benchmarks/fidelity.py --terms``): the ops' compute
by family (matmuls, fused attention, the memory-bound rest), the optimizer's update and the
communication the step waits for; their sum is the predicted step (``Predicted.step_time_s``: compute
plus the communication not hidden). The hidden communication is shown beside, outside the sum."""

from __future__ import annotations

import torch

from autopar.cost.compute import MATMUL_OPS
from autopar.result.plan import Plan
from autopar.rules.attention import ATTENTION_OPS

FAMILIES = ("matmul", "attention", "memory-bound", "optimizer", "communication waited")
_MATMULS = frozenset(str(op) for op in MATMUL_OPS)
_ATTENTION = frozenset(str(op) for op in ATTENTION_OPS if isinstance(op, torch._ops.OpOverload))


def family(op: str) -> str:
    """The family of a plan node's op (its printed target)."""
    if op in _MATMULS:
        return "matmul"
    return "attention" if op in _ATTENTION else "memory-bound"


def step_terms(plan: Plan) -> dict[str, float]:
    """Seconds per step of each of ``FAMILIES`` (every micro-batch's forward and backward, a
    checkpointed op's recompute in its backward), and 'hidden communication' beside them."""
    runs = plan.memory.micro_batches if plan.train else 1
    out = dict.fromkeys(FAMILIES, 0.0)
    for node in plan.nodes:
        out["optimizer"] += node.update_s
        if node.op != "parameter":
            out[family(node.op)] += (node.forward_s + node.backward_s) * runs
    out["communication waited"] = plan.predicted.comm_time_s
    return {**out, "hidden communication": plan.predicted.hidden_comm_time_s}


def format_terms(terms: dict[str, float]) -> str:
    """One line: each term in ms, with its share of the step (the sum of ``FAMILIES``)."""
    step_s = sum(terms[f] for f in FAMILIES)
    return "  ".join(f"{name} {1e3 * s:.0f} ms" + (f" ({s / step_s:.0%})" if name in FAMILIES else "")
                     for name, s in terms.items())
