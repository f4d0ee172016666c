"""Forward FLOPs per op (``cost/compute.op_flops``) against hand-computed counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.capture.graph import TensorMeta
from autopar.cost.compute import op_flops
from autopar.rules.strategy import OpCall

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default


def _call(op: Any, *args: Any, **kwargs: Any) -> OpCall:
    """The call as the planner sees it, outputs from running the op on zeros."""
    tensors = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, TensorMeta) else a for a in args]
    kw = {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, TensorMeta) else v for k, v in kwargs.items()}
    out = op(*tensors, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    return OpCall(op, args, kwargs, tuple(TensorMeta.of(o) for o in outs))


def _meta(*shape: int) -> TensorMeta:
    return TensorMeta(shape, torch.float32)


B, H, L, E = 2, 4, 8, 16
QKV = (_meta(B, H, L, E), _meta(B, H, L, E), _meta(B, H, L, E))
FULL = 4.0 * B * H * L * L * E  # QK^T and PV: 2 * L * S * E multiply-adds each, per (batch, head)

CAUSAL_FORMS = {
    "sdpa-positional": (SDPA, (*QKV, None, 0.0, True), {}),
    "sdpa-keyword": (SDPA, QKV, {"is_causal": True}),
    "sdpa-keyword-with-mask-slot": (SDPA, (*QKV, None), {"dropout_p": 0.0, "is_causal": True}),
    "cpu-flash-positional": (CPU_FLASH, (*QKV, 0.0, True), {}),
    "cpu-flash-keyword": (CPU_FLASH, QKV, {"is_causal": True}),
    "cpu-flash-positional-with-scale": (CPU_FLASH, (*QKV, 0.0, True), {"scale": 0.25}),
}
PLAIN_FORMS = {
    "sdpa": (SDPA, QKV, {}),
    "sdpa-explicit-false": (SDPA, (*QKV, None, 0.0, False), {}),
    "cpu-flash": (CPU_FLASH, QKV, {}),
    "cpu-flash-explicit-false": (CPU_FLASH, (*QKV, 0.0, False), {}),
}


@pytest.mark.parametrize("form", list(PLAIN_FORMS))
def test_attention_flops_are_hand_counted(form: str) -> None:
    op, args, kwargs = PLAIN_FORMS[form]
    assert op_flops(_call(op, *args, **kwargs)) == FULL


@pytest.mark.parametrize("form", list(CAUSAL_FORMS))
def test_causal_attention_costs_exactly_half(form: str) -> None:
    """Causal attention computes half of the scores, however ``is_causal`` was passed (the
    CPU flash op has it at position 4, sdpa at 5; both may come by keyword)."""
    op, args, kwargs = CAUSAL_FORMS[form]
    plain = op_flops(_call(op, *QKV))
    assert plain == FULL
    assert op_flops(_call(op, *args, **kwargs)) == plain / 2


def test_3d_attention_flops() -> None:
    """(batch, seq, dim): one leading dim, hand-counted; causal halves it."""
    q = _meta(B, L, E)
    full = 4.0 * B * L * L * E
    assert op_flops(_call(SDPA, q, q, q)) == full
    assert op_flops(_call(SDPA, q, q, q, is_causal=True)) == full / 2


def test_index_reads_only_the_gathered_elements() -> None:
    """x[idx] on a [1000, 64] table with 8 indices reads 8 rows, not the table (hand-counted)."""
    from autopar.cost.compute import op_bytes
    from autopar.cost.precision import PRECISIONS

    table, idx, out = _meta(1000, 64), TensorMeta((8,), torch.int64), _meta(8, 64)
    fp32 = PRECISIONS["fp32"]
    assert op_bytes(aten.index.Tensor, [table, idx], (out,), fp32) == 8 * 64 * 4 + 8 * 8 + 8 * 64 * 4
    small = _meta(4, 64)  # fewer source elements than picked ones: the source is read whole
    big_out = _meta(16, 64)
    assert op_bytes(aten.index.Tensor, [small, TensorMeta((16,), torch.int64)], (big_out,), fp32) == \
        4 * 64 * 4 + 16 * 8 + 16 * 64 * 4


def test_in_place_cache_writes_touch_only_the_written_rows() -> None:
    """A KV cache's write (slots 16, 512 positions, 2 KV heads of 64) of 4 rows x 1 new position:
    ``index_put_`` reads the values and indices and writes 4 x 1 x 2 x 64 elements, not the cache
    (hand-counted); ``index_copy_`` of 3 positions likewise; on a rank holding one of the 2 heads,
    half the rows (the touched positions split with the destination)."""
    from autopar.cost.compute import op_bytes
    from autopar.cost.precision import PRECISIONS

    fp32 = PRECISIONS["fp32"]
    cache, slots, positions, values = (_meta(16, 512, 2, 64), TensorMeta((4, 1), torch.int64),
                                       TensorMeta((4, 1), torch.int64), _meta(4, 1, 2, 64))
    rows = 4 * 1 * 2 * 64 * 4
    assert op_bytes(aten.index_put_.default, [cache, slots, positions, values], (cache,), fp32) == \
        rows + 2 * 4 * 8 + rows + rows
    one_head = op_bytes(aten.index_put_.default, [cache, slots, positions, values], (cache,), fp32,
                        lambda meta, k: meta.numel // 2 if k in (0, 3, 4) else meta.numel)
    assert one_head == rows / 2 + 2 * 4 * 8 + rows / 2 + rows / 2
    dest, index, source = _meta(2, 2, 512, 64), TensorMeta((3,), torch.int64), _meta(2, 2, 3, 64)
    assert op_bytes(aten.index_copy_.default, [dest, index, source], (dest,), fp32) == \
        3 * 2 * 2 * 64 * 4 * 3 + 3 * 8


def test_in_place_ops_keep_no_new_memory() -> None:
    """masked_fill_ returns its input's memory; masked_fill keeps a new output for backward."""
    import autopar
    from autopar.cost.model import CostContext, op_cost
    from autopar.cost.precision import PRECISIONS
    from autopar.rules.strategy import R, Strategy

    x, mask = _meta(8, 16), TensorMeta((8, 16), torch.bool)
    ctx = CostContext(mesh=autopar.Mesh({"dp": 2}, "cpu"), precision=PRECISIONS["fp32"], train=True)
    replicated = Strategy(((R,),), ((R,), (R,)))
    out_of_place = OpCall(aten.masked_fill.Scalar, (x, mask, 0.0), {}, (x,))
    in_place = OpCall(aten.masked_fill_.Scalar, (x, mask, 0.0), {}, (x,))
    assert op_cost(out_of_place, replicated, ctx).memory == 8 * 16 * 4
    assert op_cost(in_place, replicated, ctx).memory == 0
