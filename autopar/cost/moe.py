"""What a dropless expert layer (``autopar::moe_experts``, ``capture.moe``) costs beyond its
roofline: under expert parallelism its all-to-alls, and the load imbalance of its experts.

The one place these are priced: the ILP (a strategy's own communication, ``problem.graph``, and
a checkpointed block's replay of it, ``memory.recompute``), the plan's collectives and prediction
(``result.plan``) and the op's compute and kept rows (``cost.model``) all call here.

Expert parallelism on mesh dim ``d`` of ``n`` ranks (``runtime.moe``), per rank and layer, with
``T_l`` local tokens, ``k`` choices, hidden size ``H`` and ``f`` = ``HardwareProfile.moe_imbalance``:

- forward: the counts per expert (``E`` int64s: latency only), then the dispatch of the rank's
  ``k * T_l`` sorted rows to their experts' ranks and the combine bringing them back, each an
  all-to-all of ``M = f * k * T_l * H * bytes`` (the busiest rank's rows; the collective formula
  sends ``(n - 1) / n`` of ``M``);
- backward: the same two all-to-alls reversed (the gradients of the rows);
- compute: ``f`` times the mean share of the expert FLOPs (the step waits for the busiest rank).

The bytes a rank actually moves depend on the routing; the plan lists them at this expectation
and the runtime logs them as data dependent (``runtime.ops.DATA_DEPENDENT``).
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from typing import NamedTuple

from autopar.capture.moe import MOE_EXPERTS
from autopar.cost.collectives import CollectiveCall
from autopar.cost.precision import Precision
from autopar.mesh import Mesh
from autopar.rules.redistribute import ALL_TO_ALL
from autopar.rules.strategy import OpCall, Strategy, is_strided, local_numel

COUNT_BYTES = 8
"""Bytes of one expert's count in the counts all-to-all (int64)."""


class MoeCollective(NamedTuple):
    phase: str
    """'forward' or 'backward'."""
    call: CollectiveCall
    data_dependent: bool
    """Its bytes are an expectation (the rows); the counts' are exact."""


def is_moe(target: object) -> bool:
    return target is MOE_EXPERTS


def moe_flops(call: OpCall) -> float:
    """Forward FLOPs of the whole layer: each (token, expert) pair through its expert's SwiGLU
    (``H x 2F`` then ``F x H`` multiply-adds, ``silu`` and the product elementwise). Exact for
    dropless routing: every pair is computed once, whichever expert it meets."""
    x, ids, _, gate_up, down = call.tensor_inputs
    pairs, hidden, ffn = ids.numel, x.shape[-1], down.shape[-1]
    return 2.0 * pairs * hidden * gate_up.shape[1] + 2.0 * pairs * ffn * hidden + 3.0 * pairs * ffn


def expert_dims(strategy: Strategy, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Mesh dims of more than one rank the strategy splits the experts on (``gate_up``'s dim 0):
    expert parallelism."""
    gate_up = strategy.inputs[3]
    return tuple(d for d, p in enumerate(gate_up)
                 if isinstance(p, Shard) and not is_strided(p) and p.dim == 0 and mesh_shape[d] > 1)


def compute_factor(call: OpCall, strategy: Strategy, mesh: Mesh) -> float:
    """How many times its mean share of the FLOPs a rank computes: ``moe_imbalance`` under
    expert parallelism (the busiest expert rank), else 1 (every rank its own tokens' pairs)."""
    if not is_moe(call.target) or not expert_dims(strategy, mesh.shape):
        return 1.0
    return mesh.hardware.moe_imbalance


def pair_share(call: OpCall, strategy: Strategy, mesh: Mesh) -> float:
    """The share of the layer's (token, expert) pairs a rank computes, and so of the rows it keeps
    for backward (the gathered tokens, the SwiGLU's intermediates): its tokens' share, times the
    imbalance where the experts are split (the busiest rank's pairs)."""
    ids = call.tensor_inputs[1]
    return local_numel(ids, strategy.inputs[1], mesh.shape) / ids.numel * compute_factor(call, strategy, mesh)


def moe_collectives(call: OpCall, strategy: Strategy, mesh: Mesh, precision: Precision, train: bool
                    ) -> list[MoeCollective]:
    """Every collective one run of the op makes on a rank under ``strategy``
    (backward's with ``train``); none unless it splits the experts. Rows are priced at the
    busiest rank's (module docstring)."""
    if not is_moe(call.target):
        return []
    dims = expert_dims(strategy, mesh.shape)
    if not dims:
        return []
    x, ids, _, gate_up, _ = call.tensor_inputs
    dim = dims[0]
    pairs = local_numel(ids, strategy.inputs[1], mesh.shape)
    row_bytes = precision.tensor_bytes(x, x.shape[-1])
    rows = int(mesh.hardware.moe_imbalance * pairs * row_bytes)
    counts = CollectiveCall(ALL_TO_ALL, dim, gate_up.shape[0] * COUNT_BYTES)
    moved = CollectiveCall(ALL_TO_ALL, dim, rows)
    forward = [MoeCollective("forward", counts, False), *[MoeCollective("forward", moved, True)] * 2]
    return forward + [MoeCollective("backward", moved, True)] * (2 if train else 0)


__all__ = ["COUNT_BYTES", "MoeCollective", "compute_factor", "expert_dims", "is_moe", "moe_collectives", "pair_share",
           "moe_flops"]
