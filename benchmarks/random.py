"""What dropout costs a step: the counter-based stream (each rank draws its own elements) against
the torch-generator stream (every rank draws the global tensor, ``random_stream='torch'``), and
against the same model without dropout.

Predicted (``autopar.plan`` on meta-device models, nothing runs; H100 profile, fp32, training):
HF GPT-2 small (12 layers, 768 wide, 12 heads, 1024 tokens, vocab 50257) and HF BERT-base
(``BertForMaskedLM``: 12 layers, 768, 12 heads, 512 tokens, vocab 30522), dropout 0.1 as the
models ship (hidden and attention probabilities), 8 sequences per device, on 8 (``dp=8``) and
64 (``dp=8 x tp=8``, the planner free on tp) devices. Per row: the predicted step with dropout
0, with dropout drawn by the counter stream, and by the torch stream.

Measured (``--measure``, CPU): the example GPT (``examples/gpt.py``: 2 layers, 256 wide, 8 heads,
256 tokens, dropout 0.1 on the residual stream and 0.1 on the attention probabilities), 16
sequences, compiled data-parallel on 4 forked gloo ranks, median seconds of a training step
(forward, backward, AdamW) over ``--steps`` steps after one warm-up, for each stream and
without dropout. On a shared machine the medians are noisy: run it idle.

Results (a loaded 2-core machine, 22:00 UTC 2026-12-04): predicted, GPT-2 8 / 64
devices: no dropout 211.8 / 211.7 ms, counter 482.8 / 482.7 ms, torch 244.4 / 472.6 ms; BERT
78.9 / 78.7, counter 171.4 / 171.2, torch 88.0 / 151.4 ms. The counter stream's draw is the
same per device at any device count (its own elements), the torch stream's grows with the
devices; as it runs today (eager int64 ops: about 120 passes over a quarter of the elements)
it costs more than the global draw up to about 64 devices on a GPU, where one fused kernel
would cost a few percent (not done). Measured on CPU, 4 gloo ranks, median of 5 steps: no
dropout 2.46 s, counter 4.49 s, torch 5.39 s.

Usage: ``python benchmarks/random.py [--measure] [--steps N] [--quick] [--json out.json]``
(``--quick``: 8 devices only).
"""

from __future__ import annotations

import argparse
import json
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


def predicted(model_name: str, devices: int, p: float, stream: str) -> float:
    model, inputs, kwargs = MODELS[model_name](p, PER_DEVICE * devices)
    model.train()
    mesh = autopar.Mesh(MESHES[devices], hardware="h100")
    plan = autopar.plan(model, mesh, inputs, example_kwargs=kwargs, loss_fn=None, precision="fp32",
                        random_stream=stream, data_axes=("dp",))
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
    return rows


def _measure_rank(rank: int, world: int, steps: int, variants: list[tuple[str, float, str]]) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    times: dict[str, list[float]] = {}
    for name, p, stream in variants:
        cfg = gpt.GPTConfig(vocab_size=512, max_seq_len=256, hidden=256, heads=8, layers=2, dropout=p, attn_dropout=p)
        model, inputs, loss_fn, targets = gpt.build(cfg, batch=16)
        pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, seed=0,
                             data_axes=("dp",), random_stream=stream, hardware="cpu")
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
        elapsed = []
        for _ in range(steps + 1):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            pm(*inputs, *targets).backward()
            opt.step()
            opt.zero_grad()
            torch.distributed.barrier()
            elapsed.append(time.perf_counter() - t0)
        times[name] = elapsed[1:]
    return times


def measured_rows(steps: int) -> list[dict[str, Any]]:
    from autopar.runtime.forked import run_ranks
    variants = [("no_dropout", 0.0, "counter"), ("counter", 0.1, "counter"), ("torch", 0.1, "torch")]
    results = run_ranks(_measure_rank, 4, steps, variants, timeout_s=1800)
    rows = []
    for name, _, _ in variants:
        median = statistics.median(max(r[name][i] for r in results) for i in range(steps))  # the slowest rank
        rows.append({"variant": name, "median_step_s": median})
        print(f"4 gloo ranks, {name:10}: {median * 1e3:8.1f} ms a step (median of {steps})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--predict", action="store_true", help="predicted rows (default unless --measure)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out: dict[str, Any] = {}
    if args.predict or not args.measure:
        out["predicted"] = predicted_rows(args.quick)
    if args.measure:
        out["measured"] = measured_rows(args.steps)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
