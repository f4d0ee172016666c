"""The plan as a table a person can read in a terminal (rich), grouped by layer."""

from __future__ import annotations

import io
from collections import Counter, defaultdict
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from autopar.problem.block_paths import block_of
from autopar.result.record import PlanRecord
from autopar.units import fmt_bytes, fmt_time


def layer_of(module: str) -> str:
    """'layers.3.attention.wq' -> 'layers.3'; 'lm_head' -> 'lm_head'; '' -> '(top)'."""
    return block_of(module) or (module.split(".")[0] if module else "(top)")


def _rows(plan: PlanRecord) -> list[tuple[str, str, str]]:
    params: dict[str, list[str]] = defaultdict(list)
    for fqn, placement in plan.parameters.items():
        module = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        layer = layer_of(module)
        local = fqn[len(layer) + 1:] if fqn.startswith(layer + ".") else fqn
        params[layer].append(f"{local} {placement}")
    comms: dict[str, Counter] = defaultdict(Counter)
    for c in plan.collectives:
        phase = "fwd" if c.phase == "forward" else "bwd"
        comms[layer_of(c.module)][(phase, c.kind, c.axis, c.bytes, "~" if c.data_dependent else "")] += c.count
    order: list[str] = []
    for n in plan.nodes:
        layer = layer_of(n.module)
        if layer not in order and (layer in params or layer in comms):
            order.append(layer)
    for layer in list(params) + list(comms):
        if layer not in order:
            order.append(layer)
    rows = []
    for layer in order:
        p = "\n".join(params.get(layer, [])) or "-"
        c = "\n".join(f"{ph} {kind} @{axis} {approx}{fmt_bytes(b)}" + (f" x{k}" if k > 1 else "")  # ~: expected
                      for (ph, kind, axis, b, approx), k in sorted(comms.get(layer, Counter()).items())) or "-"
        rows.append((layer, p, c))
    return _merge_repeats(rows)


def _merge_repeats(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Consecutive identical layers of one container print once: 'layers.0-31'."""
    merged: list[tuple[str, str, str]] = []
    run_start = None
    for layer, p, c in rows:
        if merged:
            prev_layer, prev_p, prev_c = merged[-1]
            base, _, idx = layer.rpartition(".")
            pbase, _, pidx = prev_layer.rpartition(".")
            first = pidx.split("-")[0]
            if idx.isdigit() and pbase == base and (p, c) == (prev_p, prev_c) and first.isdigit():
                run_start = first
                merged[-1] = (f"{base}.{run_start}-{idx}", p, c)
                continue
        merged.append((layer, p, c))
    return merged


def search_note(counts: dict[str, int]) -> str:
    """How the memory search went: what it solved, skipped and bounded out."""
    return (f"{counts.get('scenarios', 0)} scenarios: {counts.get('solved', 0)} solved under the limit, "
            f"{counts.get('not_fitting', 0)} whose leanest plan does not fit, {counts.get('bounded_out', 0)} "
            f"bounded out; {counts.get('free_solves', 0)} free solves for bounds")


def solver_note(solver: dict[str, Any]) -> str:
    """What a plan that is not proven optimal must say about itself."""
    if solver.get("status") == "time_limit":
        gap = solver.get("gap")
        within = f"within {gap:.2%} of the best bound" if gap is not None and gap < float("inf") else "no bound"
        return (f"NOT PROVEN OPTIMAL: HiGHS stopped at its time limit of {solver.get('time_limit_s', 0):g} s "
                f"with this plan ({within})")
    return f"HiGHS status {solver.get('status')}"


def render(plan: PlanRecord) -> Group:
    pred = plan.predicted
    mesh = plan.mesh
    summary = Table(title="autopar plan", show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("mesh", " x ".join(f"{k}={v}" for k, v in mesh["axes"].items())
                    + f"  ({mesh['hardware']}, {mesh['devices_per_node']} per node"
                    + "".join(f", {a} zig-zag" for a in mesh.get("zigzag", ())) + ")")
    summary.add_row("step", ("training" if plan.train else "forward only") + f", {plan.precision}")
    hidden = f" exposed, {fmt_time(pred.hidden_comm_time_s)} hidden behind compute" if pred.hidden_comm_time_s else ""
    if plan.pipeline is not None:  # the figures in brackets are the whole step's on one stage mesh
        pipe = plan.pipeline
        summary.add_row("step time", f"{fmt_time(pred.step_time_s)}  (pipelined: bubble {fmt_time(pipe.bubble_s)}, "
                        f"point-to-point {fmt_time(pipe.p2p_s)}, gradient sync {fmt_time(pipe.grad_sync_s)}; the "
                        f"whole step on one stage mesh: compute {fmt_time(pred.compute_time_s)}, communication "
                        f"{fmt_time(pred.comm_time_s)}{hidden})")
    else:
        summary.add_row("step time", f"{fmt_time(pred.step_time_s)}  (compute {fmt_time(pred.compute_time_s)}, "
                        f"communication {fmt_time(pred.comm_time_s)}{hidden})")
    limit = f", limit {fmt_bytes(plan.memory_limit_bytes)}" if plan.memory_limit_bytes is not None else ""
    whose = "the busiest pp rank's: its stages' state" if plan.pipeline is not None else "parameters+state"
    activations = "activations in flight" if plan.pipeline is not None else "activations"
    summary.add_row("peak memory", f"{fmt_bytes(pred.peak_memory_bytes)} per device  ({whose} "
                    f"{fmt_bytes(pred.parameter_memory_bytes)}, {activations} "
                    f"{fmt_bytes(pred.activation_memory_bytes)}{limit})")
    if plan.train and plan.memory.describe() != "1 micro-batch":
        summary.add_row("memory plan", plan.memory.describe())
    if plan.pipeline is not None:
        summary.add_row("pipeline", f"{plan.pipeline.axis}={plan.pipeline.size} x stage mesh "
                        + " x ".join(f"{k}={v}" for k, v in plan.pipeline.stage_mesh.items())
                        + f": {plan.pipeline.describe()}")
    if "memory_search" in plan.solver:
        summary.add_row("memory search", search_note(plan.solver["memory_search"]))
    summary.add_row("communication", ", ".join(f"{a}: {fmt_bytes(b)}" for a, b in pred.comm_bytes.items())
                    + " per device per step")
    if plan.pinned:
        summary.add_row("pinned", ", ".join(f"{k}: {v}" for k, v in plan.pinned.items()))
    summary.add_row("fallbacks", "replicated: " + ", ".join(map(str, plan.fallbacks)) if plan.fallbacks else "none")
    if plan.solver.get("status", "optimal") != "optimal":
        summary.add_row("solver", solver_note(plan.solver))
    if plan.notes:
        summary.add_row("notes", "\n".join(plan.notes))
    layers = Table(title="placements by layer (one placement per mesh axis: R replicate, S(d) shard dim d, "
                   "S(d/k) strided: each of k blocks of dim d sharded, P partial sum)", show_lines=True)
    layers.add_column("layer", style="cyan", no_wrap=True)
    layers.add_column("parameters")
    layers.add_column("collectives (phase kind @axis size)")
    for layer, p, c in _rows(plan):
        layers.add_row(layer, p, c)
    return Group(summary, layers)


def render_account(plan: PlanRecord) -> Table:
    """What the search tried, what came of each and why (``Plan.account``), as a table."""
    table = Table(title="search account", title_justify="left", show_lines=False)
    for column, justify in (("level", "left"), ("tried", "left"), ("outcome", "left"), ("seconds", "right"),
                            ("why / figures", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in plan.account:
        seconds = "" if row.seconds is None else fmt_time(row.seconds)
        table.add_row(row.level, row.item, row.outcome, seconds, row.detail)
    return table


def render_text(plan: PlanRecord, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(render(plan))
    return console.file.getvalue()  # type: ignore[attr-defined]
