"""Serving plans of Llama-3-8B and 70B on 8-64 H100s at a loose and a tight SLO (``autopar.plan_serving``).

For each (model, cluster, SLO): the deployment chosen, its pools' batching limits (max batch / token budget,
chosen per pool by the planner), its goodput (requests/s meeting the SLO at p90), the best aggregated and the
best disaggregated goodput and their ratio, and the seconds ``plan_serving`` took on this machine (planning the
serving steps with the ILP, then the goodput search).
The models are built on the meta device (``examples/llama.py:build_8b_serving``/``build_70b_serving``) at the
shapes of the published ``config.json`` files in ``examples/configs/`` (``llama-3-8b.json``, ``llama-3-70b.json``):
nothing is allocated. Workload: prompts uniform in [512, 2048], outputs in [64, 256], Poisson arrivals.

Public measured figures of vLLM or SGLang for the same model, hardware and workload: none found, and the
table says so per row (``PUBLIC``). The nearest public measurements differ in what they measure: the vLLM
v0.6.0 release blog (blog.vllm.ai, 2024-09-05: Llama 3 8B on 1 H100, 70B on 4 H100, ShareGPT and fixed-length
datasets) reports throughput at an unbounded request rate and its gains as ratios ("2.7x higher throughput and
5x faster TPOT" on 8B, "1.8x" and "2x" on 70B), not goodput under TTFT/TPOT targets; Lambda's vllm-benchmark
(github.com/LambdaLabsML/vllm-benchmark, Llama 3.1 on 1-8 H100) sweeps concurrency without SLOs; DistServe
(OSDI'24), the goodput measure used here, evaluates OPT-13B/66B/175B, not Llama 3. A comparison needs vLLM or
SGLang run on this workload (``vllm bench serve --dataset-name random`` with these length ranges and
``--request-rate``), scored by the same SLO attainment.

The anchors this compares with, DistServe (Zhong et al., OSDI 2024): disaggregating prefill and decode
(with per-phase parallelism and placement) serves "up to 7.4x more requests or 12.6x tighter SLO" than
colocated state-of-the-art systems (vLLM) within latency constraints for over 90% of requests. Their
largest gains come under tight TPOT targets with long prompts, where a colocated engine's prefills stall
its decodes; with chunked prefill (Sarathi-Serve) in the aggregated baseline, as here, the gap narrows.

The cluster is cut into one-node units (``plan_serving``'s docstring): goodput per device is the same at
8, 16 and 64 devices by construction, and the second and later calls reuse the planned steps of the
first (planning time then is the goodput search alone).

Usage: ``python benchmarks/serving.py [--quick] [--json out.json]`` (``--quick``: 8B only, 8 and 64 devices).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` importable when run as a script

import autopar  # noqa: E402
from autopar.serving import Uniform  # noqa: E402
from examples.llama import build_8b_serving, build_70b_serving  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "serving.json"
MODELS = {"llama3-8b": build_8b_serving, "llama3-70b": build_70b_serving}
SLOS = {"llama3-8b": {"loose": autopar.SLO(ttft_s=1.0, tpot_s=0.1), "tight": autopar.SLO(ttft_s=0.4, tpot_s=0.015)},
        "llama3-70b": {"loose": autopar.SLO(ttft_s=1.0, tpot_s=0.1), "tight": autopar.SLO(ttft_s=0.4, tpot_s=0.04)}}
"""Per model (a 70B decode step is ~3x an 8B one): loose leaves room to batch; tight binds TPOT."""
DEVICES = (8, 16, 64)
PUBLIC: dict[tuple[str, int], str] = {}
"""(model, devices) -> a public vLLM/SGLang goodput at this workload and SLOs, with its source: none known
(module docstring)."""


def run(quick: bool) -> list[dict]:
    workload = autopar.Workload(prompt_tokens=Uniform(low=512, high=2048), output_tokens=Uniform(low=64, high=256),
                                arrival_rate=10)
    rows = []
    for name, build in MODELS.items():
        if quick and name != "llama3-8b":
            continue
        model = build()
        for devices in ((8, 64) if quick else DEVICES):
            for slo_name, slo in SLOS[name].items():
                start = time.perf_counter()
                plan = autopar.plan_serving(model, autopar.Cluster(devices=devices, hardware="h100"), workload, slo)
                seconds = time.perf_counter() - start
                agg, dis = plan.best_aggregated_rps, plan.best_disaggregated_rps
                rows.append({"model": name, "devices": devices, "slo": slo_name, "ttft_s": slo.ttft_s,
                             "tpot_s": slo.tpot_s, "chosen": plan.deployment if plan.goodput_rps else "none",
                             "pools": [f"{p.role} {p.replicas}x tp={p.tp}" + (f" pp={p.pp}" if p.pp > 1 else "")
                                       for p in plan.pools],
                             "limits": "+".join(f"{p.max_batch}/{p.token_budget}" for p in plan.pools) or "-",
                             "goodput_rps": plan.goodput_rps, "per_device": plan.goodput_per_device,
                             "best_aggregated_rps": agg, "best_disaggregated_rps": dis,
                             "disagg_over_agg": dis / agg if agg else None, "plan_serving_s": seconds,
                             "steps_s": plan.steps_s,
                             "candidates": len(plan.candidates), "pruned": plan.pruned, "plan": plan.to_json()})
                rows[-1]["public"] = PUBLIC.get((name, devices), "none published for this workload")
                print(_line(rows[-1]), flush=True)
    return rows


HEADER = (f"{'model':11} {'dev':>3} {'slo':5} {'chosen (per unit)':32} {'batch/budget':17} {'goodput':>8} {'/dev':>6} "
          f"{'agg':>7} {'disagg':>7} {'D/A':>5} {'plan s':>6} {'steps s':>7}  vLLM/SGLang measured")


def _line(r: dict) -> str:
    ratio = f"{r['disagg_over_agg']:.2f}" if r["disagg_over_agg"] else "-"
    return (f"{r['model']:11} {r['devices']:3} {r['slo']:5} {r['chosen']:32} {r['limits']:17} {r['goodput_rps']:8.1f} "
            f"{r['per_device']:6.2f} {r['best_aggregated_rps']:7.1f} {r['best_disaggregated_rps']:7.1f} {ratio:>5} "
            f"{r['plan_serving_s']:6.1f} {r['steps_s']:7.1f}  {r['public']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B only, 8 and 64 devices")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    for model, slos in SLOS.items():
        print(f"{model} SLOs: " + ", ".join(f"{k} TTFT {s.ttft_s}s TPOT {s.tpot_s}s p90" for k, s in slos.items()))
    print(HEADER)
    rows = run(args.quick)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "slos": {m: {k: vars(s) for k, s in slos.items()}
                                                                     for m, slos in SLOS.items()}}, indent=1))
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
