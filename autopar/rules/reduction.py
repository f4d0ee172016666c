"""Reductions: sum, mean, amax/amin, and friends along given dims; scans along one dim
(cumsum, diff).

A dim that is kept can be split freely (each rank reduces its own rows). A dim that
is reduced can be split only when the reduction is a sum: each rank's sum over its
part is a Partial of the total. (mean over a split dim would need Partial(avg), not
used here.) Sums and means are linear, so a Partial input stays Partial.
"""

from __future__ import annotations

import torch

from autopar.rules.strategy import P, DimStrategy, OpCall, S, normalize_dim
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("reduction")

SUMS = {aten.sum.dim_IntList, aten.sum.default}
LINEAR = SUMS | {aten.mean.dim, aten.mean.default}


def _reduced_dims(call: OpCall) -> tuple[set[int], bool]:
    x = call.args[0]
    dims = call.get("dim")
    if call.target in (aten.sum.default, aten.mean.default) or dims is None or dims == []:
        return set(range(x.ndim)), False
    if isinstance(dims, int):
        dims = [dims]
    keepdim = bool(call.get("keepdim", False))
    return {normalize_dim(d, x.ndim) for d in dims}, keepdim


@TABLE.register(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
                aten.amax.default, aten.amin.default, aten.any.dim, aten.all.dim)
def reduction_rule(call: OpCall) -> list[DimStrategy]:
    x = call.args[0]
    reduced, keepdim = _reduced_dims(call)
    strategies = []
    for d in range(x.ndim):
        if d in reduced:
            if call.target in SUMS:
                strategies.append(DimStrategy((P,), (S(d),)))
            continue
        out_dim = d if keepdim else d - sum(1 for r in reduced if r < d)
        strategies.append(DimStrategy((S(out_dim),), (S(d),)))
    if call.target in LINEAR:
        strategies.append(DimStrategy((P,), (P,)))
    return strategies


@TABLE.register(aten.cumsum.default)
def cumsum_rule(call: OpCall) -> list[DimStrategy]:
    """A prefix sum along ``dim`` needs that dim whole; other dims split freely."""
    x = call.args[0]
    dim = normalize_dim(call.args[1], max(x.ndim, 1))
    strategies = [DimStrategy((S(d),), (S(d),)) for d in range(x.ndim) if d != dim]
    strategies.append(DimStrategy((P,), (P,)))
    return strategies


@TABLE.register(aten.diff.default)
def diff_rule(call: OpCall) -> list[DimStrategy]:
    """Differences along ``dim`` (of ``cat(prepend, x, append)``) need it whole; the other dims
    split, with prepend/append (same shape but along ``dim``) split alike. It is linear in all
    of them at once (bool tensors differ by xor: not linear): Partial everywhere gives a
    Partial output."""
    x = call.get("self")
    dim = normalize_dim(call.get("dim", -1), max(x.ndim, 1))
    n_in = len(call.tensor_inputs)
    strategies = [DimStrategy((S(d),), (S(d),) * n_in) for d in range(x.ndim) if d != dim]
    if x.dtype != torch.bool:
        strategies.append(DimStrategy((P,), (P,) * n_in))
    return strategies
