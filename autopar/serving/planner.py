"""``plan_serving``: the serving deployment of a model on a cluster with the highest goodput under an SLO.

1. Every replica it may deploy (TP degrees dividing the node; tp x pp where pipelines can matter:
   ``replicas``) gets its step times from ILP plans of its prefill and decode steps
   (``planned.plan_step_times``); one whose steps cannot be planned (the weights do not fit, the heads
   do not split) is left out with its reason.
2. The cluster is cut into identical units of one node (or the whole cluster when smaller; the smallest
   replica's devices when it spans nodes); a unit's
   candidates are every aggregated deployment and every prefill/decode split of its devices
   (``candidates.deployments``), KV transfers on the node's links. Arrivals split evenly over the
   units (a Poisson stream thinned at random is Poisson), so a unit serves rate/units and the
   cluster's goodput is units x the unit's. Devices beyond whole units stay idle (said in the plan).
3. Candidates are searched best bound first (``_throughput_bound``: what the pools could process
   at full batches, ignoring the SLO, an upper bound of goodput under the fitted step times, given the slack
   of a finite run, ``_RUN_SLACK``); one whose bound does not beat the best goodput found is not simulated.
   The rest go through DistServe's goodput search (``goodput.find_goodput``).
4. Each pool's batching limits (vLLM's ``max_num_seqs`` and ``max_num_batched_tokens``), unless the caller pins
   them: a candidate is searched at the default limits, then at each limit derived from its pools' step times
   and the SLO (DistServe Sec. 4: a decode pool's largest batch whose step fits the TPOT target, a prefill
   pool's largest budget whose step fits the TTFT; ``serving.limits``), one at a time, keeping those that raise
   its goodput by more than the search's precision (one run at that rate drops the others). The bound is taken
   at each choice's limits (a smaller batch or budget lowers it), so it prunes these too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
from torch import nn

from autopar.errors import InputError, InputTypeError
from autopar.mesh import Mesh
from autopar.serving.candidates import deployments
from autopar.serving.deployment import Deployment, Pool
from autopar.serving.goodput import GoodputResult, find_goodput, meets_slo
from autopar.serving.limits import Means, Pins, pool_moves
from autopar.serving.planned import PlannedStepTimes
from autopar.serving.replicas import ReplicaKey, ReplicaOptions, prefill_layout, replica_times
from autopar.hf.servable import as_servable
from autopar.serving.servable import check_servable
from autopar.serving.serving_plan import ServingPlan, build_plan
from autopar.serving.workload import SLO, Cluster, Workload

_SAMPLE = 4096
"""Requests drawn to read the workload's lengths (means, longest): enough for the tail, deterministic."""
_RUN_SLACK = 1.1
"""How far a simulated goodput may exceed the pools' steady-state throughput (``_throughput_bound``): a run is
finite (``goodput``: 30 x the TTFT target), so a rate r x the throughput builds a backlog whose delay reaches the
TTFT target only after 1 / (r - 1) TTFTs: at p90, up to r = 1 + 1 / 27 still passes; and a sample's arrivals
stray by ~1 / sqrt(n) from the rate (4.5% at the 500 requests of a p90 run). A batch limit that binds runs the
pools at their bound, so pruning without this slack drops limits that win (a 2.8% excess seen)."""


@dataclass(frozen=True, kw_only=True)
class Lengths:
    """The workload's request lengths as the planning reads them."""

    mean_prompt: float
    """Mean prompt tokens."""
    mean_output: float
    """Mean output tokens."""
    longest: int
    """Longest request (prompt + output) of the sample: the decode steps are planned up to it."""
    shortest_prompt: int
    """Shortest prompt of the sample."""
    single_token: float
    """Fraction of requests with one output token (their TPOT is 0)."""

    @classmethod
    def of(cls, workload: Workload) -> "Lengths":
        r = workload.sample(_SAMPLE)
        return cls(mean_prompt=float(r.prompt_tokens.mean()), mean_output=float(r.output_tokens.mean()),
                   longest=int((r.prompt_tokens + r.output_tokens).max()), shortest_prompt=int(r.prompt_tokens.min()),
                   single_token=float(np.mean(r.output_tokens == 1)))


def plan_serving(model: nn.Module, cluster: Cluster, workload: Workload, slo: SLO, *, max_batch: int | None = None,
                 token_budget: int | None = None, disaggregated: bool = True, tp_degrees: tuple[int, ...] | None = None,
                 pp_degrees: tuple[int, ...] | None = None, ep_degrees: tuple[int, ...] | None = None,
                 step_overhead_s: float = 0.0, rel_tol: float = 0.02) -> ServingPlan:
    """The deployment of ``model`` on ``cluster`` serving ``workload`` with the highest goodput under ``slo``
    (module docstring). ``model`` must be servable (``autopar.serving.servable``); a model built on the meta
    device plans without allocating. ``max_batch`` and ``token_budget`` pin every pool's batching limits
    (vLLM's ``max_num_seqs``, ``max_num_batched_tokens``); None searches them per pool (``serving.limits``);
    ``tp_degrees`` restricts the replicas' TP degrees;
    ``pp_degrees`` sets their pipeline depths (each at every TP degree, 1 for TP alone; None: TP alone and
    pipelines where they can matter, see ``serving.replicas``); ``ep_degrees`` sets the expert-parallel replicas
    (None: a mixture of experts tries each size, unless TP or pp degrees are given; () none);
    ``step_overhead_s`` adds fixed seconds per step;
    ``rel_tol`` is the goodput search's precision."""
    started = time.perf_counter()
    for value, kind in ((cluster, Cluster), (workload, Workload), (slo, SLO)):
        if not isinstance(value, kind):
            raise InputTypeError(f"plan_serving needs a {kind.__name__}, got {type(value).__name__}")
    model = as_servable(model)  # an HF causal LM: its slot-indexed cache adapter
    check_servable(model)
    for value, name in ((max_batch, "max_batch"), (token_budget, "token_budget")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"plan_serving: {name} must be a whole number >= 1 or None (searched), got {value!r}")
    pins = Pins(max_batch=max_batch, token_budget=token_budget)
    lengths = Lengths.of(workload)
    positions = getattr(model, "max_positions", None) or 1 << 30
    if lengths.longest > positions:
        raise InputError(f"requests of up to {lengths.longest} tokens (prompt + output) exceed the model's "
                         f"{positions} positions")
    unit = min(cluster.devices, cluster.devices_per_node)
    options = ReplicaOptions(longest=lengths.longest, mean_tokens=lengths.mean_prompt + lengths.mean_output,
                             max_batch=pins.default[0], token_budget=pins.default[1], step_overhead_s=step_overhead_s,
                             max_positions=positions)
    times, skipped = replica_times(model, cluster, unit, options, tp_degrees, pp_degrees, ep_degrees)
    prefill_times = {r: prefill_layout(model, cluster, t, options) for r, t in times.items()}
    steps_s = time.perf_counter() - started
    if not times:
        raise InputError("no replica of the model can be planned on this cluster: "
                         + "; ".join(f"{label}: {why}" for label, why in skipped.items()))
    unit = max(unit, min(t.devices for t in times.values()))  # replicas spanning nodes (nothing fits one)
    limit = cluster.profile.memory_limit()
    search = _Search(workload=workload, slo=slo, lengths=lengths, rel_tol=rel_tol, pins=pins)
    for size in _unit_sizes(cluster, unit, times, disaggregated):
        intra = size <= cluster.devices_per_node  # a unit of several nodes sends its caches over the network
        role_times = {(r, role): _for_role(prefill_times[r] if role == "prefill" else t, role, limit, intra)
                      for r, t in times.items() for role in ("serve", "prefill", "decode")}
        search.run(deployments(size, sorted(times), lambda r, role: role_times[r, role], max_batch=pins.default[0],
                               token_budget=pins.default[1], disaggregated=disaggregated,
                               aggregated=size == unit), cluster.devices // size)
    return build_plan(results=search.ranked(), pruned=search.pruned, dropped=search.dropped, skipped=skipped,
                      cluster=cluster,
                      workload=workload, slo=slo, lengths=(lengths.mean_prompt, lengths.mean_output),
                      planning_s=time.perf_counter() - started, steps_s=steps_s,
                      model_name=type(model).__name__,
                      pinned={"max_batch": max_batch, "token_budget": token_budget})


def _unit_sizes(cluster: Cluster, unit: int, times: dict[ReplicaKey, PlannedStepTimes], disaggregated: bool
                ) -> list[int]:
    """Devices per unit to search: one node (or the smallest replica's nodes); and twice that (disaggregated
    only) when a unit holds at most two of the smallest replicas, so that one unit allows only a 1:1
    prefill/decode split (a 70B at tp >= 4)."""
    sizes = [unit]
    smallest = min(t.devices for t in times.values())
    if disaggregated and cluster.devices >= 2 * unit and unit >= cluster.devices_per_node and unit // smallest <= 2:
        sizes.append(2 * unit)
    return sizes


def _for_role(times: PlannedStepTimes, role: str, limit: float, intra_node: bool) -> PlannedStepTimes:
    """The replica's KV capacity in its role: a prefill replica runs prefill plans and keeps caches as they
    place them, a decode replica its decode plans, an aggregated one both (caches as decode keeps them).
    ``intra_node``: KV transfers stay on the node's links."""
    if not intra_node:
        times = replace(times, transfer_mesh=Mesh({"pd": 2}, times.transfer_mesh.hardware, devices_per_node=1))
    if role == "prefill":
        return times.for_phases(times.prefill_points, times.prefill_points, limit)
    if role == "decode":
        return times.for_phases(times.decode_points, times.decode_points, limit)
    return times


def _throughput_bound(d: Deployment, lengths: Lengths, slo: SLO) -> tuple[float, str]:
    """Requests/s the deployment's pools could process at full batches, the SLO aside (an upper bound of its
    goodput under these step times), or 0 and why when no request can meet the SLO at all. Taken at the pools'
    own limits (full batches of ``max_batch``, full steps of ``token_budget``), so it bounds each limit choice;
    the 0 cases do not depend on the limits."""
    def prefill_rate(p: Pool) -> float:  # prompts packed into full-budget steps
        per_step = max(p.token_budget / lengths.mean_prompt, 1.0)
        pairs = per_step * lengths.mean_prompt * (lengths.mean_prompt + 1) / 2
        return p.replicas * per_step / p.step_times.prefill_s(round(per_step * lengths.mean_prompt), round(pairs))

    def decode_rate(p: Pool) -> float:  # full batches (as many requests as the cache holds at the mean)
        context = lengths.mean_prompt + lengths.mean_output / 2
        batch = max(min(p.max_batch, p.step_times.kv_capacity_tokens // (lengths.mean_prompt + lengths.mean_output)), 1)
        return p.replicas * batch / (lengths.mean_output * p.step_times.decode_s(int(batch), round(batch * context)))

    first, second = (d.serve, d.serve) if d.serve is not None else (d.prefill, d.decode)
    assert first is not None and second is not None
    fastest_first = first.step_times.prefill_s(lengths.shortest_prompt,
                                               lengths.shortest_prompt * (lengths.shortest_prompt + 1) // 2)
    if fastest_first > slo.ttft_s:
        return 0.0, f"prefilling the shortest prompt alone takes {fastest_first:.3g} s > the TTFT target {slo.ttft_s} s"
    fastest_token = second.step_times.decode_s(1, lengths.shortest_prompt + 1)
    if fastest_token > slo.tpot_s and lengths.single_token < slo.percentile:
        return 0.0, f"a decode step of one request takes {fastest_token:.3g} s > the TPOT target {slo.tpot_s} s"
    return min(prefill_rate(first), decode_rate(second)), ""


@dataclass(kw_only=True)
class _Search:
    """The goodput search over units' candidates, best bound first, pruning by bound (module docstring)."""

    workload: Workload
    """The requests (its rate only seeds the search)."""
    slo: SLO
    """The targets."""
    lengths: Lengths
    """The workload's lengths."""
    rel_tol: float
    """Precision of each goodput."""
    pins: Pins
    """The limits the caller pinned; the others are searched per pool."""
    results: list[tuple[GoodputResult, int]] = field(default_factory=list)
    """Each candidate searched (a unit's goodput) with the units of the cluster."""
    best: dict[bool, float] = field(default_factory=lambda: {False: 0.0, True: 0.0})
    """The best cluster goodput found per kind (disaggregated or not): both bests are found exactly."""
    pruned: int = 0
    """Candidates not simulated: their bound could not beat the best of their kind."""
    dropped: int = 0
    """Limits of a candidate not searched: their bound could not beat the best, or they missed the SLO in one run
    just above its goodput at other limits."""

    def run(self, candidates: list[Deployment], units: int) -> None:
        bounds = [_throughput_bound(d, self.lengths, self.slo) for d in candidates]
        for i in sorted(range(len(candidates)), key=lambda i: (-bounds[i][0], i)):
            bound, reason = bounds[i]
            if not bound:  # no limit lets a request meet the SLO: said once, at the default limits
                self.results.append((GoodputResult(deployment=candidates[i], goodput_rps=0.0, report=None,
                                                   simulations=0, reason=reason), units))
                continue
            self.search_limits(candidates[i], units)

    def search_limits(self, d: Deployment, units: int) -> None:
        """``d`` at its limits (the defaults, or the pins), then each pool's other limits in turn
        (``limits.pool_moves``), each kept where it raises the goodput: those whose bound could beat the best
        goodput found are simulated (module docstring)."""
        means = Means(prompt=self.lengths.mean_prompt, output=self.lengths.mean_output)
        roles = ("serve",) if d.serve is not None else ("prefill", "decode")
        moves = [(role, move) for role, pool in zip(roles, d.pools)
                 for move in pool_moves(pool, role, means, self.slo, self.pins)]
        current, found = d, 0.0
        for role, move in [("", None), *moves]:
            variant = current
            if move is not None:
                pool = getattr(current, role)
                variant = replace(current, **{role: replace(pool, **{move[0]: move[1]})})
            bound = _throughput_bound(variant, self.lengths, self.slo)[0]
            if move is None and bound * _RUN_SLACK * units <= self.best[d.disaggregated]:
                self.pruned += 1  # other limits are smaller (pool_moves), and so are their bounds
                return
            # Other limits of a deployment searched already are worth a search only if they serve more than the
            # search's precision above its goodput: one run there tells (most limits never bind at that rate).
            rate = found * (1 + self.rel_tol)
            if move is not None and (bound * _RUN_SLACK * units <= max(self.best[d.disaggregated], rate * units)
                                     or not meets_slo(variant, self.workload, self.slo, rate)):
                self.dropped += 1
                continue
            # The bracket starts at half the bound (the unit's SLO-free throughput): a few halvings from there,
            # instead of doublings from the asked rate, which may be orders of magnitude lower; or at the rate
            # the limits were just seen to meet.
            start = replace(self.workload, arrival_rate=rate or bound / 2)
            result = find_goodput(variant, start, self.slo, rel_tol=self.rel_tol)
            self.best[d.disaggregated] = max(self.best[d.disaggregated], result.goodput_rps * units)
            self.results.append((result, units))
            if result.goodput_rps > found:
                current, found = variant, result.goodput_rps

    def ranked(self) -> list[tuple[GoodputResult, int]]:
        """Results by cluster goodput, best first (ties: the smaller unit, then the name)."""
        return sorted(self.results, key=lambda r: (-r[0].goodput_rps * r[1], r[0].deployment.devices,
                                                   r[0].deployment.name))
