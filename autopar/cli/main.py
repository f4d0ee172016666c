"""``autopar plan FILE.py:FUNC --mesh dp=2,tp=4 [--hardware h100] [--json plan.json]``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autopar.hardware import PROFILES


def load_builder(spec: str) -> Any:
    """Import ``path/to/file.py:function`` (or ``package.module:function``) and return the function."""
    target, sep, func = spec.rpartition(":")
    if not sep or not target or not func:
        raise SystemExit(f"autopar: expected FILE.py:FUNCTION, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.exists():
            raise SystemExit(f"autopar: no such file {target}")
        sys.path.insert(0, str(path.parent.parent))  # lets 'examples/x.py' import 'examples.y'
        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module  # dataclasses look their module up while defining
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    if not hasattr(module, func):
        raise SystemExit(f"autopar: {target} has no function {func!r}")
    return getattr(module, func)


def _unpack(built: Any) -> tuple[Any, tuple, Any, tuple]:
    """build() returns (model, inputs[, loss_fn[, targets]])."""
    if not isinstance(built, tuple) or not 2 <= len(built) <= 4:
        raise SystemExit("autopar: build() must return (model, example_inputs[, loss_fn[, example_targets]])")
    model, inputs = built[0], built[1]
    loss_fn = built[2] if len(built) > 2 else None
    targets = built[3] if len(built) > 3 else ()
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    targets = targets if isinstance(targets, tuple) else (targets,)
    return model, inputs, loss_fn, targets


def plan_command(args: argparse.Namespace) -> int:
    import autopar
    from autopar.mesh import Mesh, parse_mesh_spec
    from autopar.solver.report import render

    model, inputs, loss_fn, targets = _unpack(load_builder(args.builder)())
    mesh = Mesh(parse_mesh_spec(args.mesh), args.hardware, args.devices_per_node)
    memory_limit = args.memory_limit_gib * 2**30 if args.memory_limit_gib is not None else None
    plan = autopar.plan(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets,
                        train=not args.forward_only, memory_limit=memory_limit, precision=args.precision,
                        progress=sys.stderr.isatty())
    from rich.console import Console

    Console(width=args.width).print(render(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_json(), indent=1))
        print(f"plan written to {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization of PyTorch models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="find and print the best DP/TP/SP plan for a model on a mesh")
    p.add_argument("builder", help="FILE.py:FUNCTION returning (model, example_inputs[, loss_fn[, example_targets]])")
    p.add_argument("--mesh", required=True, help="axes outermost first, e.g. dp=2,tp=4")
    p.add_argument("--hardware", default="h100", choices=sorted(PROFILES), help="device profile (default h100)")
    p.add_argument("--devices-per-node", type=int, default=8, help="devices sharing NVLink (default 8)")
    p.add_argument("--memory-limit-gib", type=float, default=None, help="per-device limit (default: device memory)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: the hardware's")
    p.add_argument("--forward-only", action="store_true", help="plan a forward-only step (no backward/optimizer)")
    p.add_argument("--json", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--width", type=int, default=None, help="table width (default: terminal)")
    args = parser.parse_args(argv)
    try:
        return plan_command(args)
    except (ValueError, RuntimeError) as exc:  # CaptureError, MemoryLimitError, bad mesh: one clear line
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
