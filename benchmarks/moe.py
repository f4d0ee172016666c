"""Expert parallelism: autopar's plan of a mixture of experts against an EP x TP x DP grid of hand plans.

For each shape (``examples/moe.py``'s Mixtral-style decoder on the meta device; nothing runs), every
point of a grid is priced by autopar's own functions, every parallel choice pinned (no hand formula):

- EP (``ep`` in ``Shape.eps``): experts pinned ``Shard(0)`` on an ``ep`` mesh axis, which is also a
  data axis (the batch split on it, dense weights replicated: torchtitan's dp2ep), tokens reaching
  their experts by the all-to-all the planner prices; ep = 1: no ep axis, experts replicated.
- TP (``tp`` in ``Shape.tps``, inside a node): attention (and the shared expert) pinned to Megatron's
  column / row split on a ``tp`` axis (``constraints=``, the TP plan below); the routed experts pinned
  to expert tensor parallelism, Megatron's default ETP = TP (``w1``/``w3`` split on their ffn dim,
  ``w2`` on its ffn dim: ``Shard(2)``, ``Shard(1)``). The embedding, output layer and router are left
  to the planner on tp, as ``benchmarks/grid_pricing.py`` leaves what its TP plan does not name.
- DP = devices / (ep tp), parameters replicated (``zero={"dp": 0}``; on ep the data axis pins the dense
  weights replicated, ZeRO-0 there would pin the experts replicated too, so ``zero`` names dp only, or
  nothing: ``{}`` still pins "no ZeRO"), no activation checkpointing, one micro-batch: one memory
  scenario, so nothing re-captures the step.

The expert pins cannot be said with ``plan``'s options (``constraints=`` is one axis' nn.Linear
styles; ``expert_axes`` leaves experts free, not split), so a grid point is planned as ``plan``
plans (``api.planning.prepare``, ``search.ilp.solve``, ``search.planned.finish``) with ``apply_pins`` on the prepared graph in
between: the same pin mechanism ``constraints=`` and ``zero=`` use, applied to the expert weights of
every block alike (the folding of repeated blocks stays valid). Each point is solved without a
memory limit (as grid_pricing does, so no memory search changes the pinned configuration) and
skipped if its predicted peak is over the limit (the hardware's default: 80 GiB less the allocator margin).

autopar's plan: for each ep in ``Shape.eps``, mesh ``{"dp": devices // (ep 8), "ep": ep, "tp": 8}`` with
``data_axes=("dp", "ep")``, ``expert_axes=("ep",)``, nothing else pinned (the ILP decides what the tp
axis does and where experts go; memory choices searched under the limit); the fastest kept, as
hand_plan_grid keeps the fastest over pp degrees. Ratio best grid / autopar >= 1: autopar no slower.

Dispatch: the capacity path (GShard / Switch one-hot einsum, ``capacity_factor=1.25``), so the expert
FLOPs are the routed ones times 1.25 (the dropless path of the example gives every expert ``seq`` slots
per sequence, ``experts / top_k`` times the routed FLOPs). Its one-hot dispatch / combine tensors are
``(batch, top_k, seq, experts, capacity)``, ``capacity_factor top_k^2 seq^2`` elements per sequence,
priced as they are (an einsum's FLOPs and bytes), the same in every plan.

Shapes (reductions said here, and why):
- Mixtral-8x7B-like: hidden 4096, 32 / 8 heads, 8 experts top-2, expert ffn 14336, vocab 32000, seq
  4096, global batch 64 sequences, on 64 H100s; 4 layers, not 32: planning 32 layers at batch 256
  ran past 10 minutes on this machine (its memory search; the plan of each block is folded, so
  per-block choices do not depend on depth, but memory pressure does: the state of 4 layers is 1/8
  of the full model's, so memory choices are less exercised than at full depth).
- DeepSeek-V3-like: hidden 7168, 56 / 8 heads (GQA in place of MLA), 256 experts top-8, expert ffn
  2048, one shared expert of ffn 2048, vocab 129280, on 256 H100s; seq 1024 (not 4096: the one-hot
  dispatch grows with seq^2 top_k^2), 2 layers (not 61), global batch 256 sequences.

Measured (2026-12-01, 2 cores): Mixtral-like best grid / autopar 1.247; DeepSeek-V3-like best grid
ep32 tp8 dp1 0.152 s / autopar ``{"ep": 32, "tp": 8}`` 0.147 s = 1.035 (experts split by expert on ep and
on their ffn dim inside on tp), the shape's grid and autopar's 6 meshes in 388 s.

Usage: ``python benchmarks/moe.py [--quick] [--json out.json]`` (``--quick``: Mixtral only, ep in
{1, 8}, tp in {1, 8}). Progress on stderr, tables on stdout, JSON to benchmarks/results/moe.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` and ``benchmarks`` importable when run as a script

import autopar  # noqa: E402
from autopar.api.planning import prepare  # noqa: E402
from autopar.errors import InputError  # noqa: E402
from autopar.hardware import get_profile  # noqa: E402
from autopar.rules.strategy import parse_placements  # noqa: E402
from autopar.search.ilp import solve  # noqa: E402
from autopar.search.problem import scenarios  # noqa: E402
from autopar.solver.ilp import Solution  # noqa: E402
from autopar.problem.constraints import Pin, apply_pins, expert_parameters
from autopar.search.planned import finish  # noqa: E402
from examples import moe  # noqa: E402

GiB = 2**30
NODE = 8
"""Devices per node: tensor parallelism (and autopar's free tp axis) stays inside one."""
DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "moe.json"


@dataclass(frozen=True, kw_only=True)
class Shape:
    name: str
    config: moe.MoEConfig
    devices: int
    batch: int
    """Global batch, sequences."""
    eps: tuple[int, ...]
    """Expert-parallel degrees of the grid (and of autopar's meshes)."""
    tps: tuple[int, ...] = (1, 2, 4, 8)
    """Tensor-parallel degrees of the grid."""
    hardware: str = "h100"
    memory_limit: float | None = None
    """Bytes per device; None: the hardware's default."""

    @property
    def limit(self) -> float:
        return self.memory_limit or get_profile(self.hardware).memory_limit()


MIXTRAL = Shape(name="Mixtral-8x7B-like (4 layers)", devices=64, batch=64, eps=(1, 2, 4, 8), config=moe.from_hf_config(
    "mixtral-8x7b", max_seq_len=4096, layers=4, capacity_factor=1.25))
DEEPSEEK = Shape(name="DeepSeek-V3-like (2 layers, seq 1024)", devices=256, batch=256, eps=(1, 2, 4, 8, 16, 32),
                 config=moe.MoEConfig(vocab_size=129280, max_seq_len=1024, hidden=7168, heads=56, kv_heads=8,
                                      ffn_hidden=2048, layers=2, experts=256, top_k=8, capacity_factor=1.25,
                                      shared_expert=True))


def tp_plan(shape: Shape) -> dict[str, object]:
    """Megatron's TP of the dense weights: attention (and the shared expert) column then row parallel."""
    plan: dict[str, object] = {f"layers.*.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan["layers.*.attention.wo"] = RowwiseParallel()
    if shape.config.shared_expert:
        plan.update({"layers.*.moe.shared.w1": ColwiseParallel(), "layers.*.moe.shared.w3": ColwiseParallel(),
                     "layers.*.moe.shared.w2": RowwiseParallel()})
    return plan


@dataclass(frozen=True, kw_only=True)
class Priced:
    """One grid point as autopar's cost model prices it."""

    ep: int
    tp: int
    dp: int
    step_s: float
    peak_gib: float
    fits: bool
    experts: str
    """Expert weight placements per mesh axis, as planned (``plan.nodes``)."""
    seconds: float
    """Wall seconds planning the point."""


@dataclass(kw_only=True)
class AutoparResult:
    mesh: dict[str, int] | None = None
    step_s: float | None = None
    peak_gib: float = 0.0
    memory: str = ""
    experts: str = ""
    chosen_seconds: float = 0.0
    """Wall seconds of the chosen mesh's ``autopar.plan``."""
    seconds: float = 0.0
    """Wall seconds over every mesh tried."""
    tried: list[str] = field(default_factory=list)


def build(shape: Shape) -> tuple[nn.Module, tuple[torch.Tensor, ...], Any, tuple[torch.Tensor, ...]]:
    return moe.build(shape.config, batch=shape.batch, device="meta")


def mesh_axes(dp: int, ep: int, tp: int) -> dict[str, int]:
    """``{"dp", "ep", "tp"}`` (tp innermost, inside a node), axes of size 1 left out (a lone one kept)."""
    axes = {name: size for name, size in (("dp", dp), ("ep", ep), ("tp", tp)) if size > 1}
    return axes or {"dp": 1}


def data_axes(axes: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in ("dp", "ep") if a in axes)


def expert_summary(plan: autopar.Plan, mesh: autopar.Mesh) -> str:
    """The placements of the stacked expert weights (``plan.nodes``' parameters), per mesh axis."""
    seen: dict[str, set[str]] = {}
    for node in plan.nodes:
        if node.op != "parameter" or "_experts_w" not in node.name:
            continue
        weight = node.name.rsplit("_", 1)[-1]  # w1, w2, w3
        placements = parse_placements(node.outputs[0])
        seen.setdefault(weight, set()).add(" ".join(f"{a}:{p}" for a, p in zip(mesh.names, placements)))
    return "; ".join(f"{w} {' | '.join(sorted(p))}" for w, p in sorted(seen.items()))


def expert_pins(graph: Any, experts: frozenset[str], tensor_parallel: bool) -> dict[str, Pin]:
    """Per expert weight: ``Shard(0)`` (by expert) for the ep axis, or the ffn-dim split of expert
    tensor parallelism for the tp axis (w1, w3: ``(E, H, F)`` -> dim 2; w2: ``(E, F, H)`` -> dim 1)."""
    pins = {}
    for name in experts:
        ffn_dim = 1 if graph.nodes[name].fqn.endswith("w2") else 2
        placement: Placement = Shard(ffn_dim) if tensor_parallel else Shard(0)
        reason = "grid: expert tensor parallelism" if tensor_parallel else "grid: experts split by expert"
        pins[name] = Pin(output=placement, reason=reason)
    return pins


def price_point(shape: Shape, built: tuple[Any, ...], ep: int, tp: int) -> Priced:
    """One grid point pinned (module docstring) and planned as ``autopar.plan`` plans."""
    model, inputs, loss_fn, targets = built
    dp = shape.devices // (ep * tp)
    axes = mesh_axes(dp, ep, tp)
    mesh = autopar.Mesh(axes, hardware=shape.hardware)
    started = time.perf_counter()
    prepared = prepare(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, data_axes=data_axes(axes),
                       expert_axes=("ep",) if ep > 1 else (), constraints=tp_plan(shape) if tp > 1 else None,
                       zero={"dp": 0} if "dp" in axes else {}, checkpoint="none",
                       micro_batches=1, offload=False, memory_limit=math.inf)
    assert len(scenarios(prepared)) == 1, "every memory choice is pinned: one scenario, no re-capture"
    experts = expert_parameters(prepared.graph)
    for axis_name, tensor_parallel in (("ep", False), ("tp", True)):
        if axis_name in axes:
            axis = mesh.names.index(axis_name)
            for graph in {id(g): g for g in (prepared.graph, prepared.base_graph) if g is not None}.values():
                apply_pins(graph, expert_pins(graph, experts, tensor_parallel), axis, axis_name, axes[axis_name])
    solution = solve(prepared, prepared.memory_limit)
    assert isinstance(solution, Solution), solution
    plan = finish(prepared, solution).plan
    peak = plan.predicted.peak_memory_bytes
    return Priced(ep=ep, tp=tp, dp=dp, step_s=plan.predicted.step_time_s, peak_gib=peak / GiB,
                  fits=peak <= shape.limit, experts=expert_summary(plan, mesh), seconds=time.perf_counter() - started)


def price_grid(shape: Shape, built: tuple[Any, ...], eps: tuple[int, ...], tps: tuple[int, ...]) -> list[Priced]:
    """Every (ep, tp) whose ranks divide the devices and whose dp x ep divides the batch."""
    out = []
    for ep in eps:
        for tp in tps:
            if shape.devices % (ep * tp) or shape.batch % (shape.devices // tp):
                continue
            point = price_point(shape, built, ep, tp)
            print(f"  {shape.name} grid ep{ep} tp{tp} dp{point.dp}: {point.step_s:.3f} s, {point.peak_gib:.1f} GiB "
                  f"({point.seconds:.1f} s)", file=sys.stderr, flush=True)
            out.append(point)
    return out


def autopar_plan(shape: Shape, built: tuple[Any, ...], eps: tuple[int, ...]) -> AutoparResult:
    """autopar's plan on each ``{"dp", "ep", "tp": 8}`` mesh (module docstring; tp the devices beside ep on a
    cluster smaller than ep nodes), the fastest kept."""
    model, inputs, loss_fn, targets = built
    result = AutoparResult()
    began = time.perf_counter()
    for ep in eps:
        tp = min(NODE, shape.devices // ep)  # a node's worth of tp, or what is left beside ep on a smaller cluster
        axes = mesh_axes(shape.devices // (ep * tp), ep, tp)
        mesh = autopar.Mesh(axes, hardware=shape.hardware)
        started = time.perf_counter()
        try:
            plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                                data_axes=data_axes(axes), expert_axes=("ep",) if ep > 1 else (),
                                memory_limit=shape.memory_limit, pipeline=False)
        except InputError as exc:  # MemoryLimitError included: no plan on this mesh
            result.tried.append(f"{axes}: no plan: {str(exc)[:300]}")
            continue
        seconds, step_s = time.perf_counter() - started, plan.predicted.step_time_s
        experts = expert_summary(plan, mesh)
        result.tried.append(f"{axes}: {step_s:.3f} s, {plan.memory.describe()}, experts {experts} ({seconds:.1f} s)")
        print(f"  autopar {shape.name} {result.tried[-1]}", file=sys.stderr, flush=True)
        if result.step_s is None or step_s < result.step_s:
            result.mesh, result.step_s, result.memory, result.experts = axes, step_s, plan.memory.describe(), experts
            result.peak_gib, result.chosen_seconds = plan.predicted.peak_memory_bytes / GiB, seconds
    result.seconds = time.perf_counter() - began
    return result


def report(shape: Shape, grid: list[Priced], auto: AutoparResult) -> float | None:
    """Print the grid and autopar's plan; the ratio best grid / autopar (None: either has no plan)."""
    print(f"\n== {shape.name} on {shape.devices} {shape.hardware.upper()}s, batch {shape.batch} x seq "
          f"{shape.config.max_seq_len}, memory limit {shape.limit / GiB:.1f} GiB ==")
    print(f"{'ep':>3} {'tp':>3} {'dp':>4} {'step s':>8} {'peak GiB':>9} {'fits':>5} {'plan s':>7}  experts (as planned)")
    for p in sorted(grid, key=lambda q: q.step_s):
        print(f"{p.ep:>3} {p.tp:>3} {p.dp:>4} {p.step_s:8.3f} {p.peak_gib:9.1f} {'yes' if p.fits else 'NO':>5} "
              f"{p.seconds:7.1f}  {p.experts}")
    fitting = [p for p in grid if p.fits]
    best = min(fitting, key=lambda q: q.step_s, default=None)
    print(f"\nautopar ({auto.seconds:.0f} s over {len(auto.tried)} meshes; chosen mesh's plan {auto.chosen_seconds:.1f} s):")
    for line in auto.tried:
        print(f"  {line}")
    if best is None or auto.step_s is None:
        print("no ratio: " + ("no grid point fits" if best is None else "autopar found no plan"))
        return None
    ratio = best.step_s / auto.step_s
    print(f"chosen: {auto.mesh}, {auto.step_s:.3f} s, {auto.peak_gib:.1f} GiB, {auto.memory}; experts {auto.experts}")
    print(f"best grid ep{best.ep} tp{best.tp} dp{best.dp} {best.step_s:.3f} s / autopar {auto.step_s:.3f} s = "
          f"{ratio:.3f} ({'autopar no slower' if ratio >= 1 else 'FINDING: AUTOPAR SLOWER than the best grid plan'})")
    return ratio


def run_shape(shape: Shape, eps: tuple[int, ...], tps: tuple[int, ...]) -> dict[str, object]:
    built = build(shape)
    grid = price_grid(shape, built, eps, tps)
    auto = autopar_plan(shape, built, eps)
    ratio = report(shape, grid, auto)
    return {"shape": shape.name, "config": asdict(shape.config), "devices": shape.devices, "batch": shape.batch,
            "memory_limit_gib": shape.limit / GiB, "grid": [asdict(p) for p in sorted(grid, key=lambda q: q.step_s)],
            "autopar": asdict(auto), "ratio_best_grid_over_autopar": ratio,
            "autopar_no_slower": None if ratio is None else ratio >= 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Mixtral only, ep in {1, 8}, tp in {1, 8}")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    runs = [(MIXTRAL, (1, 8), (1, 8))] if args.quick else [(s, s.eps, s.tps) for s in (MIXTRAL, DEEPSEEK)]
    rows = [run_shape(shape, eps, tps) for shape, eps, tps in runs]
    elapsed = time.perf_counter() - began
    print(f"\nwall time {elapsed:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"quick": args.quick, "seconds": elapsed, "shapes": rows}, indent=1))
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
