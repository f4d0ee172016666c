"""Matrix products as einsum equations: mm, bmm, addmm, linear, matmul, einsum.

For one mesh dimension an einsum can split any one index label:
- a label kept in the output: every operand holding it is sharded on it, the others
  replicated, and the output is sharded on it (each rank computes its block);
- a contracted label: the operands holding it are sharded on it and the output is
  Partial (each rank sums part of the contraction).
Products are linear in each operand, so a Partial operand times replicated others
gives a Partial output.
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import P, R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable, Unhandled

aten = torch.ops.aten
TABLE = RuleTable("matmul")


def einsum_strategies(equation: str) -> list[DimStrategy]:
    """Single-dim strategies of ``equation`` ("mk,kn->mn": one letter per dim, no ellipsis)."""
    lhs, out = equation.replace(" ", "").split("->")
    operands = lhs.split(",")
    strategies: list[DimStrategy] = []
    for label in dict.fromkeys(lhs.replace(",", "")):
        if any(op.count(label) > 1 for op in operands):
            continue  # a repeated label ("ii->i") pairs two dims: splitting one breaks the diagonal
        inputs = tuple(S(op.index(label)) if label in op else R for op in operands)
        output = S(out.index(label)) if label in out else P
        strategies.append(DimStrategy((output,), inputs))
    for i in range(len(operands)):  # linearity in each operand
        strategies.append(DimStrategy((P,), tuple(P if j == i else R for j in range(len(operands)))))
    return strategies


def _letters(n: int, skip: str = "") -> str:
    pool = [c for c in "abcdefghijlopqrstuvwxyz" if c not in skip]
    return "".join(pool[:n])


@TABLE.register(aten.mm.default)
def mm_rule(call: OpCall) -> list[DimStrategy]:
    return einsum_strategies("mk,kn->mn")


@TABLE.register(aten.bmm.default)
def bmm_rule(call: OpCall) -> list[DimStrategy]:
    return einsum_strategies("bmk,bkn->bmn")


@TABLE.register(aten.linear.default)
def linear_rule(call: OpCall) -> list[DimStrategy]:
    """y = x @ W.T (+ b): x [..., k], W [n, k], b [n]."""
    x = call.args[0]
    batch = _letters(x.ndim - 1, skip="kn")
    has_bias = call.get("bias") is not None
    strategies = []
    for s in einsum_strategies(f"{batch}k,nk->{batch}n"):
        out = s.outputs[0]
        if has_bias:
            # The bias is added once per output element: it follows the output's
            # split of n, is replicated for other splits, and must itself be
            # Partial when the output is (else it would be added once per rank).
            if out.is_partial():
                bias = P
            elif out.is_shard(x.ndim - 1):
                bias = S(0)
            else:
                bias = R
            strategies.append(DimStrategy(s.outputs, (*s.inputs, bias)))
        else:
            strategies.append(s)
    return strategies


@TABLE.register(aten.addmm.default)
def addmm_rule(call: OpCall) -> list[DimStrategy]:
    """out = bias + a @ b, bias broadcast to [m, n]."""
    bias = call.args[0]
    strategies = []
    for s in einsum_strategies("mk,kn->mn"):
        out = s.outputs[0]
        if out.is_partial():
            b = P
        elif out.is_shard(1) and bias.ndim >= 1 and bias.shape[-1] > 1:
            b = S(bias.ndim - 1)
        elif out.is_shard(0) and bias.ndim == 2 and bias.shape[0] > 1:
            b = S(0)
        else:
            b = R
        strategies.append(DimStrategy(s.outputs, (b, *s.inputs)))
    return strategies


@TABLE.register(aten.matmul.default)
def matmul_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    """a [..., m, k] @ b [..., k, n] with equal batch dims, or b a matrix."""
    a, b = call.args[0], call.args[1]
    if a.ndim < 2 or b.ndim < 2:
        return Unhandled("a vector (1-D) operand")
    if b.ndim > 2 and a.shape[:-2] != b.shape[:-2]:
        return Unhandled(f"batch dims broadcast ({list(a.shape)} @ {list(b.shape)})")
    batch = _letters(a.ndim - 2, skip="mkn")
    b_batch = batch if b.ndim > 2 else ""
    return einsum_strategies(f"{batch}mk,{b_batch}kn->{batch}mn")


@TABLE.register(aten.einsum.default)
def einsum_rule(call: OpCall) -> list[DimStrategy] | Unhandled:
    equation = call.args[0]
    if "." in equation:
        return Unhandled(f"ellipsis in the equation {equation!r}")
    if "->" not in equation:
        return Unhandled(f"implicit output in the equation {equation!r}")
    return einsum_strategies(equation)
