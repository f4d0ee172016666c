"""Measure gloo collectives on this machine and fit the alpha-beta model the planner uses.

The cost model prices a collective on an n-rank axis as ``per_call + steps * alpha +
volume / beta`` (ring: all-reduce 2(n-1) steps and 2(n-1)/n M bytes; all-gather (n-1)
steps and (n-1)/n M bytes; see ``autopar.cost.collectives``). This script forks
``--world`` gloo ranks as a 2-D mesh (as the tests and ``runtime_overhead.py`` do), times, as compiled
programs run them (autopar's runtime ``Reshard`` on torch's functional collectives),
all-reduce and all-gather of several sizes on each axis of a 2-D mesh and on a flat mesh
of all ranks, and fits the fixed cost per
call, alpha (seconds per ring step) and beta (bytes per second) by least squares, twice:
on the wall time (the slowest rank's median, under whatever else runs on the machine)
and on ``ci``, each rank's CPU time (all its threads) x ranks / cores: what a collective
costs when the ranks keep the cores busy and nothing else runs, as in a training step in
CI. The ``cpu`` hardware profile's ``collective_overhead``, ``intra_node_latency`` and
``intra_node_bandwidth * network_efficiency`` should match the ``ci`` fit.

Usage: ``python benchmarks/calibrate_collectives.py [--world 4] [--iters 30] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)  # before any compute: forked children hang on an inherited OpenMP pool

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's autopar, not an installed one

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from autopar.hardware import get_profile  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402
from autopar.runtime.ops import Comm, Reshard  # noqa: E402

SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
KINDS = ("all_reduce", "all_gather")


def _placements(kind: str, dim: int, ndim: int) -> tuple[str, str]:
    """(src, dst) placements, as plans print them, of one collective on mesh dim ``dim``."""
    src = ["R"] * ndim
    src[dim] = "P" if kind == "all_reduce" else "S(0)"
    return "".join(src), "R" * ndim


def _measure(rank: int, world: int, iters: int) -> dict[str, float]:
    """Collectives as compiled programs run them: ``self.reshard(x, src, dst)`` (autopar's
    runtime ``Reshard``, on a tensor that requires grad) on torch's functional collectives.
    On both axes of a 2 x (world/2) mesh and on a flat mesh of all ranks (more ring steps)."""
    meshes = {"2d": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b")),
              "1d": init_device_mesh("cpu", (world,), mesh_dim_names=("all",))}
    out: dict[str, float] = {}
    for mesh_name, mesh in meshes.items():
        reshard = Reshard(Comm(mesh))
        for dim in range(mesh.ndim):
            n = mesh.size(dim)
            for kind in KINDS:
                src, dst = _placements(kind, dim, mesh.ndim)
                for nbytes in SIZES:
                    # M is the gathered size for all-gather: each rank contributes M / n.
                    x = torch.zeros(max(nbytes // 4 // (n if kind == "all_gather" else 1), 1), requires_grad=True)
                    for _ in range(3):
                        reshard(x, src, dst)
                    dist.barrier()
                    times, cpu = [], []
                    for _ in range(iters):
                        start, cpu_start = time.perf_counter(), time.process_time()
                        reshard(x, src, dst)
                        times.append(time.perf_counter() - start)
                        cpu.append(time.process_time() - cpu_start)
                    out[f"{kind}:{n}:{mesh_name}{dim}:{nbytes}"] = statistics.median(times)
                    out[f"cpu:{kind}:{n}:{mesh_name}{dim}:{nbytes}"] = statistics.median(cpu)
    return out


def fit(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares of t = per_call + steps * alpha + volume / beta with every term >= 0
    (a term the unconstrained fit makes negative is dropped and the rest refitted);
    returns (per_call, alpha, beta)."""
    rows = [[1.0, s, v] for s, v, _ in samples]
    t = torch.tensor([t for _, _, t in samples], dtype=torch.float64).unsqueeze(1)
    active = [0, 1, 2]
    while True:
        a = torch.tensor([[r[i] for i in active] for r in rows], dtype=torch.float64)
        solved = torch.linalg.lstsq(a, t).solution.squeeze(1).tolist()
        negative = [i for i, x in zip(active, solved) if x < 0]
        if not negative:
            break
        active.remove(negative[0])
    coef = dict(zip(active, solved))
    inv_beta = coef.get(2, 0.0)
    return coef.get(0, 0.0), coef.get(1, 0.0), 1.0 / inv_beta if inv_beta > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results = run_ranks(_measure, args.world, args.iters)
    share = max(args.world / (os.cpu_count() or 1), 1.0)
    # wall: the slowest rank's median; ci: the rank's CPU time (all its threads) x ranks / cores,
    # the mean over ranks: what the collective costs the machine when the ranks keep the cores busy.
    walls = {k: max(r[k] for r in results) for k in results[0] if not k.startswith("cpu:")}
    cis = {k: statistics.mean(r[f"cpu:{k}"] for r in results) * share for k in walls}
    samples: dict[str, list[tuple[float, float, float]]] = {"wall": [], "ci": []}
    print(f"{'collective':<12} {'axis':>5} {'ranks':>5} {'M bytes':>9} {'wall ms':>9} {'ci ms':>8}")
    for key, seconds in walls.items():
        kind, ranks, axis, nbytes = key.split(":")
        n = int(ranks)
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        volume = (2 if kind == "all_reduce" else 1) * (n - 1) / n * int(nbytes)
        samples["wall"].append((steps, volume, seconds))
        samples["ci"].append((steps, volume, cis[key]))
        print(f"{kind:<12} {axis:>5} {n:>5} {int(nbytes):>9} {seconds * 1e3:>9.3f} {cis[key] * 1e3:>8.3f}")
    cpu = get_profile("cpu")
    profile_beta = cpu.intra_node_bandwidth * cpu.network_efficiency
    fits = {}
    for name, points in samples.items():
        per_call, alpha, beta = fit(points)
        fits[name] = {"per_call_s": per_call, "alpha_s": alpha, "beta_bytes_per_s": beta}
        print(f"fit ({name}): {per_call * 1e6:.0f} us per call + {alpha * 1e6:.0f} us per ring step, "
              f"beta {beta / 1e9:.2f} GB/s")
    print(f"cpu profile: {cpu.collective_overhead * 1e6:.0f} us per call + {cpu.intra_node_latency * 1e6:.0f} us "
          f"per ring step, {profile_beta / 1e9:.2f} GB/s; 1-min load average {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "seconds": walls, "ci_seconds": cis, "fits": fits,
                       "loadavg": os.getloadavg()[0]}, f, indent=1)


if __name__ == "__main__":
    main()
