"""The deployments of a cluster worth comparing, priced by ``RooflineStepTimes``.

Aggregated: every TP degree that divides the node and the model, as many replicas as fill the
cluster. Disaggregated: every split of the devices into a prefill pool and a decode pool, each
with its own TP degree (DistServe's search over the two phases' parallelism, Sec. 4.1), whole
replicas on both sides. ``deployments`` also takes replicas of tp x pp devices (``plan_serving``'s
pipelined replicas), each run as pp virtual replicas of tp devices (``planned.PlannedStepTimes``), and
expert-parallel replicas of ep devices (``planned.EXPERT_PARALLEL``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from autopar.errors import InputError
from autopar.serving.deployment import Deployment, Pool, StepTimes
from autopar.serving.roofline import RooflineStepTimes, TransformerShape
from autopar.serving.workload import Cluster


def tp_degrees(cluster: Cluster, model: TransformerShape) -> list[int]:
    """TP degrees that fit one node and split the model's heads and MLP evenly."""
    degrees = []
    for tp in range(1, min(cluster.devices, cluster.devices_per_node) + 1):
        if cluster.devices_per_node % tp or model.heads % tp or model.intermediate % tp:
            continue
        if model.kv_heads % tp and tp % model.kv_heads:
            continue
        degrees.append(tp)
    return degrees


def candidate_deployments(cluster: Cluster, model: TransformerShape, *, max_batch: int = 256,
                          token_budget: int = 2048, disaggregated: bool = True,
                          step_overhead_s: float = 0.0) -> list[Deployment]:
    """Aggregated deployments for each TP degree, then (``disaggregated``) every prefill/decode split."""
    def times(tp: int, role: str) -> RooflineStepTimes:
        # One node holds the whole cluster: KV transfers stay on NVLink; otherwise price the network.
        return RooflineStepTimes(model=model, hardware=cluster.profile, tp=tp,
                                 devices_per_node=cluster.devices_per_node, activation_tokens=token_budget,
                                 transfer_intra_node=cluster.devices <= cluster.devices_per_node,
                                 step_overhead_s=step_overhead_s)

    degrees = tp_degrees(cluster, model)
    if not degrees:
        raise InputError(f"no TP degree up to {cluster.devices_per_node} splits the model evenly")
    return deployments(cluster.devices, degrees, times, max_batch=max_batch, token_budget=token_budget,
                       disaggregated=disaggregated)


Replica = int | tuple[int, int] | tuple[int, int, int]
"""A replica's parallelism: a TP degree, (tp, pp) for tp x pp devices, or (tp, pp, ep) with ep the expert-parallel
devices of an expert-parallel replica (``serving.planned.EXPERT_PARALLEL``; then tp = pp = 1)."""


def replica_parts(replica: Replica) -> tuple[int, int, int]:
    """(tp, pp, ep) of a replica."""
    if isinstance(replica, int):
        return replica, 1, 1
    return (*replica, 1) if len(replica) == 2 else replica  # type: ignore[return-value]


def replica_label(replica: Replica) -> str:
    """'tp=4', 'tp=4 pp=2' for a pipelined replica, 'ep=4' for an expert-parallel one."""
    tp, pp, ep = replica_parts(replica)
    if ep > 1:
        return f"ep={ep}"
    return f"tp={tp}" + (f" pp={pp}" if pp > 1 else "")


def deployments(devices: int, degrees: Sequence[Replica], times: Callable[[Replica, str], StepTimes], *,
                max_batch: int = 256, token_budget: int = 2048, disaggregated: bool = True, aggregated: bool = True
                ) -> list[Deployment]:
    """Every deployment of ``devices`` whose replicas have one of the ``degrees`` (TP degrees, or (tp, pp)):
    aggregated ones filling the devices, then (``disaggregated``) every split into whole prefill and decode
    replicas. ``times(replica, role)``: a replica's step times in its role ("serve", "prefill" or "decode");
    a pp replica's are one of its pp virtual replicas', so its pool holds replicas x pp of tp devices each."""
    def size(replica: Replica) -> int:
        return math.prod(replica_parts(replica))

    def pool(replica: Replica, replicas: int, role: str) -> Pool:
        tp, pp, ep = replica_parts(replica)
        return Pool(step_times=times(replica, role), replicas=replicas * pp, devices_per_replica=tp * ep,
                    max_batch=max_batch, token_budget=token_budget, label=replica_label(replica))

    out = [Deployment(name=f"agg {replica_label(r)} x{devices // size(r)}", serve=pool(r, devices // size(r), "serve"))
           for r in degrees if devices % size(r) == 0 and aggregated]
    if not disaggregated:
        return out
    for r_p in degrees:
        for r_d in degrees:
            for n_p in range(1, devices // size(r_p) + 1):
                decode_devices = devices - n_p * size(r_p)
                if decode_devices < size(r_d) or decode_devices % size(r_d):
                    continue
                n_d = decode_devices // size(r_d)
                out.append(Deployment(name=f"disagg {n_p}P({replica_label(r_p)}) + {n_d}D({replica_label(r_d)})",
                                      prefill=pool(r_p, n_p, "prefill"), decode=pool(r_d, n_d, "decode")))
    return out
