"""Per-step time of ``autopar.compile``'d training vs PyTorch's own hand-written plan, and
vs the step time autopar's cost model predicts.

Models: the example GPT (``examples/gpt.py``) and Llama (``examples/llama.py``), fp32,
dropout off (hand plans for the GPT only). Mesh ``dp=2,tp=2``: 4 gloo ranks on CPU, forked
from this process (as ``tests/distributed.py`` does; forking costs well under a second where
spawning or torchrun costs 10-20 s). One training step is forward, loss, backward, AdamW
update and ``zero_grad``, on a fixed global batch.

Variants (all on the same mesh, the same initial weights and the same global batch):

* ``hand tp + ddp``    torch ``parallelize_module`` on the ``tp`` axis with the Megatron plan
  (``GPT_TP``: qkv and fc ``ColwiseParallel``, both projections ``RowwiseParallel``) and
  ``DistributedDataParallel(device_mesh=mesh["dp"])`` on the data axis (each dp rank feeds
  its half of the batch).
* ``hand tp_sp + ddp`` the same with sequence parallelism (``GPT_TP_SP``: LayerNorms
  ``SequenceParallel``, the residual stream sharded on the sequence dim between blocks).
* ``hand tp + fsdp2``  ``GPT_TP`` with ``fully_shard`` on the dp mesh (per block and root)
  instead of DDP: the other data-parallel flavour torch offers for 2-D (torchtitan's).
* ``autopar tp``       ``autopar.compile(..., constraints=GPT_TP, data_axes=("dp",), pipeline=False)``.
* ``autopar tp_sp``    ``autopar.compile(..., constraints=GPT_TP_SP, data_axes=("dp",), pipeline=False)``.
* ``autopar free``     ``autopar.compile(..., pipeline=False)`` with no constraints (the solver's choice).
* ``llama autopar tp``, ``llama autopar tp_sp``, ``llama autopar free``: the same three on
  the Llama example (its ``TP_PLAN`` / ``TP_SP_PLAN``; same width, depth, vocabulary, batch
  and sequence, ``--kv-heads`` and ``--ffn``).

Predicted vs measured: for each autopar variant, ``plan.predicted.step_time_s`` (the cost
model on the mesh's hardware profile, ``cpu`` here) next to the measured median, and their
ratio (target: within +-25%). Other processes on the machine slow the ranks down: the
``cpu est.`` column is each rank's CPU time per step (all its threads) times ranks / cores,
averaged over ranks: what the step would take with the ranks alone on the cores if they
were CPU-bound throughout. The 1-minute load average before and after is printed.

The ratio column is autopar / hand per-step time (medians; in brackets the ratio of the
minima, less sensitive to load): ``autopar tp`` vs ``hand tp + ddp``, ``autopar tp_sp`` vs
``hand tp_sp + ddp``, and ``autopar free`` vs the fastest hand variant. Target: <= 1.0.
The last column is the number of collectives autopar's plan lists per step.

What the hand plan needs that autopar does not (hand side only, on a copy of the model):
torch's ``ColwiseParallel`` hands each rank a *local* tensor, so the example's attention,
written for global shapes (``qkv(x).split(h)`` with ``h`` the full width, ``view(b, s,
self.heads, ...)`` with all heads, ``reshape(b, s, h)``), breaks under it. Two changes
make it work: (1) the fused qkv weight's rows are permuted so each tp rank's contiguous
column shard holds its own heads' ``[q; k; v]`` (Megatron's interleaved layout; the math
of the full model is unchanged), and (2) the attention forward uses local shapes
(``chunk(3)``, ``view(b, s, -1, head_dim)``, i.e. ``heads / tp`` heads per rank, and
``reshape(b, s, -1)``). autopar needs neither: ``ColwiseParallel`` on the fused qkv
runs as a strided shard of its output features (``S(2/3)``: each rank holds its heads'
slices of q, k and v, the same interleaved layout) on the unchanged model. For sequence parallelism the hand plan also shards the residual
stream on entering ``blocks.0`` (``PrepareModuleInput`` Replicate -> Shard(1), a local
slice) and gathers it before ``ln_f`` (Shard(1) -> Replicate, an all-gather); embeddings,
``ln_f`` and ``lm_head`` stay replicated on tp.

Sanity: every variant's losses over the first ``--check-steps`` steps (the first warm-up
steps) must match the single-device model's (step 0 at rtol 1e-5; later steps, which
also check the gradients and update, at rtol 1e-4).

Timing: after ``--warmup`` untimed steps, each repetition times ``--steps`` steps between
two barriers; the per-step time of a repetition is the slowest rank's time / steps.
Repetitions are interleaved across variants (round robin) so that machine-load drift hits
all variants alike; the table shows the median over ``--reps`` repetitions (and min).
On a 2-core machine 4 ranks oversubscribe the cores: absolute numbers are noisy and mostly
measure per-op overhead, which is what a runtime-overhead comparison wants at this size.

Usage: ``python benchmarks/runtime_overhead.py [--reps 5] [--steps 10] [--warmup 3]
[--batch 8] [--seq 64] [--hidden 128] [--layers 2] [--vocab 512] [--kv-heads 2] [--ffn 256]
[--variants V1,V2] [--json PATH] [--profile]`` (``--profile``: cProfile one autopar tp step
on rank 0, top functions).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)  # before any compute: forked children hang on an inherited OpenMP pool

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` importable when run as a script

import autopar  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402
from examples import llama  # noqa: E402
from examples.gpt import GPT, CausalSelfAttention, GPTConfig, lm_loss  # noqa: E402
from examples.gpt import TP_PLAN as GPT_TP, TP_SP_PLAN as GPT_TP_SP  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "runtime_overhead.json"
MESH = {"dp": 2, "tp": 2}
LR = 1e-3
TIMEOUT_S = 300
VARIANTS = ("hand tp + ddp", "hand tp_sp + ddp", "hand tp + fsdp2", "autopar tp", "autopar tp_sp", "autopar free",
            "llama autopar tp", "llama autopar tp_sp", "llama autopar free")
PAIRS = {"autopar tp": "hand tp + ddp", "autopar tp_sp": "hand tp_sp + ddp", "autopar free": None}
TP_PLANS = {"gpt": {"tp": GPT_TP, "tp_sp": GPT_TP_SP}, "llama": {"tp": llama.TP_PLAN, "tp_sp": llama.TP_SP_PLAN}}


# --------------------------------------------------------------------------- model and data

def model_of(variant: str) -> str:
    return "llama" if variant.startswith("llama ") else "gpt"


def build(args: argparse.Namespace, model_name: str = "gpt") -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if model_name == "llama":
        model: nn.Module = llama.Llama(llama.LlamaConfig(
            vocab_size=args.vocab, max_seq_len=args.seq, hidden=args.hidden, heads=args.heads,
            kv_heads=args.kv_heads, ffn_hidden=args.ffn, layers=args.layers))
    else:
        model = GPT(GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, hidden=args.hidden, heads=args.heads,
                              layers=args.layers, dropout=0.0))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    return model, tokens, torch.roll(tokens, -1, dims=1)


def _local_attention_forward(self: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The example's attention written for local shapes (hand TP side only)."""
    b, s, _ = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=-1)  # this rank's heads: [q; k; v] (interleaved layout)
    q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # heads / tp heads per rank
    k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
    v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).reshape(b, s, -1)
    return self.dropout(self.proj(y))


def _interleave_qkv(model: GPT, tp: int) -> None:
    """Permute each fused qkv's rows to [q_0; k_0; v_0; q_1; ...] (tp blocks): rank r's column shard
    then holds its heads' q, k and v. With the local-shape forward, the full model's math is unchanged."""
    for block in model.blocks:
        attn = block.attn
        h = attn.proj.in_features
        attn.head_dim = h // attn.heads
        order = torch.arange(3 * h).view(3, tp, h // tp).transpose(0, 1).reshape(-1)
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.weight[order])
            attn.qkv.bias.copy_(attn.qkv.bias[order])
        attn.forward = types.MethodType(_local_attention_forward, attn)


def hand_model(args: argparse.Namespace, mesh: DeviceMesh, plan: str, dp: str) -> nn.Module:
    model, _, _ = build(args)
    tp_mesh = mesh["tp"]
    _interleave_qkv(model, tp_mesh.size())
    if plan == "tp":
        parallelize_module(model, tp_mesh, dict(GPT_TP))
    else:
        sp = dict(GPT_TP_SP)
        sp["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                            use_local_output=True)
        sp["ln_f"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
        parallelize_module(model, tp_mesh, sp)
    if dp == "ddp":
        return nn.parallel.DistributedDataParallel(model, device_mesh=mesh["dp"])
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


# --------------------------------------------------------------------------- one variant's step

class Variant:
    def __init__(self, name: str, args: argparse.Namespace, mesh: DeviceMesh) -> None:
        self.name = name
        self.planned: dict[str, Any] = {}
        _, tokens, targets = build(args)
        t0 = time.perf_counter()
        if name.startswith("hand"):
            _, plan, _, dp = name.split()
            self.module = hand_model(args, mesh, plan, dp)
            dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
            per = tokens.shape[0] // dp_size
            self.inputs = (tokens[dp_rank * per:(dp_rank + 1) * per], targets[dp_rank * per:(dp_rank + 1) * per])
            self.dp_group = mesh.get_group("dp")
            self.dp_size = dp_size
        else:
            model_name = model_of(name)
            plan = name.split()[-1]
            kwargs: dict[str, Any] = {}
            if plan != "free":
                kwargs = {"constraints": TP_PLANS[model_name][plan], "data_axes": ("dp",)}
            model, tokens, targets = build(args, model_name)
            self.module = autopar.compile(model, mesh, (tokens,), loss_fn=lm_loss, example_targets=(targets,),
                                          **{"pipeline": False, **kwargs})
            self.inputs = (tokens, targets)
            plan_ = self.module.plan
            self.planned = {"collectives": len(plan_.collectives), "predicted_step_s": plan_.predicted.step_time_s,
                            "predicted_compute_s": plan_.predicted.compute_time_s,
                            "predicted_comm_s": plan_.predicted.comm_time_s, "hardware": plan_.mesh["hardware"]}
        self.setup_s = time.perf_counter() - t0
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR)

    def step(self) -> torch.Tensor:
        if self.name.startswith("hand"):
            tokens, targets = self.inputs
            loss = lm_loss(self.module(tokens), targets)
        else:
            loss = self.module(*self.inputs)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def global_loss(self, loss: torch.Tensor) -> float:
        if isinstance(loss, DTensor):  # autopar: replicated global mean
            return loss.to_local().item()
        value = loss.detach().clone()
        dist.all_reduce(value, group=self.dp_group)  # hand: mean of the dp halves' means
        return value.item() / self.dp_size


# --------------------------------------------------------------------------- per rank

def reference_losses(args: argparse.Namespace, model_name: str) -> list[float]:
    model, tokens, targets = build(args, model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for _ in range(args.check_steps):
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", tuple(MESH.values()), mesh_dim_names=tuple(MESH))
    variants = [Variant(name, args, mesh) for name in args.variants]
    out: dict[str, Any] = {v.name: {"setup_s": v.setup_s, "losses": [], "times_s": [], "planned": v.planned}
                           for v in variants}
    for v in variants:
        for i in range(max(args.warmup, args.check_steps)):
            loss = v.step()
            if i < args.check_steps:
                out[v.name]["losses"].append(v.global_loss(loss))
    for v in variants:
        out[v.name]["cpu_s"] = []
    for _ in range(args.reps):
        for v in variants:
            gc.collect()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                v.step()
            cpu = time.process_time() - c0  # this rank's CPU time, all threads (gloo's included)
            dist.barrier()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            out[v.name]["times_s"].append(elapsed.item() / args.steps)
            out[v.name]["cpu_s"].append(cpu / args.steps)
    if args.profile and any(v.name == "autopar tp" for v in variants):
        out["profile"] = profile_step(rank, next(v for v in variants if v.name == "autopar tp"),
                                      next((v for v in variants if v.name == "hand tp + ddp"), None))
    return out


def profile_step(rank: int, auto: Variant, hand: Variant | None) -> dict[str, str]:
    import cProfile
    import io
    import pstats

    result = {}
    for v in (auto, hand):
        if v is None:
            continue
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for _ in range(5):
            v.step()
        prof.disable()
        dist.barrier()
        if rank == 0:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            buf.write("\n--- cumulative ---\n")
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
            result[v.name] = buf.getvalue()
    return result


# --------------------------------------------------------------------------- report

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-steps", type=int, default=3, help="steps whose losses are checked against 1 device")
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=2, help="Llama key/value heads")
    ap.add_argument("--ffn", type=int, default=256, help="Llama feed-forward width")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--profile", action="store_true", help="cProfile 5 steps of autopar tp and hand tp + ddp")
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    return args


def make_rows(args: argparse.Namespace, results: list[dict[str, Any]], refs: dict[str, list[float]],
              cpu_share: float) -> list[dict[str, Any]]:
    """One row per variant: times, losses checked against one device, ratios to the hand
    plan and to the prediction. ``cpu_share``: ranks / cores (the CPU-bound estimate's factor)."""
    r0 = results[0]
    medians = {name: statistics.median(r0[name]["times_s"]) for name in args.variants}
    hand = [(m, n) for n, m in medians.items() if n.startswith("hand")]
    rows = []
    for name in args.variants:
        ref = refs[model_of(name)]
        ok = (all(math.isclose(r[name]["losses"][0], ref[0], rel_tol=1e-5) for r in results)
              and all(math.isclose(a, b, rel_tol=1e-4) for r in results for a, b in zip(r[name]["losses"], ref)))
        against = min(hand)[1] if name == "autopar free" and hand else PAIRS.get(name)
        ratio = medians[name] / medians[against] if against in medians else None
        ratio_min = min(r0[name]["times_s"]) / min(r0[against]["times_s"]) if against in medians else None
        # CPU-bound estimate: mean over ranks of each rank's median CPU time per step, x ranks / cores.
        cpu_est = statistics.mean(statistics.median(r[name]["cpu_s"]) for r in results) * cpu_share
        planned = r0[name]["planned"]
        predicted = planned.get("predicted_step_s")
        rows.append({"variant": name, "model": model_of(name), "median_step_s": medians[name],
                     "min_step_s": min(r0[name]["times_s"]), "times_s": r0[name]["times_s"],
                     "cpu_estimate_step_s": cpu_est, "cpu_s_per_rank": [r[name]["cpu_s"] for r in results],
                     "setup_s": max(r[name]["setup_s"] for r in results),
                     "losses": r0[name]["losses"], "autopar_plan": planned, "loss_matches_single_device": ok,
                     "vs": against, "ratio": ratio, "ratio_of_mins": ratio_min,
                     "measured_over_predicted": medians[name] / predicted if predicted else None,
                     "cpu_estimate_over_predicted": cpu_est / predicted if predicted else None})
    return rows


def render(args: argparse.Namespace, rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=f"runtime overhead: GPT / Llama h{args.hidden} x{args.layers}L vocab {args.vocab}, batch "
                        f"{args.batch} x seq {args.seq}, fp32, mesh dp=2 x tp=2 (gloo, CPU)")
    for column in ("variant", "median ms/step", "min ms/step", "cpu est. ms", "predicted ms",
                   "measured / predicted (cpu est.)", "setup s", "losses = 1 device", "autopar / hand (median)",
                   "plan collectives"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for row in rows:
        ratio = "" if row["ratio"] is None else (f"{row['ratio']:.2f} (mins {row['ratio_of_mins']:.2f}) "
                                                 f"vs {row['vs']}")
        planned = row["autopar_plan"]
        table.add_row(row["variant"], f"{1e3 * row['median_step_s']:.1f}", f"{1e3 * row['min_step_s']:.1f}",
                      f"{1e3 * row['cpu_estimate_step_s']:.1f}",
                      f"{1e3 * planned['predicted_step_s']:.1f}" if planned else "",
                      f"{row['measured_over_predicted']:.2f} ({row['cpu_estimate_over_predicted']:.2f})"
                      if planned else "",
                      f"{row['setup_s']:.1f}", "yes" if row["loss_matches_single_device"] else "[red]NO[/red]",
                      ratio, str(planned["collectives"]) if planned else "")
    return table


def main() -> None:
    args = parse_args()
    from rich.console import Console

    console = Console(width=200)
    world = math.prod(MESH.values())
    cores = os.cpu_count() or 1
    refs = {m: reference_losses(args, m) for m in sorted({model_of(n) for n in args.variants})}
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = run_ranks(rank_main, world, args, timeout_s=TIMEOUT_S)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()[0]
    rows = make_rows(args, results, refs, max(world / cores, 1.0))
    console.print(render(args, rows))
    for model_name, ref in refs.items():
        console.print(f"{model_name} single-device losses (steps 0..{args.check_steps - 1}): "
                      + ", ".join(f"{x:.6f}" for x in ref))
    console.print(f"{args.reps} repetitions x {args.steps} timed steps after {max(args.warmup, args.check_steps)} "
                  f"warm-up steps per variant; wall {wall:.1f} s; 1-min load average {load_before:.1f} before, "
                  f"{load_after:.1f} after ({world} ranks on {cores} cores)")
    if not all(row["loss_matches_single_device"] for row in rows):
        console.print("[red]some variant's losses differ from the single-device model's[/red]")
    for name, text in results[0].get("profile", {}).items():
        console.print(f"\n[bold]cProfile, rank 0, 5 steps of {name}[/bold]")
        print(text)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "mesh": MESH, "backend": "gloo", "device": "cpu",
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "cpus": cores},
        "reference_losses": refs, "rows": rows, "wall_s": wall, "loadavg": [load_before, load_after],
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"wrote {args.json.relative_to(REPO_ROOT) if args.json.is_relative_to(REPO_ROOT) else args.json}")


if __name__ == "__main__":
    main()
