"""What an op's backward holds while it runs, beyond what the plan already counts (issue 31.3).

The plan's peak counts the tensors autograd saves (``cost.saved``) and the model state. While an
op's backward runs it also holds, at once, the gradient of its outputs it reads and the
gradients of its inputs it writes; neither is saved, so neither is counted. Its working set is

    sum over its floating outputs that receive a gradient of their local bytes
  + sum over its inputs that get a gradient of their local bytes (at the placement the op reads)
  + the temporaries its backward formula is known to allocate (``TEMPORARIES``)

each at the op's strategy (a Partial or replicated tensor is whole on every rank) and at the width
``Precision.tensor_bytes`` prices activations. An op whose backward returns a view of its output's
gradient (``ALIASING_BACKWARD``: a reshape, a transpose) allocates nothing: 0.

The one that matters is the loss of a large vocabulary: torch's composite ``cross_entropy``
runs ``nll_loss``'s backward (a zero-filled gradient the size of the logits) and then
``log_softmax``'s (the logits' gradient), both alive beside the saved log-probabilities, so it
holds two logits-sized tensors (15.7 GiB in fp32 for 16,384 tokens of Llama 3's 128,256-word
vocabulary) that no saved-tensor count sees. Measured with torch's ``MemTracker`` on a CPU model
(4,096 tokens, 32,768 words): 1,024 MiB of temporaries at the backward peak, two fp32 logits.

The loss's forward holds less, so it has no row of its own: the logits (and an upcasting loss's
fp32 copy of bf16 ones) beside the log-probabilities it saves, at most one and a half fp32 logits,
with no parameter gradient made either (``tests/test_forward_memory.py``, measured).

A parameter input's gradient is counted too, at the placement and width the op reads the
parameter (FSDP's gathered gradient, a mixed-precision copy's bf16 one); where it becomes or
replaces a ``.grad`` the model state counts (``gradient_bytes``, also the state's gradient
share), ``memory.backward`` nets that out.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

from autopar.capture.graph import TensorMeta
from autopar.cost.model import CostContext
from autopar.rules.strategy import OpCall, Placements, Strategy, local_numel

aten = torch.ops.aten

ALIASING_BACKWARD = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.t.default,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.alias.default, aten.flatten.using_ints, aten.unflatten.int, aten.detach.default, operator.getitem,
})
"""Ops whose backward hands back (a view of) the output gradient: no new tensor. Other views do
allocate (``slice``'s and ``select``'s backward fill a zero tensor of the input's size, ``split``'s
concatenates, ``expand``'s sums) and are priced like any op."""


def _input_bytes(index: int) -> Callable[[OpCall, Strategy, CostContext], float]:
    """A temporary the size of the op's ``index``-th tensor input, as the op reads it."""
    def bytes_of(call: OpCall, strategy: Strategy, ctx: CostContext) -> float:
        return _local_bytes(call.tensor_inputs[index], strategy.inputs[index], ctx)
    return bytes_of


TEMPORARIES: dict[object, Callable[[OpCall, Strategy, CostContext], float]] = {
    # composite: nll_loss's backward fills a gradient of the log-probabilities (the logits' size)
    # that log_softmax's backward reads while writing the logits' own gradient
    aten.cross_entropy_loss.default: _input_bytes(0),
}
"""Per op, what its backward formula allocates besides its inputs' gradients (torch's derivatives:
``tools/autograd/derivatives.yaml`` and the composite's decomposition). Fused kernels' scratch
(flash attention's fp32 accumulators) is not listed: it is not measurable here."""


def _local_bytes(meta: TensorMeta | None, placements: Placements | None, ctx: CostContext) -> float:
    if meta is None or placements is None or not meta.dtype.is_floating_point:
        return 0.0
    return float(ctx.precision.tensor_bytes(meta, local_numel(meta, placements, ctx.mesh.shape)))


def working_set_bytes(call: OpCall, strategy: Strategy, ctx: CostContext, *, output_grads: Sequence[bool],
                      input_grads: Sequence[bool]) -> float:
    """Bytes one rank holds while ``call``'s backward runs under ``strategy`` beyond what autograd
    saved (module docstring): ``output_grads[k]`` says output k receives a gradient,
    ``input_grads[i]`` that tensor input i is sent one."""
    if not ctx.train or call.target in ALIASING_BACKWARD:
        return 0.0
    total = sum(_local_bytes(meta, placements, ctx)
                for meta, placements, grad in zip(call.outputs, strategy.outputs, output_grads) if grad)
    total += sum(_local_bytes(meta, placements, ctx)
                 for meta, placements, grad in zip(call.tensor_inputs, strategy.inputs, input_grads) if grad)
    temporary = TEMPORARIES.get(call.target)
    return total + (temporary(call, strategy, ctx) if temporary is not None else 0.0)


def gradient_bytes(meta: TensorMeta, placements: Placements, ctx: CostContext) -> float:
    """Bytes of a trainable parameter's ``.grad`` on one rank, stored as ``placements``."""
    return float(local_numel(meta, placements, ctx.mesh.shape) * ctx.precision.grad_bytes_per_param)
