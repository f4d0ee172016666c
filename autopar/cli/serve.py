"""``autopar serve-plan FILE.py:FUNCTION --devices 16 --prompt 2048 --output 256 --rate 10 --ttft 0.5 --tpot 0.05``:
the serving deployment of the model FUNCTION returns (``autopar.plan_serving``), printed or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from autopar.cli import hf
from autopar.cli.builders import load_builder, positive, run_user_code
from autopar.errors import InputError
from autopar.hardware import PROFILES


def _tokens(text: str) -> Any:
    """``2048`` (every request) or ``512-2048`` (uniform over the range)."""
    from autopar.serving.workload import Uniform

    low, sep, high = text.partition("-")
    try:
        if not sep:
            value = int(text)
            if value < 1:
                raise ValueError
            return value
        bounds = int(low), int(high)
        if not 1 <= bounds[0] <= bounds[1]:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count N >= 1 or a range LOW-HIGH, got {text!r}") from None
    return Uniform(low=bounds[0], high=bounds[1])


def _degrees(text: str) -> tuple[int, ...]:
    """``2`` or ``1,2,4``: positive whole numbers."""
    try:
        values = tuple(int(v) for v in text.split(","))
        if not values or min(values) < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}") from None
    return values


def add_parser(sub: Any, epilog: str) -> None:
    """The ``serve-plan`` subcommand."""
    p = sub.add_parser("serve-plan", help="plan a serving deployment (replicas, TP per phase, prefill/decode "
                                          "disaggregation) with the highest goodput under latency SLOs",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("builder", nargs="?", default=None, help="FILE.py:FUNCTION returning a servable model (setup_cache(slots, max_len) and "
                                   "forward(tokens, positions, slots); e.g. examples/llama.py:build_8b_serving)")
    hf.add_options(p, training=False, positive=positive)
    p.add_argument("--devices", type=positive(int), required=True, help="devices in the cluster")
    p.add_argument("--hardware", default="h100", choices=sorted(PROFILES), help="device profile (default h100)")
    p.add_argument("--devices-per-node", type=positive(int), default=8,
                   help="devices sharing NVLink (default 8)")
    p.add_argument("--prompt", type=_tokens, required=True, metavar="N|LOW-HIGH", help="prompt tokens per request")
    p.add_argument("--output", type=_tokens, required=True, metavar="N|LOW-HIGH", help="output tokens per request")
    p.add_argument("--rate", type=positive(float), required=True,
                   help="arrival rate, requests/s (Poisson; the goodput search starts there)")
    p.add_argument("--ttft", type=positive(float), required=True, help="time-to-first-token target, seconds")
    p.add_argument("--tpot", type=positive(float), required=True, help="time-per-output-token target, seconds")
    p.add_argument("--percentile", type=positive(float), default=0.9,
                   help="fraction of requests that must meet both targets (default 0.9)")
    p.add_argument("--max-batch", type=positive(int), default=None,
                   help="pin every pool's requests in flight per replica (vLLM's max_num_seqs; default: chosen per "
                        "pool by goodput, from 8 to 256)")
    p.add_argument("--token-budget", type=positive(int), default=None,
                   help="pin every pool's tokens per step: decodes plus prefill chunks (vLLM's max_num_batched_tokens; "
                        "default: chosen per pool by goodput, from 256 to 2048)")
    p.add_argument("--no-disaggregated", action="store_true", help="consider aggregated deployments only")
    p.add_argument("--tp", type=_degrees, default=None, metavar="N[,N...]",
                   help="the replicas' TP degrees (default: every divisor of the node)")
    p.add_argument("--pp", type=_degrees, default=None, metavar="N[,N...]",
                   help="pipeline stages per replica, each tried at every TP degree (1: TP alone; default: 1, and 2 "
                        "where a TP replica does not fit or fits badly, deeper across nodes when nothing fits one)")
    p.add_argument("--ep", type=_degrees, default=None, metavar="N[,N...]",
                   help="expert-parallel replica sizes (decode batch split there, experts split by expert; default: "
                        "each divisor of the node for a mixture of experts, unless --tp or --pp is given)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("--width", type=int, default=None, help="table width (default: terminal)")


def serve_command(args: argparse.Namespace) -> int:
    import autopar
    from autopar.serving.serving_plan import render

    if args.percentile > 1:
        raise InputError(f"--percentile is a fraction in (0, 1], got {args.percentile}")
    cluster = autopar.Cluster(devices=args.devices, hardware=args.hardware, devices_per_node=args.devices_per_node)
    workload = autopar.Workload(prompt_tokens=args.prompt, output_tokens=args.output, arrival_rate=args.rate)
    slo = autopar.SLO(ttft_s=args.ttft, tpot_s=args.tpot, percentile=args.percentile)
    hf.check(args, training=False)
    if args.hf_config is not None:
        model = hf.serving_model(args)
    else:
        builder = load_builder(args.builder)
        model = run_user_code(args.builder, lambda: builder())
        if isinstance(model, tuple) and model:  # a training builder's (model, inputs, ...): the model
            model = model[0]
    plan = autopar.plan_serving(model, cluster, workload, slo, max_batch=args.max_batch,
                                token_budget=args.token_budget, disaggregated=not args.no_disaggregated,
                                tp_degrees=args.tp, pp_degrees=args.pp, ep_degrees=args.ep)
    if args.json:
        json.dump(plan.to_json(), sys.stdout, indent=1)
        print()
        return 0
    from rich.console import Console

    Console(width=args.width).print(render(plan))
    return 0
