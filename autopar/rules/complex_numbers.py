"""Complex numbers as rotary embeddings use them (torchtitan's Llama, Llama-4, DeepSeek-V2):
``view_as_complex`` / ``view_as_real`` and the real and imaginary parts, ``polar`` and
``complex`` building a complex tensor from two real ones, and conjugation.

``view_as_complex`` reads a trailing dim of 2 as (real, imaginary) pairs and ``view_as_real``
adds that dim back: views of every other dim, which a split follows; the pair dim is never
split (a rank would hold half of each number). ``real`` / ``imag`` / ``conj`` keep their input's
shape. None of them takes or makes a Partial complex tensor: its sum would run as a complex
collective, and the real values it comes from are summed before they pair up. Arithmetic on
the complex values themselves (``mul`` by the rotation) is the generic pointwise rule's.
"""

from __future__ import annotations

import torch

from autopar.rules.pointwise import broadcast_strategies
from autopar.rules.strategy import DimStrategy, OpCall, S
from autopar.rules.table import RuleTable

aten = torch.ops.aten
TABLE = RuleTable("complex")


def _kept_dims(call: OpCall, ndim: int) -> list[DimStrategy]:
    """Split any of the first ``ndim`` dims (those input and output share)."""
    out = call.outputs[0]
    assert out is not None
    return [DimStrategy((S(d),), (S(d),)) for d in range(ndim) if out.shape[d] > 1]


@TABLE.register(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall) -> list[DimStrategy]:
    out = call.outputs[0]
    assert out is not None
    return _kept_dims(call, out.ndim)  # every dim but the input's trailing pair


@TABLE.register(aten.view_as_real.default)
def view_as_real_rule(call: OpCall) -> list[DimStrategy]:
    return _kept_dims(call, call.tensor_inputs[0].ndim)  # every dim but the output's trailing pair


@TABLE.register(aten.real.default, aten.imag.default, aten.conj.default, aten._conj.default,
                aten.resolve_conj.default)
def same_shape_rule(call: OpCall) -> list[DimStrategy]:
    return _kept_dims(call, call.tensor_inputs[0].ndim)


@TABLE.register(aten.complex.default)
def complex_rule(call: OpCall) -> list[DimStrategy]:
    """real + i * imag: elementwise."""
    return broadcast_strategies(call)


@TABLE.register(aten.polar.default)
def polar_rule(call: OpCall) -> list[DimStrategy]:
    """abs * e^(i angle): elementwise."""
    return broadcast_strategies(call)
