"""What dropout costs a step: the counter-based stream (each rank draws its own elements) against
the torch-generator stream (every rank draws the global tensor, ``random_stream='torch'``), and
against the same model without dropout.

Predicted (``autopar.plan`` on meta-device models, nothing runs; H100 profile, fp32, training):
HF GPT-2 small (12 layers, 768 wide, 12 heads, 1024 tokens, vocab 50257) and HF BERT-base
(``BertForMaskedLM``: 12 layers, 768, 12 heads, 512 tokens, vocab 30522), dropout 0.1 as the
models ship (hidden and attention probabilities), 8 sequences per device, on 8 (``dp=8``) and
64 (``dp=8 x tp=8``, the planner free on tp) devices. Per row: the predicted step with dropout
0, with dropout drawn by the counter stream, and by the torch stream. Then HF GPT-2 at
Megatron-LM's 1.7B shape (24 layers, 2304 wide, 24 heads, 2048 tokens, vocab 51200, global batch
512, dropout 0.1) on 32 A100s, data parallel (the planner free on memory), A100 profile's bf16,
with TFLOP/s per GPU by Megatron's count beside the 137 Megatron measured with dropout.

Measured (``--measure``, CPU): the example GPT (``examples/gpt.py``: 2 layers, 256 wide, 8 heads,
256 tokens, dropout 0.1 on the residual stream and 0.1 on the attention probabilities), 16
sequences, compiled data-parallel on 4 forked gloo ranks, median seconds of a training step
(forward, backward, AdamW) over ``--steps`` steps after one warm-up, for each stream and
without dropout: wall time of the slowest rank, and CPU time x ranks / cores (the cpu
profile's clock, less disturbed by a shared machine's load), beside the cpu profile's prediction.
``--calibrate``: the eager draw alone (dropout masks of 4K-4M elements) against the cpu
profile's draw figures, and the same masks as the stream drew them before (whole-tensor ops).

Results (a shared 2-core machine, load 2-3, 12:00 UTC 2026-12-05; "before" is main at 6731ff8
through this same script). Predicted, GPT-2 8 / 64 devices: no dropout 211.8 / 211.7 ms,
counter 223.2 / 223.2 ms (before: 482.8 / 482.7), torch 244.4 / 472.6 ms; BERT 78.9 / 78.7,
counter 82.0 / 81.9 (before: 171.4 / 171.2), torch 88.0 / 151.4 ms. GPT-2 1.7B on 32 A100s: no
dropout 2.781 s (174 TFLOP/s), counter 3.185 s (152 TFLOP/s, x1.145; before: 16.657 s, 29
TFLOP/s), torch 6.233 s (78 TFLOP/s); Megatron measured 137. The 0.404 s the counter stream adds
to the 1.7B step is its mask work, nearly all on the attention probabilities (16 x 24 x 2048^2
= 1.6e9 elements a layer on each GPU, drawn again in the 12 recomputed blocks): 0.149 s the
Philox instructions (a plan with free integer ops predicts 3.036 s), 0.227 s dropout's
arithmetic passes (x * keep * scale on the probabilities and the hidden states; 2.958 s without
them), the rest the masks' bytes and launches. The draw itself prices as the fused kernel
(``runtime.philox_triton``; about one pass over the rank's elements), not run on a GPU yet.
Measured on CPU, 4 gloo ranks, median of 5 steps, CPU x ranks / cores (wall): no dropout 381 ms
(777), counter 566 ms (1069; before: 614 ms, 1155), torch 800 ms (1536); predicted no dropout
432.5, counter 555.6 (before: 1156.4), torch 475.4 ms. The eager draw alone (``--calibrate``):
17-18 ns an element for 1-4M-element masks (before: 48-64 ns), the same as before up to 0.5M
elements; priced within 10% of measured at every size.

Usage: ``python benchmarks/random.py [--measure] [--steps N] [--calibrate] [--reps N] [--quick]
[--json out.json]`` (``--quick``: GPT-2 and BERT on 8 devices only, and the 1.7B row).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # make ``examples`` importable when run as a script

import autopar  # noqa: E402
from examples import gpt  # noqa: E402

MESHES = {8: {"dp": 8}, 64: {"dp": 8, "tp": 8}}
PER_DEVICE = 8


def _gpt2(p: float, batch: int) -> tuple[Any, tuple[torch.Tensor], dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257, resid_pdrop=p,
                     embd_pdrop=p, attn_pdrop=p, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(batch, 1024, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def _bert(p: float, batch: int) -> tuple[Any, tuple[torch.Tensor], dict[str, Any]]:
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                     vocab_size=30522, max_position_embeddings=512, hidden_dropout_prob=p,
                     attention_probs_dropout_prob=p, attn_implementation="sdpa")
    with torch.device("meta"):
        model = BertForMaskedLM(cfg)
    ids = torch.zeros(batch, 512, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


MODELS = {"gpt2": _gpt2, "bert": _bert}

MEGATRON_1_7B = {"layers": 24, "hidden": 2304, "heads": 24, "seq": 2048, "vocab": 51200, "batch": 512, "gpus": 32,
                 "published_tflops": 137.0}
"""Megatron-LM's 1.7B GPT row (Narayanan et al. 2021, arXiv 2104.04473, Table 1: 32 A100s, data
parallel only, global batch 512, with dropout), as ``benchmarks/memory_sweep.py`` takes it."""


def _gpt2_1_7b(p: float) -> tuple[Any, tuple[torch.Tensor], dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    m = MEGATRON_1_7B
    cfg = GPT2Config(n_layer=m["layers"], n_embd=m["hidden"], n_head=m["heads"], n_positions=m["seq"],
                     vocab_size=m["vocab"], resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False,
                     attn_implementation="sdpa")
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    ids = torch.zeros(m["batch"], m["seq"], dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def megatron_tflops(step_s: float) -> float:
    """TFLOP/s per GPU by Megatron's count (96 B s l h^2 (1 + s/6h + V/16lh): forward, backward
    and full recomputation) over ``step_s``, as the paper's figure is computed."""
    m = MEGATRON_1_7B
    b, s, layers, h, v = m["batch"], m["seq"], m["layers"], m["hidden"], m["vocab"]
    flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return flops / step_s / m["gpus"] / 1e12


def predicted_1_7b(p: float, stream: str) -> float:
    """HF GPT-2 at Megatron's 1.7B shape, dropout ``p`` in training, data parallel on 32 A100s
    (the planner free on memory: recomputation, ZeRO), at the profile's precision (bf16)."""
    model, inputs, kwargs = _gpt2_1_7b(p)
    model.train()
    mesh = autopar.Mesh({"dp": MEGATRON_1_7B["gpus"]}, hardware="a100")
    plan = autopar.plan(model, mesh, inputs, example_kwargs=kwargs, loss_fn=None, random_stream=stream,
                        data_axes=("dp",), pipeline=False)
    return plan.predicted.step_time_s


def row_1_7b() -> dict[str, Any]:
    t0 = time.perf_counter()
    row: dict[str, Any] = {"model": "gpt2-1.7b", "devices": MEGATRON_1_7B["gpus"],
                           "no_dropout_s": predicted_1_7b(0.0, "counter"), "counter_s": predicted_1_7b(0.1, "counter"),
                           "torch_s": predicted_1_7b(0.1, "torch")}
    row["planning_s"] = time.perf_counter() - t0
    row["counter_ratio"] = row["counter_s"] / row["no_dropout_s"]
    print(f"gpt2 1.7B {row['devices']} A100s: no dropout {row['no_dropout_s']:.3f} s "
          f"({megatron_tflops(row['no_dropout_s']):.0f} TFLOP/s), counter {row['counter_s']:.3f} s "
          f"({megatron_tflops(row['counter_s']):.0f} TFLOP/s, x{row['counter_ratio']:.3f}), torch {row['torch_s']:.3f} s "
          f"({megatron_tflops(row['torch_s']):.0f} TFLOP/s); Megatron measured {MEGATRON_1_7B['published_tflops']:.0f}",
          flush=True)
    return row


def predicted(model_name: str, devices: int, p: float, stream: str) -> float:
    model, inputs, kwargs = MODELS[model_name](p, PER_DEVICE * devices)
    model.train()
    mesh = autopar.Mesh(MESHES[devices], hardware="h100")
    plan = autopar.plan(model, mesh, inputs, example_kwargs=kwargs, loss_fn=None, precision="fp32",
                        random_stream=stream, data_axes=("dp",), pipeline=False)
    return plan.predicted.step_time_s


def predicted_rows(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for model_name in MODELS:
        for devices in ([8] if quick else list(MESHES)):
            t0 = time.perf_counter()
            row = {"model": model_name, "devices": devices,
                   "no_dropout_s": predicted(model_name, devices, 0.0, "counter"),
                   "counter_s": predicted(model_name, devices, 0.1, "counter"),
                   "torch_s": predicted(model_name, devices, 0.1, "torch")}
            row["planning_s"] = time.perf_counter() - t0
            print(f"{model_name:5} {devices:3} devices: no dropout {row['no_dropout_s'] * 1e3:8.1f} ms, "
                  f"counter {row['counter_s'] * 1e3:8.1f} ms, torch {row['torch_s'] * 1e3:8.1f} ms", flush=True)
            rows.append(row)
    rows.append(row_1_7b())
    return rows


def _measure_rank(rank: int, world: int, steps: int, variants: list[tuple[str, float, str]]) -> dict[str, Any]:
    """Per variant: each step's wall and CPU seconds on this rank, and the step the plan predicts."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    times: dict[str, Any] = {}
    for name, p, stream in variants:
        cfg = gpt.GPTConfig(vocab_size=512, max_seq_len=256, hidden=256, heads=8, layers=2, dropout=p, attn_dropout=p)
        model, inputs, loss_fn, targets = gpt.build(cfg, batch=16)
        pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, seed=0,
                             data_axes=("dp",), random_stream=stream, hardware="cpu", pipeline=False)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
        wall, cpu = [], []
        for _ in range(steps + 1):
            torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            pm(*inputs, *targets).backward()
            opt.step()
            opt.zero_grad()
            cpu.append(time.process_time() - c0)
            torch.distributed.barrier()
            wall.append(time.perf_counter() - t0)
        times[name] = {"wall": wall[1:], "cpu": cpu[1:], "predicted": pm.plan.predicted.step_time_s}
    return times


def measured_rows(steps: int) -> list[dict[str, Any]]:
    """Wall: the median over steps of the slowest rank's; CPU: the same of each rank's CPU seconds
    x ranks / cores (the cpu profile's clock: a step's time when the ranks keep the cores busy and
    nothing else runs), which a shared machine's load disturbs less."""
    from autopar.runtime.forked import run_ranks
    variants = [("no_dropout", 0.0, "counter"), ("counter", 0.1, "counter"), ("torch", 0.1, "torch")]
    world = 4
    results = run_ranks(_measure_rank, world, steps, variants, timeout_s=1800)
    share = world / (os.cpu_count() or 1)
    rows = []
    for name, _, _ in variants:
        wall = statistics.median(max(r[name]["wall"][i] for r in results) for i in range(steps))
        cpu = statistics.median(max(r[name]["cpu"][i] for r in results) for i in range(steps)) * share
        predicted = results[0][name]["predicted"]
        rows.append({"variant": name, "median_step_s": wall, "cpu_step_s": cpu, "predicted_s": predicted})
        print(f"{world} gloo ranks, {name:10}: {wall * 1e3:8.1f} ms a step wall, {cpu * 1e3:8.1f} ms CPU x ranks / "
              f"cores (median of {steps}); predicted {predicted * 1e3:8.1f} ms", flush=True)
    return rows


CALIBRATION_REGIONS = [  # (sizes, strides, offset): grouped whole tensors and rows, and one counter per element
    ((1 << 12,), (1,), 0), ((1 << 16,), (1,), 0), ((1 << 20,), (1,), 0), ((1 << 22,), (1,), 0),
    ((512, 1024), (2048, 1), 0), ((1 << 16,), (3,), 1), ((1 << 20,), (3,), 1),
]


def _calibrate_rank(rank: int, world: int, reps: int) -> list[list[float]]:
    """CPU seconds of the eager draw (a dropout mask) of each calibration region on this rank,
    the ranks drawing at once, with the ops it counts, and the same mask drawn as before:
    [ops, element-ops, seconds, seconds before] per region."""
    from autopar.philox_spec import Region, eager_draw_ops
    from autopar.runtime import philox_eager
    rows = []
    for sizes, strides, offset in CALIBRATION_REGIONS:
        region = Region(sizes, strides, offset)
        out = torch.empty(region.numel, dtype=torch.bool)
        philox_eager.draw((1, 2), (3, 0), region, "below", out, threshold=1 << 31)  # warm-up
        torch.distributed.barrier()
        times = []
        for _ in range(reps):
            t0 = time.process_time()
            philox_eager.draw((1, 2), (3, 0), region, "below", out, threshold=1 << 31)
            times.append(time.process_time() - t0)
        ops, element_ops = eager_draw_ops(region, "below")
        rows.append([float(ops), element_ops, statistics.median(times), _before(region, reps)])
    return rows


def _before(region: Any, reps: int) -> float:
    """CPU seconds of the same mask as the stream drew it before the chunked draw (main at
    6731ff8: ``row_words``/``element_words`` over the whole index tensor in whole-tensor int64
    ops, 12 a round, then the compare; the index built outside the clock): the reference
    implementation, ``runtime.philox``."""
    from autopar.runtime.philox import element_words, row_words
    counters = region.counters()
    shape = counters if counters is not None else region
    index = torch.arange(shape.sizes[-1]) * shape.strides[-1] + shape.offset
    if len(shape.sizes) > 1:
        index = (torch.arange(shape.sizes[0]) * shape.strides[0]).unsqueeze(1) + index
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        words = row_words(1 | 2 << 32, 3, index) if counters is not None else element_words(1 | 2 << 32, 3, index)
        (words < 1 << 31).view(-1)
        times.append(time.process_time() - t0)
    return statistics.median(times)


def calibrate(reps: int, world: int = 4) -> dict[str, Any]:
    """Fit the cpu profile's draw figures (``int_op_overhead``, ``int_op_rate``) as
    ``calibrate_ops.py`` fits its own: ``world`` forked ranks (one thread each) drawing at once,
    each rank's CPU time x ranks / cores, the median over ranks; a least-squares fit of
    ``seconds = ops * overhead + element_ops / rate``; then the profile's figures against it."""
    from autopar.hardware import get_profile
    from autopar.runtime.forked import run_ranks
    results = run_ranks(_calibrate_rank, world, reps, timeout_s=1800)
    share = world / (os.cpu_count() or 1)
    rows = [[results[0][i][0], results[0][i][1], statistics.median(r[i][2] for r in results) * share,
             statistics.median(r[i][3] for r in results) * share] for i in range(len(CALIBRATION_REGIONS))]
    # least squares on the two unknowns, weighted by 1/seconds (relative error)
    a = [[ops / t, element_ops / t] for ops, element_ops, t, _ in rows]
    b = [1.0] * len(rows)
    ata = [[sum(r[i] * r[j] for r in a) for j in range(2)] for i in range(2)]
    atb = [sum(r[i] * y for r, y in zip(a, b)) for i in range(2)]
    det = ata[0][0] * ata[1][1] - ata[0][1] * ata[1][0]
    overhead = (atb[0] * ata[1][1] - atb[1] * ata[0][1]) / det
    per_element_op = (ata[0][0] * atb[1] - ata[1][0] * atb[0]) / det
    hw = get_profile("cpu")
    print(f"fit: {overhead * 1e6:.2f} us per op, {1 / per_element_op / 1e9:.2f} G element-ops/s "
          f"(cpu profile: {hw.int_op_overhead * 1e6:.2f} us, {hw.int_op_rate / 1e9:.2f} G/s)")
    for (sizes, strides, _), (ops, element_ops, t, before) in zip(CALIBRATION_REGIONS, rows, strict=True):
        priced = ops * hw.int_op_overhead + element_ops / hw.int_op_rate if hw.int_op_rate else float("nan")
        print(f"  {sizes!s:14} stride {strides[-1]}: measured {t * 1e3:8.3f} ms, priced {priced * 1e3:8.3f} ms, "
              f"{t / math.prod(sizes) * 1e9:6.2f} ns an element (before: {before / math.prod(sizes) * 1e9:6.2f})")
    return {"overhead_s": overhead, "rate": 1 / per_element_op, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--predict", action="store_true", help="predicted rows (default unless --measure)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--calibrate", action="store_true", help="fit the cpu profile's eager-draw figures")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out: dict[str, Any] = {}
    if args.calibrate or args.measure:
        torch.set_num_threads(1)  # before any compute: forked children hang on an inherited OpenMP pool
    if args.calibrate:
        out["calibration"] = calibrate(args.reps)
    if args.predict or not (args.measure or args.calibrate):
        out["predicted"] = predicted_rows(args.quick)
    if args.measure:
        out["measured"] = measured_rows(args.steps)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
