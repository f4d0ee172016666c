"""Measure gloo collectives on this machine and fit the alpha-beta model the planner uses.

The cost model prices a collective on an n-rank axis as ``steps * alpha + volume / beta``
(ring: all-reduce 2(n-1) steps and 2(n-1)/n M bytes; all-gather (n-1) steps and
(n-1)/n M bytes; see ``autopar.cost.collectives``). This script forks ``--world`` gloo
ranks as a 2-D mesh (as the tests and ``runtime_overhead.py`` do), times all-reduce and
all-gather of several sizes on each mesh axis, and fits alpha (seconds per ring step)
and beta (bytes per second) by least squares. The ``cpu`` hardware profile's
``intra_node_latency`` and ``intra_node_bandwidth * network_efficiency`` should match the
fit for the setting the plans run in (here: 4 ranks sharing the cores, as in CI).

Usage: ``python benchmarks/calibrate_collectives.py [--world 4] [--iters 30] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

torch.set_num_threads(1)  # before any compute: forked children hang on an inherited OpenMP pool

import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as fc  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from autopar.hardware import get_profile  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402

SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
KINDS = ("all_reduce", "all_gather")


def _measure(rank: int, world: int, iters: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    out: dict[str, float] = {}
    for dim in range(2):
        for kind in KINDS:
            for nbytes in SIZES:
                n = mesh.size(dim)
                # M is the gathered size for all-gather: each rank contributes M / n.
                numel = max(nbytes // 4 // (n if kind == "all_gather" else 1), 1)
                x = torch.zeros(numel)
                run = (lambda: fc.all_reduce(x, "sum", (mesh, dim))) if kind == "all_reduce" else \
                      (lambda: fc.all_gather_single(x, 0, (mesh, dim)))
                for _ in range(3):
                    fc.wait_tensor(run())
                dist.barrier()
                times = []
                for _ in range(iters):
                    start = time.perf_counter()
                    fc.wait_tensor(run())
                    times.append(time.perf_counter() - start)
                out[f"{kind}:{dim}:{nbytes}"] = statistics.median(times)
    return out


def fit(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of t = steps * alpha + volume * inv_beta; returns (alpha, beta)."""
    a = torch.tensor([[s, v] for s, v, _ in samples], dtype=torch.float64)
    t = torch.tensor([t for _, _, t in samples], dtype=torch.float64)
    alpha, inv_beta = torch.linalg.lstsq(a, t.unsqueeze(1)).solution.squeeze(1).tolist()
    return alpha, 1.0 / inv_beta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    results = run_ranks(_measure, args.world, args.iters)
    slowest = {k: max(r[k] for r in results) for k in results[0]}
    samples = []
    print(f"{'collective':<12} {'axis':>4} {'M bytes':>9} {'ms (slowest rank median)':>25}")
    for key, seconds in slowest.items():
        kind, dim, nbytes = key.split(":")
        n = 2 if dim == "0" else args.world // 2
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        volume = (2 if kind == "all_reduce" else 1) * (n - 1) / n * int(nbytes)
        samples.append((steps, volume, seconds))
        print(f"{kind:<12} {dim:>4} {int(nbytes):>9} {seconds * 1e3:>25.3f}")
    alpha, beta = fit(samples)
    cpu = get_profile("cpu")
    profile_beta = cpu.intra_node_bandwidth * cpu.network_efficiency
    print(f"fit: alpha {alpha * 1e6:.0f} us per ring step, beta {beta / 1e9:.2f} GB/s "
          f"(cpu profile: {cpu.intra_node_latency * 1e6:.0f} us, {profile_beta / 1e9:.2f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "seconds": slowest, "alpha_s": alpha, "beta_bytes_per_s": beta}, f,
                      indent=1)


if __name__ == "__main__":
    main()
