"""The deployments of a cluster worth comparing, priced by ``RooflineStepTimes``.

Aggregated: every TP degree that divides the node and the model, as many replicas as fill the
cluster. Disaggregated: every split of the devices into a prefill pool and a decode pool, each
with its own TP degree (DistServe's search over the two phases' parallelism, Sec. 4.1), whole
replicas on both sides. Pipeline and expert parallelism per phase come with the ILP-priced
step times (a later slice).
"""

from __future__ import annotations

from collections.abc import Callable

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


def deployments(devices: int, degrees: list[int], times: Callable[[int, str], StepTimes], *, max_batch: int = 256,
                token_budget: int = 2048, disaggregated: bool = True, aggregated: bool = True) -> list[Deployment]:
    """Every deployment of ``devices`` whose replicas have one of the TP ``degrees``: aggregated ones
    filling the devices, then (``disaggregated``) every split into whole prefill and decode replicas.
    ``times(tp, role)``: a replica's step times in its role ("serve", "prefill" or "decode")."""
    def pool(tp: int, replicas: int, role: str) -> Pool:
        return Pool(step_times=times(tp, role), replicas=replicas, devices_per_replica=tp, max_batch=max_batch,
                    token_budget=token_budget, label=f"tp={tp}")

    out = [Deployment(name=f"agg tp={tp} x{devices // tp}", serve=pool(tp, devices // tp, "serve"))
           for tp in degrees if devices % tp == 0 and aggregated]
    if not disaggregated:
        return out
    for tp_p in degrees:
        for tp_d in degrees:
            for n_p in range(1, devices // tp_p + 1):
                decode_devices = devices - n_p * tp_p
                if decode_devices < tp_d or decode_devices % tp_d:
                    continue
                n_d = decode_devices // tp_d
                out.append(Deployment(name=f"disagg {n_p}P(tp={tp_p}) + {n_d}D(tp={tp_d})",
                                      prefill=pool(tp_p, n_p, "prefill"), decode=pool(tp_d, n_d, "decode")))
    return out
