"""Mixed precision (bf16 compute and communication, fp32 master weights): what the step is
captured from, and which precision a model runs in.

The step is captured from a *compute copy* of the model: the same modules, with every
floating parameter and buffer cast to bf16, and floating model inputs cast to bf16 on
entry. Its graph is then exactly a bf16 model's: dtype arguments (``x.float()``,
``.type_as(x)``, factory ``dtype=x.dtype``), type promotion and fake values all resolved
for bf16 by the model's own code. Capturing the fp32 model and casting afterwards would
leave ``.type_as(x)`` recorded as ``to(float32)`` (indistinguishable from ``x.float()``),
so bf16 values would silently promote back to fp32. The runtime keeps the fp32 masters
and casts each parameter where the program reads it (``passes.cast_parameters``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autopar.errors import InputError

PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}
COMPUTE_DTYPE = {"bf16": torch.bfloat16}
"""Compute dtype of each mixed precision, for a model whose parameters are fp32."""


def running_precision(model: nn.Module, precision: str | None, default: str) -> tuple[str, torch.dtype | None]:
    """(precision the plan prices, compute dtype to cast fp32 masters to, or None).

    An fp32 model runs as asked (``default``: the hardware's, bf16 on GPUs): fp32 as it is,
    or bf16 mixed precision with fp32 masters. A bf16 model runs in bf16 as it is (its
    gradients still reduced in fp32); asking it for fp32 is refused (no masters to use).
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) > 1 or (dtypes and next(iter(dtypes)) not in PRECISION_OF_DTYPE):
        raise InputError(f"the model's parameters are {sorted(map(str, dtypes))}: autopar runs a model in one "
                         "of float32 or bfloat16 (cast it with model.to(...))")
    own = PRECISION_OF_DTYPE[next(iter(dtypes))] if dtypes else "fp32"
    wanted = precision or (default if own == "fp32" else own)
    if own == "fp32" and wanted in COMPUTE_DTYPE:
        return wanted, COMPUTE_DTYPE[wanted]
    if wanted != own:
        raise InputError(f"precision={wanted!r} but the model's parameters are {own}: a {own} model runs in "
                         f"{own} (an fp32 model can run in bf16 with fp32 masters, not the other way round)")
    return own, None


def mixed_compute_dtype(model: nn.Module, precision: str | None, default: str) -> torch.dtype | None:
    """The dtype an fp32 model computes in when it runs in mixed precision (``precision``, else the
    hardware's ``default``): bf16 for 'bf16'; None for any other model or precision (it runs as it
    is, or ``running_precision`` refuses it). ``autopar.plan`` captures the same compute copy as
    ``compile``, so that a float the model's code upcasts is priced at the width that runs."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes - {torch.float32}:
        return None
    return COMPUTE_DTYPE.get(precision or default)


def compute_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model as it computes under mixed precision, for capture: a copy of its modules
    sharing nothing with it, floating parameters and buffers cast to ``dtype`` (tied ones
    stay tied), floating model inputs cast to ``dtype`` on entry (FSDP2's
    ``cast_forward_inputs``; loss targets are the loss function's and are not cast).
    Costs a ``dtype`` copy of the weights while planning (nothing on the meta device)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            value = p.detach().to(dtype) if p.is_floating_point() else p.detach()
            memo[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            memo[id(b)] = b.detach().to(dtype) if b.is_floating_point() else b
    twin = copy.deepcopy(model, memo)
    twin.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    return twin


def _cast_inputs(dtype: torch.dtype) -> Any:
    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return tree_map(cast, args), tree_map(cast, kwargs)
    return hook


def compute_buffer(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A buffer as the program keeps it: floating buffers in the compute dtype (the program
    reads and writes them as the bf16 model does; only parameters have fp32 masters)."""
    return value.to(dtype) if dtype is not None and value.is_floating_point() else value
