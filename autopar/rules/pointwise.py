"""Elementwise ops (PyTorch's own ``torch.Tag.pointwise`` table, plus casts, copies, fills
and the scalar forms of where / masked_fill).

An elementwise op computes each output element from the same-index input elements,
so any output dim can be split if every input holding that dim (after broadcasting)
is split the same way; inputs broadcast along it are replicated. Ops linear in an
input keep a Partial sum Partial. An in-place op (``masked_fill_``, ``copy_``, ``fill_``,
``add_``) returns its first input, so its output placement is that input's.
"""

from __future__ import annotations

import torch

from autopar.capture.aliasing import writes_first_arg
from autopar.capture.graph import TensorMeta
from autopar.rules.strategy import P, R, DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("pointwise")

# Ops that are elementwise but carry no pointwise tag: casts, copies, bitwise tensor ops,
# fills, floor division, and where / masked_fill with a scalar or 0-d tensor operand (T5, HF masks).
EXTRA_POINTWISE = [
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
    aten.contiguous.default, aten.alias.default, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.type_as.default, aten.detach.default, aten.lift_fresh_copy.default,
    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Tensor,
    aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.fill.Scalar, aten.fill.Tensor,
    aten.fill_.Scalar, aten.fill_.Tensor, aten.copy.default, aten.copy_.default, aten.detach_.default,
    aten.floor_divide.default, aten.floor_divide.Scalar,  # HF MoE: a sorted pair's token, perm // top_k
]

# f(sum x_i) = sum f(x_i): a Partial input gives a Partial output.
LINEAR_UNARY = {
    aten.neg.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
    aten.contiguous.default, aten.alias.default, aten.clone.default, aten.mul.Scalar,
    aten.div.Scalar, aten.detach.default, aten.type_as.default, aten.mul_.Scalar, aten.div_.Scalar,
}
# Partial in every tensor argument at once: sum_i x_i + sum_i y_i = sum_i (x_i + y_i). In place
# too: HF's ``loss += coef * aux_loss`` on a batch-split (Partial) loss.
LINEAR_ALL_PARTIAL = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
# Linear in one argument when the others are replicated: (sum x_i) * y = sum x_i * y.
LINEAR_IN_ARG = {aten.mul.Tensor: (0, 1), aten.div.Tensor: (0,), aten.mul_.Tensor: (0, 1), aten.div_.Tensor: (0,)}


def broadcast_strategies(call: OpCall) -> list[DimStrategy]:
    """Split any output dim that every full-size input holds at the same (right-aligned) dim."""
    out = call.outputs[0]
    inputs = call.tensor_inputs
    if out is None:
        return []
    strategies = []
    for d in range(out.ndim):
        from_right = out.ndim - d
        placements = []
        for t in inputs:
            if t.ndim >= from_right and t.shape[t.ndim - from_right] == out.shape[d] and out.shape[d] > 1:
                placements.append(S(t.ndim - from_right))
            else:
                placements.append(R)
        outputs = tuple(S(d) if o is not None and o.ndim == out.ndim else (None if o is None else R)
                        for o in call.outputs)
        strategies.append(DimStrategy(outputs, tuple(placements)))
    return strategies


def pointwise_rule(call: OpCall) -> list[DimStrategy]:
    strategies = broadcast_strategies(call) + _linear_strategies(call)
    if writes_first_arg(call.target):  # the output is the input: the same placement (self never broadcasts)
        return [s for s in strategies if s.outputs[0] == s.inputs[0]]
    return strategies


def _linear_strategies(call: OpCall) -> list[DimStrategy]:
    """Partial in, Partial out, where the op is linear in those inputs."""
    strategies = []
    n_in = len(call.tensor_inputs)
    n_out = len(call.outputs)
    if call.target in LINEAR_UNARY and n_in == 1 and _keeps_sums(call):
        strategies.append(DimStrategy((P,) * n_out, (P,)))
    # Both operands must be tensors: x + 2 on a Partial x would add 2 once per rank.
    if call.target in LINEAR_ALL_PARTIAL and n_in >= 2 and _is_tensor_arg(call, 1):
        shapes = {t.shape for t in call.tensor_inputs}
        if len(shapes) == 1 and call.get("alpha", 1) == 1:  # same shape: no broadcast copies
            strategies.append(DimStrategy((P,) * n_out, (P,) * n_in))
    for arg in LINEAR_IN_ARG.get(call.target, ()):
        if arg < n_in and _is_tensor_arg(call, arg):
            strategies.append(DimStrategy((P,) * n_out, tuple(P if i == arg else R for i in range(n_in))))
    return strategies


def _keeps_sums(call: OpCall) -> bool:
    """A cast keeps a Partial sum only where it rounds no part: into the same dtype, a float
    dtype that holds every value of the input's float dtype (float32 -> float64), or a float
    from an int. Casting parts to an int rounds each (int(0.4) + int(0.6) != int(1.0)), and
    so does narrowing a float: float64 -> float16 parts summed in float16 differ from the sum
    rounded once, by about an ulp of the parts, which can be far larger than the sum."""
    x, out = call.tensor_inputs[0], call.outputs[0]
    if out is None or out.dtype == torch.bool:
        return False
    if out.dtype == x.dtype:
        return True
    if not out.dtype.is_floating_point:
        return False
    return not x.dtype.is_floating_point or torch.promote_types(x.dtype, out.dtype) == out.dtype


def _is_tensor_arg(call: OpCall, position: int) -> bool:
    """True when positional arg ``position`` is the ``position``-th tensor input."""
    return all(isinstance(a, TensorMeta) for a in call.args[: position + 1])


def _tagged_pointwise_ops() -> list[torch._ops.OpOverload]:
    ops = []
    for name in dir(aten):
        packet = getattr(aten, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if torch.Tag.pointwise in op.tags:
                    ops.append(op)
    return ops


# Dropout is elementwise too but lives in dropout.py (randomness needs its own note).
_EXCLUDED = {aten.dropout.default, aten.native_dropout.default}
TABLE.add([op for op in _tagged_pointwise_ops() + EXTRA_POINTWISE if op not in _EXCLUDED], pointwise_rule)
