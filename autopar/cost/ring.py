"""What ring attention's transfers cost (``runtime.ring``), and how much of them the step waits for.

The one place they are priced: the ILP (a strategy's own communication, ``problem.graph``, and
a checkpointed block's replay, ``memory.recompute``) and the plan's collectives and prediction
(``result.plan``) call here; its compute is ``cost.compute.ring_step_flops``.

On a ring of n ranks, with B the bytes of the rank's K and V blocks and c_j the busiest rank's
compute at step j (forward; backward ``BACKWARD_FACTOR`` times it):

- forward: n-1 sends of B, the one of step j issued before the step's compute and waited
  after it, so the step waits for max(0, t(B) - c_j) of it (t: ``collective_time``, a + B/b);
- backward: n-1 sends of (K, V) and n of (dK, dV) (B each). During step j's compute the link
  carries step j's (K, V) and step j-1's (dK, dV) (waited after step j's compute): the step
  waits for max(0, their sum - c_j), shared in proportion; the last (dK, dV), sent home after
  the last step, is waited for whole.

Memory: no gathered K and V (an all-gather K/V plan holds L x E of each per layer while the
layer runs, and keeps it for backward); ring attention keeps its own blocks, the output and
the log-sum-exp, with one block in flight (not kept) per step.
"""

from __future__ import annotations

from typing import NamedTuple

from autopar.cost.collectives import CollectiveCall, collective_time
from autopar.cost.compute import BACKWARD_FACTOR, ring_of, ring_step_flops, roofline_time
from autopar.cost.model import splits_work
from autopar.cost.precision import Precision
from autopar.mesh import Mesh
from autopar.rules.ring import SEND_RECV
from autopar.rules.strategy import OpCall, Strategy, local_numel


class RingTransfer(NamedTuple):
    phase: str
    """'forward' or 'backward'."""
    call: CollectiveCall
    waited: float
    """The share of its time the step waits for (the rest hides under the step's compute)."""


def ring_transfers(call: OpCall, strategy: Strategy, mesh: Mesh, precision: Precision, train: bool
                   ) -> list[RingTransfer]:
    """Every send one run of the op makes on a rank under ``strategy`` (backward's with
    ``train``), in the order it makes them; none unless it runs ring attention."""
    ring = ring_of(call, strategy)
    if ring is None or mesh.shape[ring] == 1:
        return []
    n = mesh.shape[ring]
    nbytes = sum(precision.tensor_bytes(m, local_numel(m, strategy.inputs[i], mesh.shape))
                 for i, m in ((1, call.tensor_inputs[1]), (2, call.tensor_inputs[2])))
    block = CollectiveCall(SEND_RECV, ring, nbytes)
    t = collective_time(block, mesh)
    ways = 1
    for d, size in enumerate(mesh.shape):
        ways *= size if splits_work(strategy, d) else 1
    compute = [roofline_time(f, 0.0, mesh, precision) for f in ring_step_flops(call, strategy, ways, mesh)]
    transfers = [RingTransfer("forward", block, _share(t, compute[j])) for j in range(n - 1)]
    if not train:
        return transfers
    for j in range(n):
        carried = (j < n - 1) + (j >= 1)  # this step's K/V, the last step's dK/dV
        share = _share(carried * t, BACKWARD_FACTOR * compute[j])
        transfers += [RingTransfer("backward", block, share)] * (j < n - 1)
        transfers += [RingTransfer("backward", block, share)] * (j >= 1)
    return [*transfers, RingTransfer("backward", block, 1.0)]  # the last dK/dV home


def _share(transfer_s: float, compute_s: float) -> float:
    """The share of ``transfer_s`` left after ``compute_s`` running beside it."""
    return max(0.0, transfer_s - compute_s) / transfer_s if transfer_s > 0 else 0.0


def ring_waited_time(call: OpCall, strategy: Strategy, mesh: Mesh, precision: Precision, train: bool,
                     phases: tuple[str, ...] = ("forward", "backward")) -> float:
    """Seconds one run of the op waits for its ring transfers of ``phases``."""
    return sum(collective_time(r.call, mesh) * r.waited for r in ring_transfers(call, strategy, mesh, precision, train)
               if r.phase in phases)


__all__ = ["RingTransfer", "ring_transfers", "ring_waited_time"]
