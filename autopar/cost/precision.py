"""Precision policy: the dtypes a plan computes, communicates and keeps state in."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from autopar.capture.graph import TensorMeta
from autopar.errors import InputError


@dataclass(frozen=True, kw_only=True)
class Precision:
    """How many bytes each kind of tensor takes under a training precision."""

    name: str
    """'bf16' (bf16 compute and communication: mixed with fp32 masters, or a bf16 model) or 'fp32'."""
    activation_bytes: int
    """Bytes per element of floating activations and of communicated tensors."""
    state_bytes_per_param: int
    """Bytes per parameter element kept for training: weights, gradient, master copy, Adam m and v."""
    weight_bytes_per_param: int
    """Bytes per parameter element of the weights a forward-only step (or a frozen
    parameter) keeps: the registered parameters, fp32 masters under mixed precision."""
    grad_bytes_per_param: int = 4
    """Bytes per element of a parameter's gradient as ``.grad`` keeps it."""
    reduce_bytes_per_param: int = 4
    """Bytes per element of a parameter's gradient as it is reduced (bucketed all-reduces,
    reduce-scatters of sharded parameters): fp32 in every precision (``reduce_dtype=fp32``)."""
    master_bytes_per_param: int = 4
    """Bytes per parameter element of the weights training keeps: fp32 masters (mixed
    precision computes with bf16 casts of them). The rest of the state is the optimizer's."""
    casts_parameters: bool = False
    """Whether the program reads each parameter through a cast copy at the compute width
    (mixed precision): a copy an op saves for backward is held until then."""
    captured_as_run: bool = False
    """Whether the captured graph's float dtypes are those the program runs (captured from the
    bf16 compute copy of fp32 masters, or from a bf16 model): a float is then priced at its
    own width, so what the model's code upcasts (a loss computed from ``logits.float()``, a
    norm's fp32 statistics) at 4 bytes, as it runs. Otherwise (an fp32 model planned in bf16)
    every float is priced at ``activation_bytes``, the width it would run at."""

    def for_gradients(self) -> "Precision":
        """This precision with floats at the gradient-reduction width (to price the
        collectives of a parameter's gradient)."""
        return self._for_gradients

    @functools.cached_property
    def _for_gradients(self) -> "Precision":  # made once: every parameter edge asks for it
        return replace(self, activation_bytes=self.reduce_bytes_per_param, captured_as_run=False)

    def tensor_bytes(self, meta: TensorMeta, numel: int | None = None) -> int:
        """Bytes of an activation: floats at the compute width (at their own where the graph
        was captured as it runs, ``captured_as_run``), others at their own."""
        n = meta.numel if numel is None else numel
        floats_at_compute_width = meta.dtype.is_floating_point and not self.captured_as_run
        return n * (self.activation_bytes if floats_at_compute_width else meta.dtype.itemsize)


PRECISIONS = {
    # Mixed precision as the runtime runs it (FSDP2's MixedPrecisionPolicy, reduce_dtype fp32):
    # fp32 master 4 + fp32 gradient 4 + Adam m 4 + v 4 = 16 bytes/param kept (the ZeRO paper's
    # 16, split differently: the bf16 weights are transient casts, priced where they are held).
    # Forward-only, the registered fp32 masters are what stays (4), each use reads a transient cast.
    "bf16": Precision(name="bf16", activation_bytes=2, state_bytes_per_param=16, weight_bytes_per_param=4,
                      casts_parameters=True),
    # fp32: weights 4 + grads 4 + Adam m 4 + v 4.
    "fp32": Precision(name="fp32", activation_bytes=4, state_bytes_per_param=16, weight_bytes_per_param=4),
}


BF16_PARAMETERS = Precision(name="bf16", activation_bytes=2, state_bytes_per_param=8, weight_bytes_per_param=2,
                            grad_bytes_per_param=2, master_bytes_per_param=2)
"""A model whose parameters are bf16 runs in bf16 as it is: weights 2 + gradient 2 + Adam m 2
+ v 2 (torch's optimizers keep state in the parameter's dtype); gradients are still reduced
in fp32 buckets (``reduce_bytes_per_param``) and written back in bf16."""


def get_precision(name: str, parameter_dtype: torch.dtype | None = None) -> Precision:
    """The policy ``name`` names, for a model whose floating parameters are ``parameter_dtype``
    (None: float32, the masters of a mixed-precision run): bf16 parameters have no masters."""
    try:
        policy = PRECISIONS[name]
    except KeyError:
        raise InputError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}") from None
    return BF16_PARAMETERS if name == "bf16" and parameter_dtype == torch.bfloat16 else policy


__all__ = ["BF16_PARAMETERS", "Precision", "PRECISIONS", "get_precision"]
