"""Precision policy: the dtypes a plan computes, communicates and keeps state in."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace


from autopar.capture.graph import TensorMeta
from autopar.errors import InputError


@dataclass(frozen=True, kw_only=True)
class Precision:
    """How many bytes each kind of tensor takes under a training precision."""

    name: str
    """'bf16' (mixed: bf16 compute and communication, fp32 master weights and Adam) or 'fp32'."""
    activation_bytes: int
    """Bytes per element of floating activations and of communicated tensors."""
    state_bytes_per_param: int
    """Bytes per parameter element kept for training: weights, gradient, master copy, Adam m and v."""
    weight_bytes_per_param: int
    """Bytes per parameter element of the weights a forward-only step keeps."""
    grad_bytes_per_param: int = 4
    """Bytes per element of a parameter's gradient, kept and reduced (bucketed all-reduces,
    reduce-scatters of sharded parameters): fp32 in every precision (``reduce_dtype=fp32``)."""
    master_bytes_per_param: int = 4
    """Bytes per parameter element of the weights training keeps: fp32 masters (mixed
    precision computes with bf16 casts of them). The rest of the state is the optimizer's."""

    def for_gradients(self) -> "Precision":
        """This precision with floats at the gradient-reduction width (to price the
        collectives of a parameter's gradient)."""
        return self._for_gradients

    @functools.cached_property
    def _for_gradients(self) -> "Precision":  # made once: every parameter edge asks for it
        return replace(self, activation_bytes=self.grad_bytes_per_param)

    def tensor_bytes(self, meta: TensorMeta, numel: int | None = None) -> int:
        """Bytes of an activation: floats at the compute width, others at their own."""
        n = meta.numel if numel is None else numel
        return n * (self.activation_bytes if meta.dtype.is_floating_point else meta.dtype.itemsize)


PRECISIONS = {
    # Mixed precision as the runtime runs it (FSDP2's MixedPrecisionPolicy, reduce_dtype fp32):
    # fp32 master 4 + fp32 gradient 4 + Adam m 4 + v 4 = 16 bytes/param kept (the ZeRO paper's
    # 16, split differently: the bf16 weights are transient casts, priced where they are held).
    "bf16": Precision(name="bf16", activation_bytes=2, state_bytes_per_param=16, weight_bytes_per_param=2),
    # fp32: weights 4 + grads 4 + Adam m 4 + v 4.
    "fp32": Precision(name="fp32", activation_bytes=4, state_bytes_per_param=16, weight_bytes_per_param=4),
}


def get_precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise InputError(f"unknown precision {name!r}; known: {', '.join(PRECISIONS)}") from None


__all__ = ["Precision", "PRECISIONS", "get_precision"]
