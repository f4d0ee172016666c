"""What a random op's draw costs one rank, as ``autopar.runtime.random`` runs it.

The counter stream (the default) computes the rank's own elements only: their global
indices (one pass per dim), Philox-4x32-10 on one counter per ``LANES`` elements where the
rank holds whole rows of the drawn tensor's last dim (a multiple of 4), else one per element
(``autopar.runtime.stream``), ``ROUNDS x OPS_PER_ROUND`` eager int64 ops on those counters,
the lanes stacked into one word per element, and the sampler reading the words and writing
its values, read back by the op's arithmetic. Each eager op is a kernel of its own: one
launch, and a pass that reads and writes int64. The torch stream
(``random_stream='torch'``) draws the global tensor on every rank: one op per global element,
written and read back for the rank's slice. Forward only (backward reuses the mask);
recomputation prices its draws again where it prices the block's forward again.
"""

from __future__ import annotations

from autopar.cost.compute import roofline_time, with_fixed_cost
from autopar.cost.precision import Precision
from autopar.mesh import Mesh
from autopar.rules.dropout import ATTENTION_DROPOUT, drawn_numel
from autopar.rules.strategy import OpCall, Strategy, local_numel, shard_dim
from autopar.runtime.philox import LANES, OPS_PER_ROUND, ROUNDS

INT64 = 8
PASS_BYTES = 2 * INT64
"""An eager integer op reads one int64 tensor and writes one (scalars broadcast)."""
SAMPLER_OPS = 4
"""Ops of a sampler on the words (shift, cast, scale, compare), about."""


def draw_time(call: OpCall, strategy: Strategy, mesh: Mesh, precision: Precision, global_draws: bool = False) -> float:
    """Seconds one rank spends drawing ``call``'s random numbers (module docstring); 0 for
    a call that draws nothing."""
    n = drawn_numel(call)
    if n == 0:
        return 0.0
    out = call.outputs[0] if call.outputs and call.outputs[0] is not None else None
    width = precision.tensor_bytes(out, 1) if out is not None else precision.activation_bytes
    if global_draws:
        return roofline_time(float(n), 2.0 * n * width, mesh, precision)
    placements = strategy.outputs[0] if strategy.outputs and strategy.outputs[0] is not None else ()
    local = n * (local_numel(out, placements, mesh.shape) / out.numel) if out is not None and out.numel else n
    ndim = out.ndim if out is not None else 1
    per_counter = LANES if _whole_rows(call, placements, ndim) else 1
    counters = local / per_counter
    rounds = ROUNDS * OPS_PER_ROUND
    flops = counters * (rounds + ndim) + local * SAMPLER_OPS
    nbytes = counters * (rounds + ndim) * PASS_BYTES + local * (2 * LANES * INT64 / per_counter + INT64 + 2 * width)
    launches = rounds + 2 * ndim + SAMPLER_OPS + 2
    return with_fixed_cost(roofline_time(flops, nbytes, mesh, precision), mesh.hardware.op_overhead * launches,
                           mesh.hardware)


def _whole_rows(call: OpCall, placements: tuple, ndim: int) -> bool:
    """The rank holds whole rows of the drawn tensor's last dim, a multiple of ``LANES``."""
    if any(shard_dim(p) == ndim - 1 for p in placements):
        return False
    if call.target in ATTENTION_DROPOUT:
        return call.args[1].shape[-2] % LANES == 0  # the probabilities' last dim: the keys
    out = call.outputs[0]
    return out is not None and bool(out.shape) and out.shape[-1] % LANES == 0
