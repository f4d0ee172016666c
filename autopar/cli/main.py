"""``autopar plan FILE.py:FUNC --mesh dp=2,tp=4 [--hardware h100] [--json plan.json] [--trace step.json]``;
``autopar serve-plan FILE.py:FUNC --devices N ...`` (``autopar.cli.serve``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopar.cli import hf
from autopar.cli.builders import load_builder, positive, run_user_code
from autopar.cli.serve import add_parser, serve_command
from autopar.errors import InputError
from autopar.hardware import PROFILES, get_profile
from autopar.memory.options import CHECKPOINT_POLICIES
from autopar.pipeline.spec import SCHEDULES

EXIT_CODES = """exit status:
  0  the plan was found (and printed)
  2  the input cannot be planned (one message says why): a bad command line,
     a builder file or function that cannot be loaded, raises or returns the wrong things,
     a model torch.export cannot capture, no plan within the memory limit or the
     solver's time limit, pinned placements that conflict
  1  an internal error of autopar, whatever its type (a bug: the traceback is printed;
     please report it)"""


BUILT_KEYS = ("model", "example_inputs", "example_kwargs", "loss_fn", "example_targets")
"""What a builder returning a dict may name (``model`` and ``example_inputs`` required)."""


def _unpack(built: Any, spec: str) -> tuple[Any, tuple, dict | None, Any, tuple]:
    """build() returns (model, inputs[, loss_fn[, targets]]) or a dict of ``BUILT_KEYS``; one
    tensor stands for a 1-tuple."""
    if isinstance(built, dict):
        unknown = sorted(map(str, set(built) - set(BUILT_KEYS)))
        missing = [k for k in BUILT_KEYS[:2] if k not in built]
        if unknown or missing:
            raise InputError(f"{spec} returned a dict " + (f"with unknown keys {unknown}" if unknown else
                             f"without {missing}") + f"; its keys are {', '.join(BUILT_KEYS)} (model and "
                             "example_inputs required)")
        model, inputs, kwargs = built["model"], built["example_inputs"], built.get("example_kwargs")
        loss_fn, targets = built.get("loss_fn"), built.get("example_targets", ())
    elif isinstance(built, tuple) and 2 <= len(built) <= 4:
        model, inputs, kwargs = built[0], built[1], None
        loss_fn = built[2] if len(built) > 2 else None
        targets = built[3] if len(built) > 3 else ()
    else:
        kind = f"a tuple of {len(built)}" if isinstance(built, tuple) else type(built).__name__
        raise InputError(f"{spec} must return (model, example_inputs[, loss_fn[, example_targets]]) or a dict of "
                         f"{', '.join(BUILT_KEYS)}, got {kind}")
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    targets = targets if isinstance(targets, tuple) else (targets,)
    return model, inputs, kwargs, loss_fn, targets


def plan_command(args: argparse.Namespace) -> int:
    import autopar  # here, not at the top: ``autopar --help`` answers without importing torch
    from rich.console import Console

    from autopar.mesh import Mesh, parse_mesh_spec
    from autopar.result.table import render, render_account

    hardware = get_profile(args.hardware)
    if args.moe_imbalance is not None:
        hardware = dataclasses.replace(hardware, moe_imbalance=args.moe_imbalance)
    spec = args.mesh.strip()
    mesh = Mesh(None, hardware, args.devices_per_node, devices=int(spec)) if re.fullmatch(r"[0-9]+", spec) else \
        Mesh(parse_mesh_spec(spec), hardware, args.devices_per_node)  # before running user code
    for option, where in (("--json", args.json), ("--trace", args.trace)):
        _check_writable(option, where)  # before planning, not after the plan is printed
    hf.check(args, training=True)
    if args.hf_config is not None:
        model, inputs, loss_fn, targets, kwargs = hf.training_step(args)
    else:
        builder = load_builder(args.builder)
        model, inputs, kwargs, loss_fn, targets = _unpack(run_user_code(args.builder, lambda: builder()),
                                                          args.builder)
    memory_limit = args.memory_limit_gib * 2**30 if args.memory_limit_gib is not None else None
    pipeline: autopar.Pipeline | bool = not args.no_pipeline
    if args.pipeline is None and (args.schedule is not None or args.virtual_stages is not None
                                  or args.pipeline_from is not None):
        raise InputError("--schedule, --virtual-stages and --pipeline-from are choices of a pipeline: "
                         "add --pipeline AXIS")
    if args.pipeline is not None and args.no_pipeline:
        raise InputError("--pipeline AXIS and --no-pipeline: pass one")
    if args.pipeline is not None:  # --micro-batches is then the pipeline's
        pipeline = autopar.Pipeline(axis=args.pipeline, schedule=args.schedule, micro_batches=args.micro_batches,
                                    virtual_stages=args.virtual_stages, from_axis=args.pipeline_from)
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_kwargs=kwargs, example_targets=targets,
                        train=not args.forward_only, memory_limit=memory_limit, memory_headroom=args.memory_headroom,
                        precision=args.precision, solver_time_limit_s=args.solver_time_limit,
                        zero=args.zero, checkpoint=args.checkpoint, checkpoint_blocks=args.checkpoint_blocks,
                        regather_blocks=args.regather_blocks,
                        micro_batches=None if args.pipeline is not None else args.micro_batches,
                        offload=args.offload, pipeline=pipeline, data_axes=args.data_axes,
                        expert_axes=args.expert_axes, context_axes=args.context_axes,
                        context_layout=args.context_layout, context_attention=args.context_attention,
                        progress=sys.stderr.isatty())
    console = Console(width=args.width)
    console.print(render(plan))
    if args.verbose:
        console.print(render_account(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_json(), indent=1))
        print(f"plan written to {args.json}")
    if args.trace:
        plan.to_chrome_trace(args.trace)
        print(f"wrote the predicted step to {args.trace} (Chrome trace: open it in Perfetto or chrome://tracing)")
    return 0


def _check_writable(option: str, where: str | None) -> None:
    """``where`` (a file ``option`` writes) can be written: its folder exists and it is not a folder."""
    if where is None:
        return
    path = Path(where)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK) \
            or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{option} {where}: cannot write there (its folder must exist and be writable)")


def _zero_stages(text: str) -> dict[str, int]:
    """``dp=3,fsdp=2`` -> {"dp": 3, "fsdp": 2} (stages are checked against the mesh later)."""
    out: dict[str, int] = {}
    for item in text.split(","):
        axis, _, stage = item.partition("=")
        if not axis or not stage.isdecimal() or axis in out:
            raise argparse.ArgumentTypeError(f"expected AXIS=STAGE[,AXIS=STAGE...] with each axis once, got {text!r}")
        out[axis] = int(stage)
    return out


def _axis_names(text: str) -> tuple[str, ...]:
    """``dp,ep`` -> ("dp", "ep") (checked against the mesh later)."""
    names = tuple(text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected AXIS[,AXIS...] with each axis once, got {text!r}")
    return names


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text}")
    return value


def _at_least_one(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (the busiest rank holds at least the mean), got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch models",
                                  epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="find and print the best DP/TP/SP plan for a model on a mesh",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("builder", nargs="?", default=None,
                   help="FILE.py:FUNCTION returning (model, example_inputs[, loss_fn[, example_targets]]) "
                        "or a dict of model, example_inputs, example_kwargs, loss_fn, example_targets")
    hf.add_options(p, training=True, positive=positive)
    p.add_argument("--mesh", required=True, help="axes outermost first, each named once, e.g. dp=2,tp=4; or a "
                   "number of devices, e.g. 512, whose axes the planner lays out")
    p.add_argument("--hardware", default="h100", choices=sorted(PROFILES), help="device profile (default h100)")
    p.add_argument("--devices-per-node", type=positive(int), default=8, help="devices sharing NVLink (default 8)")
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--memory-limit-gib", type=positive(float), default=None,
                       help="per-device limit in GiB (default: device memory less the headroom)")
    limit.add_argument("--memory-headroom", type=_fraction, default=None, metavar="FRACTION",
                       help="fraction of device memory left free by the default limit (default: the profile's, 0.1)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: the hardware's")
    p.add_argument("--forward-only", action="store_true", help="plan a forward-only step (no backward/optimizer)")
    p.add_argument("--context-axes", type=_axis_names, default=(), metavar="AXIS,...",
                   help="context parallelism: split the sequence (dim 1 of the inputs) on these axes")
    p.add_argument("--context-layout", choices=["contiguous", "zigzag"], default=None,
                   help="how the context axes cut the sequence (default: both planned, the faster kept; zigzag: "
                        "rank i holds chunks i and 2n-1-i of 2n, balancing causal attention)")
    p.add_argument("--context-attention", choices=["ring", "allgather", "ulysses"], default=None,
                   help="how attention runs on a split sequence (default: the cheaper per call; ring: keys and "
                        "values passed around the ring; allgather: gathered on every rank; ulysses: all-to-alls "
                        "to a heads split)")
    p.add_argument("--solver-time-limit", type=positive(float), default=120.0, metavar="SECONDS",
                   help="time HiGHS may search (default 120); a plan found by then says it is not proven optimal")
    data = p.add_argument_group("data and expert parallelism (default: the planner places the batch too)")
    data.add_argument("--data-axes", type=_axis_names, default=(), metavar="AXIS,...",
                      help="pin data parallelism on these axes: the batch split, parameters replicated")
    data.add_argument("--expert-axes", type=_axis_names, default=(), metavar="AXIS,...",
                      help="of the data axes, those where stacked expert weights are left to the planner (expert "
                           "parallelism: tokens reach experts split by expert by all-to-all), e.g. ep")
    data.add_argument("--moe-imbalance", type=_at_least_one, default=None, metavar="F",
                      help="expert load imbalance expert parallelism is priced at: the busiest rank's (token, "
                           "expert) pairs over the mean (default: the hardware profile's, 1.3)")
    memory = p.add_argument_group("memory choices (default: the planner picks them by the memory limit)")
    memory.add_argument("--zero", type=_zero_stages, default=None, metavar="AXIS=STAGE,...",
                        help="pin a ZeRO stage per data axis: 0 (DDP), 1 (optimizer state sharded), 2 (parameters "
                             "stored split, kept gathered "
                             "until backward), 3 (gathered again in backward), e.g. dp=3")
    memory.add_argument("--checkpoint", choices=list(CHECKPOINT_POLICIES), default=None,
                        help="pin activation checkpointing of the repeated blocks")
    memory.add_argument("--checkpoint-blocks", type=positive(int), default=None, metavar="K",
                        help="pin how many repeated blocks checkpoint, the first ones (default: all of them "
                             "with --checkpoint, else the planner's choice)")
    memory.add_argument("--regather-blocks", type=positive(int), default=None, metavar="K",
                        help="with --zero AXIS=3: gather only the first K repeated blocks' parameters again in "
                             "backward, holding the others from forward (default: every parameter's)")
    memory.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                        help="pin every parameter's optimizer state (and fp32 master weights) in host memory, "
                        "or --no-offload (default: the planner offloads what the memory limit needs)")
    memory.add_argument("--micro-batches", type=positive(int), default=None, metavar="M",
                        help="pin the number of micro-batches a step runs (must divide the batch)")
    pipe = p.add_argument_group("pipeline (default: the planner takes 1, 2, 4, ... pp ranks out of the mesh's first "
                                "axis and keeps the fastest; with --pipeline, what is not given the planner picks)")
    pipe.add_argument("--no-pipeline", action="store_true", help="plan without a pipeline")
    pipe.add_argument("--pipeline", metavar="AXIS", default=None,
                      help="lay pipeline stages along this mesh axis (the first); --micro-batches is then the "
                           "pipeline's")
    pipe.add_argument("--pipeline-from", metavar="AXIS", default=None,
                      help="take the --pipeline axis out of this mesh axis (the first), the planner choosing how "
                           "many pp ranks (1: no pipeline) among its size's divisors")
    pipe.add_argument("--schedule", choices=SCHEDULES, default=None, help="pin the pipeline schedule")
    pipe.add_argument("--virtual-stages", type=positive(int), default=None, metavar="V",
                      help="pin the stages per pp rank (interleaved_1f1b >= 2; zbv and dualpipev 2)")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--trace", metavar="FILE", help="also write the predicted step as a timeline (Chrome trace JSON)")
    p.add_argument("--width", type=positive(int), default=None, help="table width (default: terminal)")
    p.add_argument("--verbose", action="store_true",
                   help="also print the search's account: what was tried, pruned and why, as a table")

    add_parser(sub, EXIT_CODES)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)  # a bad command line exits with 2 (argparse's usage error)
    try:
        if args.command == "serve-plan":
            return serve_command(args)
        return plan_command(args)
    except InputError as exc:  # what the user handed in (capture, memory and time limits included): one message
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 - anything else is autopar's bug, whatever its type: keep the traceback
        traceback.print_exc()
        print("autopar: internal error (a bug in autopar; please report it with the traceback above)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
