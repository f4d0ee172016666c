"""Goodput of the serving deployments of a cluster, by simulation with roofline step times.

Prices every candidate deployment of ``autopar.serving.candidate_deployments`` (aggregated at
each TP degree; disaggregated at each prefill/decode split and TP pair) for a Llama-style model,
searches each one's goodput under the SLO, and prints them best goodput per device first.
Step times are ``RooflineStepTimes``' analytic stand-in, not yet the ILP's priced plan.

Usage: ``python benchmarks/serving_goodput.py [--devices 8] [--hardware h100] [--prompt 512:2048]
[--output 64:256] [--ttft 0.4] [--tpot 0.04] [--percentile 0.9] [--only NAME ...]``
(lengths: ``N`` fixed, ``LO:HI`` uniform, ``lognormal:MEDIAN:SIGMA``).
"""

from __future__ import annotations

import argparse
import time

from autopar.errors import InputError
from autopar.serving import (LLAMA3_8B, SLO, Cluster, Fixed, LogNormal, Uniform, Workload, best_deployment,
                             candidate_deployments)
from autopar.serving.workload import TokenDistribution


def parse_lengths(spec: str) -> TokenDistribution:
    """``N``, ``LO:HI`` or ``lognormal:MEDIAN:SIGMA``."""
    parts = spec.split(":")
    try:
        if len(parts) == 1:
            return Fixed(value=int(parts[0]))
        if len(parts) == 2:
            return Uniform(low=int(parts[0]), high=int(parts[1]))
        if len(parts) == 3 and parts[0] == "lognormal":
            return LogNormal(median=float(parts[1]), sigma=float(parts[2]))
    except ValueError:
        pass
    raise InputError(f"bad length spec {spec!r}: expected N, LO:HI or lognormal:MEDIAN:SIGMA")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--prompt", default="512:2048")
    parser.add_argument("--output", default="64:256")
    parser.add_argument("--rate", type=float, default=10.0, help="starting rate of the goodput search, req/s")
    parser.add_argument("--ttft", type=float, default=0.4)
    parser.add_argument("--tpot", type=float, default=0.04)
    parser.add_argument("--percentile", type=float, default=0.9)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--only", nargs="*", default=None, help="deployment names to search (default: all)")
    args = parser.parse_args()
    cluster = Cluster(devices=args.devices, hardware=args.hardware, devices_per_node=args.devices_per_node)
    workload = Workload(prompt_tokens=parse_lengths(args.prompt), output_tokens=parse_lengths(args.output),
                        arrival_rate=args.rate)
    slo = SLO(ttft_s=args.ttft, tpot_s=args.tpot, percentile=args.percentile)
    candidates = candidate_deployments(cluster, LLAMA3_8B, max_batch=args.max_batch, token_budget=args.token_budget)
    if args.only:
        candidates = [d for d in candidates if d.name in set(args.only)]
    start = time.perf_counter()
    ranked = best_deployment(candidates, workload, slo)
    print(f"Llama-3-8B on {args.devices} x {args.hardware}; prompt {args.prompt}, output {args.output}; "
          f"SLO TTFT {args.ttft}s TPOT {args.tpot}s at p{args.percentile * 100:g}; "
          f"{len(ranked)} deployments in {time.perf_counter() - start:.1f} s")
    print(f"{'deployment':34} {'goodput':>9} {'/device':>8} {'TTFT p90':>9} {'TPOT p90':>9} {'attain':>7} runs")
    for r in ranked:
        rep = r.report
        cells = (f"{rep.ttft_s[90] * 1e3:7.0f}ms {rep.tpot_s[90] * 1e3:7.1f}ms {rep.attainment:7.3f}" if rep
                 else f"{'-':>9} {'-':>9} {'-':>7}")
        print(f"{r.deployment.name:34} {r.goodput_rps:9.1f} {r.goodput_per_device:8.2f} {cells} {r.simulations}")


if __name__ == "__main__":
    main()
