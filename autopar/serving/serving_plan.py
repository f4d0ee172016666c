"""``ServingPlan``: what ``plan_serving`` chose, per pool, with the figures it was chosen on."""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from autopar.serving.deployment import Pool
from autopar.serving.goodput import GoodputResult
from autopar.serving.planned import PlannedStepTimes, describe_points
from autopar.serving.workload import SLO, Cluster, Workload
from autopar.units import fmt_bytes, fmt_time


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """One pool of identical replicas (all units together)."""

    role: str
    """"serve" (aggregated: prefill and decode), "prefill" or "decode"."""
    tp: int
    """Tensor-parallel degree of one replica (devices per pipeline stage)."""
    pp: int
    """Pipeline stages of one replica (its devices: tp x pp). As vLLM's pipeline parallelism, pp batches are in
    flight at once, each stage busy with a different one: the simulator ran the replica as pp virtual replicas,
    each with the chain's latency as its step time and a pp-th of the KV capacity."""
    ep: int
    """Expert-parallel devices of one replica (1: none): its decode batch split there (attention data parallel,
    the KV cache whole on each device), the experts split by expert, tokens dispatched by all-to-all."""
    replicas: int
    """Replicas over the whole cluster."""
    max_batch: int
    """Requests per batch at most (the scheduler's limit, vLLM's ``max_num_seqs``; a pp replica has pp such batches
    in flight): the caller's pin, or the one the planner chose for this pool (``serving.limits``)."""
    slots: int
    """Requests whose whole KV cache (mean prompt + mean output) fits one replica together (all its batches)."""
    token_budget: int
    """Tokens one step processes at most (decodes plus prefill chunks; vLLM's ``max_num_batched_tokens``): the
    caller's pin, or the one the planner chose for this pool."""
    kv_bytes_per_token: int
    """KV-cache bytes of one token over the replica (every layer, keys and values)."""
    kv_bytes_per_token_device: float
    """Of those, the bytes on one device, as the planned steps split the cache (by KV heads)."""
    kv_capacity_tokens: int
    """Tokens of KV cache one replica holds: the memory limit less the plans' weights and working memory (a pp
    replica: its busiest stage's, each stage holding its layers' caches)."""
    weight_bytes_device: float
    """Weights per device, the largest over the planned steps of the pool's phases."""
    prefill_mean_s: float
    """A step prefilling one mean-length prompt alone (0 for a decode pool)."""
    decode_step_s: float
    """A decode step of ``slots`` / pp (at most ``max_batch``) requests at the mean context, through every stage
    (0 for a prefill pool)."""
    kv_transfer_s: float
    """A mean prompt's KV cache from a prefill replica to this one (decode pools of a disaggregated plan)."""
    decode_line: tuple[float, float, float]
    """Decode step = w + beta x batch + gamma x context tokens (seconds), fitted through planned steps."""
    prefill_line: tuple[float, float, float]
    """Prefill step = a + b x tokens + c x (query, key) pairs (seconds), fitted through planned steps."""
    planned_steps: list[dict[str, Any]] = field(repr=False)
    """The planned steps the lines go through (shape, predicted time, memory)."""
    parameters: dict[str, str] = field(repr=False)
    """Placements of the parameters in the replica's largest planned step of its main phase (decode, or
    prefill for a prefill pool), as the intra-op ILP chose them over the ``tp`` axis (each stage's, for pp > 1)."""


@dataclass(frozen=True, kw_only=True)
class ServingPlan:
    """The chosen serving deployment (``autopar.plan_serving``)."""

    model: str
    """The model's class name."""
    cluster: dict[str, Any]
    """Devices, hardware, devices per node."""
    workload: dict[str, Any]
    """Mean prompt and output tokens, the arrival rate asked for."""
    slo: dict[str, float]
    """TTFT and TPOT targets and the percentile."""
    kind: str
    """"aggregated", "disaggregated", or "none" when no candidate meets the SLO."""
    deployment: str
    """The chosen unit deployment's name (one unit)."""
    units: int
    """Identical units the cluster is cut into (one node each, or the whole cluster when smaller; two nodes
    for a disaggregated unit of replicas so large that a node holds only two)."""
    unit_devices: int
    """Devices of one unit."""
    idle_devices: int
    """Devices beyond whole units (not used)."""
    pools: list[PoolPlan]
    """The pools of the chosen deployment, over all units."""
    goodput_rps: float
    """Requests/s the cluster serves within the SLO (units x one unit's); 0 when none does."""
    reason: str
    """Why goodput is 0, when it is."""
    ttft_p_s: float | None
    """At the goodput: the TTFT at the SLO's percentile (seconds)."""
    tpot_p_s: float | None
    """At the goodput: the TPOT at the SLO's percentile (seconds)."""
    best_aggregated_rps: float
    """The best aggregated candidate's goodput over the cluster (0: none meets the SLO or none was searched)."""
    best_disaggregated_rps: float
    """The best disaggregated candidate's goodput over the cluster."""
    candidates: list[dict[str, Any]]
    """Every candidate searched: name, each pool's [max_batch, token_budget] (a deployment is searched at several
    limits when they are left open), cluster goodput, simulations, reason for 0."""
    pruned: int
    """Candidates not simulated: their throughput bound could not beat the best of their kind."""
    dropped: int
    """Limits of a searched candidate not searched in turn (``plan_serving`` step 4): their bound could not beat the
    best goodput, or one run found them missing the SLO just above the candidate's goodput at other limits."""
    skipped: dict[str, str]
    """Replicas left out ('tp=2', 'tp=2 pp=2', 'ep=2'), and why."""
    planning_s: float
    """Seconds plan_serving took (planning the steps and the goodput search)."""
    steps_s: float = 0.0
    """Of those, the seconds planning the serving steps with the ILP (0 when all were planned before)."""
    pinned: dict[str, int | None] = field(default_factory=dict)
    """The batching limits the caller pinned for every pool ({"max_batch": .., "token_budget": ..}; None: searched
    per pool)."""

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.cluster["devices"]

    @property
    def devices_used(self) -> int:
        return self.units * self.unit_devices

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["goodput_per_device"] = self.goodput_per_device
        return out

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=120, force_terminal=False, color_system=None).print(render(self))
        return buffer.getvalue().rstrip()


def _pool_plan(pool: Pool, role: str, units: int, lengths: tuple[float, float], transfer: bool) -> PoolPlan:
    st = pool.step_times
    assert isinstance(st, PlannedStepTimes)
    prompt, output = lengths
    # The pool holds replicas x pp virtual replicas, each with a pp-th of a replica's cache (PlannedStepTimes).
    slots = int(st.kv_capacity_tokens * st.pp // (prompt + output))
    batch = max(min(int(st.kv_capacity_tokens // (prompt + output)), pool.max_batch), 1)
    context = round(batch * (prompt + output / 2))  # a batch midway through its outputs
    main = st.prefill_points if role == "prefill" else st.decode_points
    return PoolPlan(role=role, tp=st.tp, pp=st.pp, ep=st.ep, replicas=pool.replicas * units // st.pp,
                    max_batch=pool.max_batch,
                    slots=slots, token_budget=pool.token_budget, kv_bytes_per_token=main[0].kv_bytes_per_token,
                    kv_bytes_per_token_device=st.kv_bytes_per_token_device,
                    kv_capacity_tokens=st.kv_capacity_tokens * st.pp,
                    weight_bytes_device=max(p.weight_bytes for p in main),
                    prefill_mean_s=0.0 if role == "decode" else st.prefill_s(round(prompt),
                                                                             round(prompt * (prompt + 1) / 2)),
                    decode_step_s=0.0 if role == "prefill" else st.decode_s(batch, context),
                    kv_transfer_s=st.kv_transfer_s(round(prompt)) if transfer else 0.0,
                    decode_line=st.decode_line, prefill_line=st.prefill_line, planned_steps=describe_points(st),
                    parameters=_placed(max(main, key=lambda p: p.shape.tokens * p.shape.max_len).parameters,
                                       st.tp * st.ep))


def _placed(parameters: dict[str, str], devices: int) -> dict[str, str]:
    """The parameters' placements on a replica's axis; on an axis of one device every placement holds the whole
    tensor (the ILP prices a split of one way as no split, and may pick either), so all are shown whole."""
    return dict(parameters) if devices > 1 else {name: "R" for name in parameters}


def build_plan(*, results: list[tuple[GoodputResult, int]], pruned: int, dropped: int, skipped: dict[str, str],
               cluster: Cluster,
               workload: Workload, slo: SLO, lengths: tuple[float, float], planning_s: float, steps_s: float = 0.0,
               model_name: str = "", pinned: dict[str, int | None] | None = None) -> ServingPlan:
    """The plan of the best result (``results``: a unit's result and the cluster's units, best first), with
    the search's figures."""
    best, units = results[0]
    d = best.deployment
    roles = (("serve", d.serve),) if d.serve is not None else (("prefill", d.prefill), ("decode", d.decode))
    pools = [_pool_plan(p, role, units, lengths, role == "decode") for role, p in roles if p is not None]
    report = best.report
    q = round(slo.percentile * 100)
    unit_devices = d.devices

    def kind_best(disaggregated: bool) -> float:
        return max((r.goodput_rps * n for r, n in results if r.deployment.disaggregated == disaggregated), default=0.0)
    return ServingPlan(
        model=model_name, cluster={"devices": cluster.devices, "hardware": cluster.profile.name,
                           "devices_per_node": cluster.devices_per_node},
        workload={"mean_prompt_tokens": lengths[0], "mean_output_tokens": lengths[1],
                  "arrival_rate": workload.arrival_rate},
        slo={"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "percentile": slo.percentile},
        kind="none" if not best.goodput_rps else ("disaggregated" if d.disaggregated else "aggregated"),
        deployment=d.name, units=units, unit_devices=unit_devices, idle_devices=cluster.devices - units * unit_devices,
        pools=pools, goodput_rps=best.goodput_rps * units, reason=best.reason,
        ttft_p_s=_at(report.ttft_s, q) if report else None, tpot_p_s=_at(report.tpot_s, q) if report else None,
        best_aggregated_rps=kind_best(False), best_disaggregated_rps=kind_best(True),
        candidates=[{"name": r.deployment.name, "unit_devices": r.deployment.devices,
                     "limits": [[p.max_batch, p.token_budget] for p in r.deployment.pools],
                     "goodput_rps": r.goodput_rps * n, "simulations": r.simulations, "reason": r.reason}
                    for r, n in results],
        pruned=pruned, dropped=dropped, skipped=skipped, planning_s=planning_s, steps_s=steps_s,
        pinned=dict(pinned or {}))


def _at(percentiles: dict[int, float], q: int) -> float:
    """The percentile ``q`` of a report's dict, or the nearest it has."""
    return percentiles[q] if q in percentiles else percentiles[min(percentiles, key=lambda k: abs(k - q))]


_INDEX = re.compile(r"\.\d+\.")


def placement_rows(pools: list[PoolPlan]) -> list[tuple[str, ...]]:
    """One row per parameter name with its layer index replaced by ``*`` and each pool's placements of
    those parameters (several when the ILP placed layers differently: folded blocks share one)."""
    names: dict[str, None] = {}
    found: list[dict[str, Counter]] = []
    for pool in pools:
        by_pattern: dict[str, Counter] = {}
        for fqn, placement in pool.parameters.items():
            pattern = _INDEX.sub(".*.", fqn)
            names.setdefault(pattern)
            by_pattern.setdefault(pattern, Counter())[placement] += 1
        found.append(by_pattern)
    return [(name, *(", ".join(p for p, _ in f.get(name, Counter()).most_common()) or "-" for f in found))
            for name in names]


def _shape(pool: PoolPlan) -> str:
    """'tp=4', 'tp=4 pp=2 (2 batches in flight)', or 'ep=4 (experts by expert, attention data parallel)'."""
    if pool.ep > 1:  # the ILP may keep the experts whole there (small experts): said as planned
        split = any(".experts." in k and v.startswith("S(0)") for k, v in pool.parameters.items())
        return f"ep={pool.ep} ({'experts by expert' if split else 'experts whole'}, attention data parallel)"
    return f"tp={pool.tp}" + (f" pp={pool.pp} ({pool.pp} batches in flight)" if pool.pp > 1 else "")


def render(plan: ServingPlan) -> Group:
    """The plan as rich renderables: a summary table and one row per pool."""
    head = Table.grid(padding=(0, 2))
    c = plan.cluster
    head.add_row("model", plan.model or "-")
    head.add_row("cluster", f"{c['devices']} x {c['hardware']} ({c['devices_per_node']} per node): "
                            f"{plan.units} unit(s) of {plan.unit_devices}"
                            + (f", {plan.idle_devices} idle" if plan.idle_devices else ""))
    w, s = plan.workload, plan.slo
    head.add_row("workload", f"prompt {w['mean_prompt_tokens']:.0f}, output {w['mean_output_tokens']:.0f} tokens "
                             f"(means), asked {w['arrival_rate']:g} req/s")
    head.add_row("SLO", f"TTFT {fmt_time(s['ttft_s'])}, TPOT {fmt_time(s['tpot_s'])} at p{s['percentile'] * 100:g}")
    if plan.goodput_rps:
        head.add_row("chosen", f"{plan.kind}: {plan.deployment} per unit")
        head.add_row("goodput", f"{plan.goodput_rps:.4g} req/s ({plan.goodput_per_device:.3g} per device); at it TTFT "
                                f"{fmt_time(plan.ttft_p_s or 0)}, TPOT {fmt_time(plan.tpot_p_s or 0)}")
    else:
        head.add_row("chosen", f"none meets the SLO: {plan.reason}")
    head.add_row("compared", f"best aggregated {plan.best_aggregated_rps:.4g} req/s, best disaggregated "
                             f"{plan.best_disaggregated_rps:.4g} req/s; {len(plan.candidates)} candidates searched, "
                             f"{plan.pruned} pruned by bound"
                             + (f", {plan.dropped} of their other limits dropped" if plan.dropped else ""))
    for label, why in plan.skipped.items():
        head.add_row("", f"{label} left out: {why}")
    pins = {k: v for k, v in plan.pinned.items() if v is not None}
    head.add_row("limits", "batch and token budget " + ("chosen per pool by goodput" if not pins else
                                                        ", ".join(f"{k}={v}" for k, v in pins.items()) + " pinned"
                                                        + (", the other chosen per pool" if len(pins) < 2 else "")))
    head.add_row("planning", f"{plan.planning_s:.1f} s ({plan.steps_s:.1f} s planning serving steps with the ILP, the "
                             "rest the goodput search)")
    table = Table(title="pools (per replica; step times from ILP-planned prefill and decode steps)")
    for col in ("role", "replicas x (tp x pp)", "batch (max / slots)", "token budget", "KV per token (device)",
                "KV capacity",
                "weights/device", "prefill mean", "decode step", "KV transfer"):
        table.add_column(col)
    for p in plan.pools:
        table.add_row(p.role, f"{p.replicas} x {_shape(p)}", f"{p.max_batch} / {p.slots}", f"{p.token_budget}",
                      f"{fmt_bytes(p.kv_bytes_per_token)} ({fmt_bytes(p.kv_bytes_per_token_device)})",
                      f"{p.kv_capacity_tokens:,} tok", fmt_bytes(p.weight_bytes_device),
                      fmt_time(p.prefill_mean_s) if p.prefill_mean_s else "-",
                      fmt_time(p.decode_step_s) if p.decode_step_s else "-",
                      fmt_time(p.kv_transfer_s) if p.kv_transfer_s else "-")
    if not plan.pools:
        return Group(head)
    placements = Table(title="parameter placements over each replica's tp axis (the ILP's, in the pool's largest "
                             "planned step: R replicate, S(d) shard dim d)")
    placements.add_column("parameter")
    for p in plan.pools:
        placements.add_column(f"{p.role} ({_shape(p)})")
    for row in placement_rows(plan.pools):
        placements.add_row(*row)
    return Group(head, table, placements)
