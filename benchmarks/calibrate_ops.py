"""Measure what ops cost on this machine, as compiled steps run them, and fit the cpu profile.

The cost model prices an op as a roofline (``op_flops`` at ``peak_flops * compute_efficiency``,
``op_bytes`` at ``memory_bandwidth * memory_efficiency``; backward twice the forward) plus a
fixed cost per op (``op_overhead`` in forward, ``backward_op_overhead`` in backward: Python,
PyTorch's dispatcher, autograd, kernel launch) and per parameter for the optimizer
(``optimizer_param_overhead``). This script forks ``--world`` gloo ranks as the tests and
``runtime_overhead.py`` do (``torch.set_num_threads(1)``, the ranks sharing the cores), every
rank running the same measurements at the same time, and fits those figures:

* fixed cost per op: chains of ``--chain`` ops on 64-element tensors (no work to speak of),
  of the kinds transformer graphs run, called as the compiled program calls them
  (``torch.ops.aten.<op>.<overload>``, autograd recording); forward = chain / K, backward =
  (backward of the chain - backward of an empty chain) / K; the mean over the ops. Views
  are measured apart (the cost model prices them free).
* work: the example models' ops at their per-rank shapes on a dp=2 x tp=2 mesh (256 tokens,
  width 128, MLP 256, 2 heads of 32), forward and backward, inputs rotating over
  ``--sets`` copies so that, as in a step, they are not all in cache. Linears give the FLOP
  rate (``op_flops`` over the time less the fixed costs); the other ops, but attention,
  the byte rate (``op_bytes`` over the time less the fixed costs, all those ops together);
  attention's FLOP rate is shown apart.
* optimizer: ``torch.optim.AdamW`` (PyTorch's default on CPU: a loop over tensors) over
  ``--params`` 64-element parameters, per parameter and step.

Each figure is timed by wall clock (under whatever else runs on the machine) and by the
rank's CPU time; ``ci`` is CPU time x ranks / cores: the rank's wall time when the ranks
keep the cores busy and nothing else runs (CI's setting). The fit uses ``ci``; it prints
the median over ranks next to what the cpu profile says.

Usage: ``python benchmarks/calibrate_ops.py [--world 4] [--reps 5] [--window 0.2] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)  # before any compute: forked children hang on an inherited OpenMP pool

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # this checkout's autopar, not an installed one

import torch.distributed as dist  # noqa: E402

from autopar.capture.graph import TensorMeta  # noqa: E402
from autopar.cost.compute import op_bytes, op_flops  # noqa: E402
from autopar.cost.precision import get_precision  # noqa: E402
from autopar.hardware import get_profile  # noqa: E402
from autopar.rules.strategy import OpCall  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402

aten = torch.ops.aten
WIDTH = 16  # tiny tensors (4 x 16 = 64 elements): an op's fixed cost, not its work
CLOCKS = ("wall", "cpu")
FP32 = get_precision("fp32")


# --------------------------------------------------------------------------- timing

def _stamp() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    now = _stamp()
    return now[0] - start[0], now[1] - start[1]


def _windowed(run: Callable[[], tuple[float, ...]], window: float, reps: int) -> tuple[float, ...]:
    """Mean seconds of each part ``run()`` times, over calls filling ``window`` seconds of wall
    time; the median over ``reps`` windows. Whole windows, not single calls: ranks sharing
    cores are descheduled for whole time slices, which the median of short calls leaves out."""
    run()  # warm-up
    per_window = []
    for _ in range(reps):
        totals: list[float] = []
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < window:
            parts = run()
            totals = [a + b for a, b in zip(totals, parts)] if totals else list(parts)
            count += 1
        per_window.append([t / count for t in totals])
    return tuple(statistics.median(w[i] for w in per_window) for i in range(len(per_window[0])))


def _fwd_bwd(fn: Callable[[], torch.Tensor], grad: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, ...]:
    """(forward wall, forward cpu, backward wall, backward cpu) of one call of ``fn``."""
    start = _stamp()
    out = fn()
    forward = _since(start)
    g = grad(out)
    start = _stamp()
    out.backward(g)
    return (*forward, *_since(start))


def _by_clock(parts: tuple[float, ...], scale: float = 1.0) -> dict[str, dict[str, float]]:
    return {clock: {"forward": parts[i] * scale, "backward": parts[2 + i] * scale} for i, clock in enumerate(CLOCKS)}


# --------------------------------------------------------------------------- fixed costs

def _chain_ops(x: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Shape-preserving ops, so that K of them chain (each one's output feeds the next)."""
    w, b, g = torch.randn(WIDTH, WIDTH, requires_grad=True), torch.randn(WIDTH, requires_grad=True), \
        torch.randn(WIDTH, requires_grad=True)
    return {
        "op:linear": lambda y: aten.linear.default(y, w, b),
        "op:layer_norm": lambda y: aten.layer_norm.default(y, [WIDTH], g, b),
        "op:rms_norm": lambda y: aten.rms_norm.default(y, [WIDTH], g, 1e-5),
        "op:add": lambda y: aten.add.Tensor(y, x),
        "op:mul": lambda y: aten.mul.Tensor(y, x),
        "op:gelu": lambda y: aten.gelu.default(y),
        "op:silu": lambda y: aten.silu.default(y),
        "op:neg": lambda y: aten.neg.default(y),
        "op:softmax": lambda y: aten._softmax.default(y, -1, False),
        "op:sdpa": lambda y: aten.scaled_dot_product_attention.default(y, y, y, is_causal=True),
        "op:dropout": lambda y: aten.dropout.default(y, 0.1, True),
        "view:view": lambda y: aten.view.default(y, [-1, WIDTH]),
        "view:transpose": lambda y: aten.transpose.int(y, 0, 1),
    }


def _chain(op: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor, k: int) -> tuple[float, ...]:
    def run() -> torch.Tensor:
        y = x
        for _ in range(k if op is not None else 0):
            y = op(y)
        return y.sum()

    # the sum and its backward are in both the chain and the empty chain: they cancel
    return _fwd_bwd(run, lambda out: torch.ones_like(out))


def _fixed_costs(k: int, window: float, reps: int) -> dict[str, dict[str, dict[str, float]]]:
    x = torch.randn(4, WIDTH, requires_grad=True)
    empty = _windowed(lambda: _chain(None, x, k), window, reps)
    out = {}
    for name, op in _chain_ops(x).items():
        t = _windowed(lambda: _chain(op, x, k), window, reps)
        out[name] = _by_clock(tuple(max(a - b, 0.0) for a, b in zip(t, empty)), 1.0 / k)
    return out


# --------------------------------------------------------------------------- work at the examples' sizes

def _model_ops(sets: int) -> dict[str, tuple[str, Callable[[int], tuple[Any, tuple]]]]:
    """name -> (kind, i -> (aten op, args) on input copy i): the examples' per-rank shapes."""
    def copies(*shape: int, grad: bool = True) -> list[torch.Tensor]:
        return [torch.randn(*shape, requires_grad=grad) for _ in range(sets)]

    x, h, q, p = copies(4, 64, 128), copies(4, 64, 256), copies(4, 2, 64, 32), copies(4, 64, 64)
    logits, w128 = copies(256, 512), copies(128)
    ids = [torch.randint(0, 512, (4, 64)) for _ in range(sets)]
    targets = [torch.randint(0, 512, (256,)) for _ in range(sets)]
    table = copies(512, 128)
    lin = {name: (copies(o, i), copies(o)) for name, (i, o) in
           {"qkv": (128, 192), "attn.proj": (64, 128), "fc": (128, 256), "mlp.proj": (256, 128),
            "lm_head": (128, 512)}.items()}
    lin_in = {"qkv": x, "attn.proj": p, "fc": x, "mlp.proj": h, "lm_head": x}
    ops: dict[str, tuple[str, Callable[[int], tuple[Any, tuple]]]] = {
        f"linear {n}": ("matmul", lambda i, n=n: (aten.linear.default, (lin_in[n][i], lin[n][0][i], lin[n][1][i])))
        for n in lin}
    ops.update({
        "sdpa": ("attention", lambda i: (aten.scaled_dot_product_attention.default, (q[i], q[i], q[i], None, 0.0, True))),
        "layer_norm": ("bytes", lambda i: (aten.layer_norm.default, (x[i], [128], w128[i], w128[i - 1]))),
        "rms_norm": ("bytes", lambda i: (aten.rms_norm.default, (x[i], [128], w128[i], 1e-5))),
        "gelu": ("bytes", lambda i: (aten.gelu.default, (h[i],))),
        "silu": ("bytes", lambda i: (aten.silu.default, (h[i],))),
        "add": ("bytes", lambda i: (aten.add.Tensor, (x[i], x[i - 1]))),
        "mul": ("bytes", lambda i: (aten.mul.Tensor, (h[i], h[i - 1]))),
        "neg": ("bytes", lambda i: (aten.neg.default, (x[i],))),
        "cat": ("bytes", lambda i: (aten.cat.default, ([p[i], p[i - 1]], -1))),
        "dropout": ("bytes", lambda i: (aten.dropout.default, (x[i], 0.1, True))),
        "embedding": ("bytes", lambda i: (aten.embedding.default, (table[i], ids[i]))),
        "cross_entropy": ("bytes", lambda i: (aten.cross_entropy_loss.default, (logits[i], targets[i]))),
    })
    return ops


def _meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return TensorMeta.of(a)
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a)
    return a


def _work(sets: int, window: float, reps: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (kind, make) in _model_ops(sets).items():
        counter = iter(range(10**9))

        def run() -> tuple[float, ...]:
            target, args = make(next(counter) % sets)
            return _fwd_bwd(lambda: target(*args), lambda y: torch.ones_like(y))

        target, args = make(0)
        result = target(*args)
        call = OpCall(target, _meta(args), {}, (TensorMeta.of(result),))
        out[name] = {"kind": kind, "flops": op_flops(call),
                     "bytes": op_bytes(target, call.tensor_inputs, call.outputs, FP32),
                     **_by_clock(_windowed(run, window, reps))}
    return out


def _optimizer(n_params: int, window: float, reps: int) -> dict[str, float]:
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.randn(64)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def run() -> tuple[float, float]:
        start = _stamp()
        opt.step()
        return _since(start)

    return {clock: t / n_params for clock, t in zip(CLOCKS, _windowed(run, window, reps))}


def _measure(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"loadavg": [os.getloadavg()[0]]}
    for name, run in (("fixed", lambda: _fixed_costs(args.chain, args.window, args.reps)),
                      ("work", lambda: _work(args.sets, args.window, args.reps)),
                      ("optimizer", lambda: _optimizer(args.params, args.window, args.reps))):
        dist.barrier()  # every rank measures the same thing at the same time
        results[name] = run()
    results["loadavg"].append(os.getloadavg()[0])
    return results


# --------------------------------------------------------------------------- fit and report

def _median_over_ranks(results: list[dict], path: tuple[str, ...], share: float) -> dict[str, Any]:
    """The figure at ``path`` (a {clock: value or {phase: value}} dict), median over ranks, with
    ``ci`` = cpu x ``share`` added."""
    def at(r: dict) -> Any:
        for key in path:
            r = r[key]
        return r

    first = at(results[0])
    out: dict[str, Any] = {}
    for clock in CLOCKS:
        if isinstance(first[clock], dict):
            out[clock] = {ph: statistics.median(at(r)[clock][ph] for r in results) for ph in first[clock]}
        else:
            out[clock] = statistics.median(at(r)[clock] for r in results)
    cpu = out["cpu"]
    out["ci"] = {ph: t * share for ph, t in cpu.items()} if isinstance(cpu, dict) else cpu * share
    return out


def summarize(results: list[dict], world: int, cores: int) -> dict[str, Any]:
    share = max(world / cores, 1.0)
    fixed = {name: _median_over_ranks(results, ("fixed", name), share) for name in results[0]["fixed"]}
    work = {name: {"kind": v["kind"], "flops": v["flops"], "bytes": v["bytes"],
                   **_median_over_ranks(results, ("work", name), share)} for name, v in results[0]["work"].items()}
    # Means, not medians: a step pays the sum over its ops, and decomposed ops (rms_norm,
    # sdpa, gelu's backward) cost several times the simple ones.
    op_fwd = statistics.mean(v["ci"]["forward"] for k, v in fixed.items() if k.startswith("op:"))
    op_bwd = statistics.mean(v["ci"]["backward"] for k, v in fixed.items() if k.startswith("op:"))
    for v in work.values():  # the model: forward = work + op_fwd, backward = 2 work + op_bwd
        v["work_s"] = max(v["ci"]["forward"] + v["ci"]["backward"] - op_fwd - op_bwd, 1e-9) / 3
        v["rate"] = (v["bytes"] if v["kind"] == "bytes" else v["flops"]) / v["work_s"]
    matmuls = [v for v in work.values() if v["kind"] == "matmul"]
    memory_bound = [v for v in work.values() if v["kind"] == "bytes"]
    load = [x for r in results for x in r["loadavg"]]
    return {
        "world": world, "cores": cores, "loadavg": [min(load), max(load)], "fixed": fixed, "work": work,
        "optimizer_per_param": _median_over_ranks(results, ("optimizer",), share),
        "fit": {"op_overhead_s": op_fwd, "backward_op_overhead_s": op_bwd,
                "view_forward_s": statistics.mean(v["ci"]["forward"] for k, v in fixed.items() if k.startswith("view:")),
                "view_backward_s": statistics.mean(v["ci"]["backward"] for k, v in fixed.items()
                                                   if k.startswith("view:")),
                "flops_per_s": sum(v["flops"] for v in matmuls) / sum(v["work_s"] for v in matmuls),
                "bytes_per_s": sum(v["bytes"] for v in memory_bound) / sum(v["work_s"] for v in memory_bound),
                "optimizer_param_overhead_s": None},
    }


def report(s: dict[str, Any]) -> None:
    cpu = get_profile("cpu")
    us = 1e6
    s["fit"]["optimizer_param_overhead_s"] = s["optimizer_per_param"]["ci"]
    print(f"{s['world']} ranks on {s['cores']} cores, 1-min load average {s['loadavg'][0]:.1f}-{s['loadavg'][1]:.1f}. "
          f"Medians over ranks; wall: under this load; ci: CPU time x {max(s['world'] / s['cores'], 1):.1f}")
    print(f"fixed cost per op (us)  {'fwd wall':>9} {'bwd wall':>9} {'fwd ci':>8} {'bwd ci':>8}")
    for name, v in s["fixed"].items():
        print(f"  {name:<20} {v['wall']['forward'] * us:>9.1f} {v['wall']['backward'] * us:>9.1f} "
              f"{v['ci']['forward'] * us:>8.1f} {v['ci']['backward'] * us:>8.1f}")
    print(f"work at the examples' per-rank shapes (us; rate = op_flops or op_bytes / work, work = "
          f"(fwd + bwd - fixed) / 3, ci)")
    print(f"  {'op':<20} {'fwd wall':>9} {'bwd wall':>9} {'fwd ci':>8} {'bwd ci':>8} {'rate':>16}")
    for name, v in s["work"].items():
        unit = "GB/s" if v["kind"] == "bytes" else "GFLOP/s"
        print(f"  {name:<20} {v['wall']['forward'] * us:>9.1f} {v['wall']['backward'] * us:>9.1f} "
              f"{v['ci']['forward'] * us:>8.1f} {v['ci']['backward'] * us:>8.1f} {v['rate'] / 1e9:>8.1f} {unit:<7}")
    f = s["fit"]
    rows = [("op_overhead", f"{f['op_overhead_s'] * us:.1f} us", f"{cpu.op_overhead * us:.1f} us"),
            ("backward_op_overhead", f"{f['backward_op_overhead_s'] * us:.1f} us",
             f"{cpu.backward_op_overhead * us:.1f} us"),
            ("optimizer_param_overhead", f"{f['optimizer_param_overhead_s'] * us:.1f} us",
             f"{cpu.optimizer_param_overhead * us:.1f} us"),
            ("FLOP/s (linears)", f"{f['flops_per_s'] / 1e9:.1f} G",
             f"{cpu.peak_flops_fp32 * cpu.compute_efficiency / 1e9:.1f} G"),
            ("bytes/s (all but matmuls)", f"{f['bytes_per_s'] / 1e9:.1f} G",
             f"{cpu.memory_bandwidth * cpu.memory_efficiency / 1e9:.1f} G"),
            ("view fwd / bwd (free)", f"{f['view_forward_s'] * us:.1f} / {f['view_backward_s'] * us:.1f} us", "0")]
    print(f"fit (ci)                   {'measured':>16} {'cpu profile':>14}")
    for name, measured, profile in rows:
        print(f"  {name:<24} {measured:>16} {profile:>14}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="timed windows per figure (median)")
    parser.add_argument("--window", type=float, default=0.2, help="seconds per timed window")
    parser.add_argument("--chain", type=int, default=50, help="ops per timed chain")
    parser.add_argument("--sets", type=int, default=16, help="input copies the work runs rotate over")
    parser.add_argument("--params", type=int, default=50, help="parameters the optimizer updates")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = run_ranks(_measure, args.world, args, timeout_s=900)
    summary = summarize(results, args.world, os.cpu_count() or 1)
    report(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
