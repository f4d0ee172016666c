"""The replicas ``plan_serving`` may deploy: their parallelism (tp, pp) and planned step times.

Which are tried (each costs nine ILP-planned steps, so pipelines only where they can matter):

- every TP degree that divides the node and the unit (``tp_degrees`` restricts them), pp = 1;
- pp = 2 at a TP degree whose replica does not fit one device group, or fits badly (its cache holds fewer
  than ``max_batch`` mean-length requests), where 2 x tp still fits the unit and the twice-as-wide TP replica
  fits (with no tp = 2t replica the weights per device of t x 2 do not fit either: both halve them);
- when no TP-only replica fits a node at all: the node's TP degree x pp = 2, 4, ... across nodes, up to the
  cluster, the first that fits (a model too big for one node);
- ``pp_degrees`` replaces these rules: exactly those depths at every TP degree (1: TP alone), where the
  cluster's devices divide by the replica's;
- for a mixture of experts (a model with stacked expert weights, 3-D parameters), expert-parallel replicas of
  ep devices at each TP degree above 1 (``planned.EXPERT_PARALLEL``: the decode batch split on ep, the experts
  split by expert there, tokens dispatched by all-to-all; its cache whole on every device); ``ep_degrees``
  names them instead (() for none).

A pp replica runs as pp virtual replicas (``planned.PlannedStepTimes``), its pool counts replicas x pp.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autopar.errors import InputError
from autopar.serving.candidates import replica_label
from autopar.serving.planned import DECODE_BATCHES, PlannedStepTimes, plan_step_times
from autopar.serving.workload import Cluster

ReplicaKey = tuple[int, int, int]
"""(tp, pp, ep) of a replica."""


@dataclass(frozen=True, kw_only=True)
class ReplicaOptions:
    """What the replicas' steps are planned for."""

    longest: int
    """Longest request (prompt + output) to serve."""
    mean_tokens: float
    """Mean request length (prompt + output): a full batch's cache is reserved at it."""
    max_batch: int
    """Requests per replica at most."""
    token_budget: int
    """Tokens per step at most."""
    step_overhead_s: float
    """Fixed seconds per step."""
    max_positions: int
    """The model's positions."""


def replica_times(model: nn.Module, cluster: Cluster, unit: int, options: ReplicaOptions,
                  tp_degrees: tuple[int, ...] | None, pp_degrees: tuple[int, ...] | None,
                  ep_degrees: tuple[int, ...] | None = None
                  ) -> tuple[dict[ReplicaKey, PlannedStepTimes], dict[str, str]]:
    """Each replica's planned step times (module docstring for which), and why the others were left out."""
    wanted = [tp for tp in range(1, unit + 1) if cluster.devices_per_node % tp == 0 and unit % tp == 0]
    experts = _expert_degrees(model, wanted, ep_degrees, pinned=tp_degrees is not None or pp_degrees is not None)
    if tp_degrees is not None:
        bad = [tp for tp in tp_degrees if tp not in wanted]
        if bad:
            raise InputError(f"tp_degrees {bad} do not divide a unit of {unit} devices (one node, or the cluster)")
        wanted = sorted(tp_degrees)
    if pp_degrees is not None and (not pp_degrees or any(isinstance(p, bool) or not isinstance(p, int) or p < 1
                                                         for p in pp_degrees)):
        raise InputError(f"pp_degrees are pipeline stage counts >= 1 (1: TP alone), at least one, got {pp_degrees!r}")
    times: dict[ReplicaKey, PlannedStepTimes] = {}
    skipped: dict[str, str] = {}

    def attempt(tp: int, pp: int, ep: int = 1) -> bool:
        found = _planned(model, cluster, (tp, pp, ep), options)
        if isinstance(found, str):
            skipped[replica_label((tp, pp, ep))] = found
            return False
        times[tp, pp, ep] = found
        return True

    for ep in experts:
        attempt(1, 1, ep)
    if pp_degrees is not None:
        for pp in sorted(set(pp_degrees)):
            for tp in wanted:
                if cluster.devices % (tp * pp) == 0:
                    attempt(tp, pp)
        return times, skipped
    for tp in wanted:
        attempt(tp, 1)
    for tp in wanted:
        badly = (tp, 1, 1) not in times or _slots(times[tp, 1, 1], options.mean_tokens) < options.max_batch
        wider_fits = (2 * tp, 1, 1) in times or 2 * tp not in wanted
        if badly and wider_fits and 2 * tp <= unit and unit % (2 * tp) == 0:
            attempt(tp, 2)
    if not any(ep == 1 for _, _, ep in times) and wanted:  # nothing fits a node: pipeline the widest TP replica
        tp, pp = max(wanted), 2
        while tp * pp <= cluster.devices and not attempt(tp, pp):
            pp *= 2
    return times, skipped


def _expert_degrees(model: nn.Module, sizes: list[int], ep_degrees: tuple[int, ...] | None, pinned: bool
                    ) -> list[int]:
    """The expert-parallel degrees to try (module docstring): ``sizes`` (those dividing the node and the unit)
    above 1 for a model with stacked expert weights, unless TP or pp degrees are ``pinned``; or ``ep_degrees``."""
    usable = [ep for ep in sizes if ep > 1 and all(b % ep == 0 for b in DECODE_BATCHES)]  # the batch splits on ep
    experts = any(p.ndim == 3 for p in model.parameters())  # stacked (experts, in, out) weights
    if ep_degrees is not None:
        bad = [ep for ep in ep_degrees if isinstance(ep, bool) or not isinstance(ep, int) or ep not in usable]
        if bad:
            raise InputError(f"ep_degrees {bad} are not expert-parallel replica sizes: each must be >= 2, divide a "
                             f"unit of {sizes[-1]} devices (one node, or the cluster) and the planned decode batches "
                             f"{DECODE_BATCHES}")
        if ep_degrees and not experts:
            raise InputError(f"ep_degrees {tuple(ep_degrees)}: the model has no stacked expert weights (3-D "
                             "parameters) to split by expert")
        return sorted(set(ep_degrees))
    return usable if experts and not pinned else []


def _slots(times: PlannedStepTimes, mean_tokens: float) -> float:
    """Mean-length requests whose caches one whole replica holds (its pp virtual replicas together)."""
    return times.kv_capacity_tokens * times.pp / mean_tokens


def _planned(model: nn.Module, cluster: Cluster, replica: ReplicaKey, options: ReplicaOptions
             ) -> PlannedStepTimes | str:
    """One replica's step times (decode layout), or why it cannot serve."""
    tp, pp, ep = replica
    try:
        times = plan_step_times(model, cluster.profile, cluster.devices_per_node, tp, max_context=options.longest,
                                token_budget=options.token_budget, max_positions=options.max_positions,
                                transfer_intra_node=True, step_overhead_s=options.step_overhead_s,
                                kv_reserve_tokens=round(options.max_batch * options.mean_tokens), pp=pp, ep=ep)
    except InputError as exc:  # MemoryLimitError included: this replica cannot hold the model's steps
        return str(exc).splitlines()[0]
    # A virtual replica of a pp replica admits a request only if its pp-th of the cache holds it whole.
    if times.kv_capacity_tokens < options.longest:
        return (f"its KV cache holds {times.kv_capacity_tokens * pp} tokens beside the weights"
                + (f" ({times.kv_capacity_tokens} per batch in flight)" if pp > 1 else "")
                + f", less than the longest request's {options.longest}" + (" per batch" if pp > 1 else ""))
    return times


def prefill_layout(model: nn.Module, cluster: Cluster, times: PlannedStepTimes, options: ReplicaOptions
                   ) -> PlannedStepTimes:
    """A prefill replica's step times, its weights placed as its largest prefill step's plan wants them; the
    decode layout's (``times``) where that layout cannot be planned, and for an expert-parallel replica (a
    prefill chunk has no batch to split on ep: planned freely, it is a TP replica, already searched)."""
    if times.ep > 1:
        return times
    try:
        return plan_step_times(model, cluster.profile, cluster.devices_per_node, times.tp, max_context=options.longest,
                               token_budget=options.token_budget, max_positions=options.max_positions,
                               transfer_intra_node=True, step_overhead_s=options.step_overhead_s, layout="prefill",
                               kv_reserve_tokens=round(options.max_batch * options.mean_tokens), pp=times.pp)
    except InputError:
        return times
