"""Train the example GPT with ``autopar.compile`` on a synthetic, learnable dataset.

Run on 4 CPU processes (gloo), as a 2 x 2 data x tensor mesh::

    torchrun --nproc-per-node 4 examples/train_gpt.py --mesh dp=2,tp=2

Options: ``--steps`` (200), ``--lr`` (3e-3), ``--batch`` (global batch, 16), ``--seq``
(sequence length, 32), ``--plan free|tp|tp_sp`` (default free: autopar chooses every
placement; ``tp`` / ``tp_sp`` pin the Megatron-style tensor-parallel plan, without / with
sequence parallelism, on the ``tp`` axis and plain data parallelism on ``dp``).

The data are token sequences drawn from a fixed random Markov (bigram) table: each token
has a handful of likely successors, so the loss falls from about ln(vocab) towards the
table's entropy (printed at the start). Every rank generates the same batches from the
same seed and passes the whole batch; autopar feeds each rank its part.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # ``examples`` importable when run as a script

import autopar  # noqa: E402
from autopar.mesh import parse_mesh_spec  # noqa: E402
from autopar.runtime.gloo import one_worker_per_group  # noqa: E402
from examples.gpt import GPT, TP_PLAN, TP_SP_PLAN, GPTConfig, lm_loss  # noqa: E402

PLANS = {"free": None, "tp": TP_PLAN, "tp_sp": TP_SP_PLAN}


class MarkovData:
    """Sequences from a fixed random bigram table; identical on every rank (seeded)."""

    def __init__(self, vocab: int, seed: int = 1234, successors: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        # Each token gets `successors` likely next tokens (random logits, sharpened) plus a
        # small floor for every other token.
        logits = torch.full((vocab, vocab), -4.0)
        nxt = torch.stack([torch.randperm(vocab, generator=g)[:successors] for _ in range(vocab)])
        logits.scatter_(1, nxt, 2.0 * torch.rand(vocab, successors, generator=g))
        self.table = logits.softmax(-1)
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed + 1)

    def entropy(self) -> float:
        """Mean conditional entropy (nats): the best loss a model can reach."""
        p = self.table
        return float(-(p * p.log()).sum(-1).mean())

    def batch(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = torch.empty(batch, seq + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(0, self.vocab, (batch,), generator=self.gen)
        for t in range(seq):
            toks[:, t + 1] = torch.multinomial(self.table[toks[:, t]], 1, generator=self.gen).squeeze(1)
        return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default="dp=2,tp=2", help="mesh spec, e.g. dp=2,tp=2 (product = world size)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--plan", choices=sorted(PLANS), default="free")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        one_worker_per_group()  # torch's two gloo workers per group race and can corrupt the heap
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = "cuda" if cuda else "cpu"
    axes = parse_mesh_spec(args.mesh)
    mesh = init_device_mesh(device, tuple(axes.values()), mesh_dim_names=tuple(axes))

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    say = console.print if rank == 0 else (lambda *a, **k: None)

    cfg = GPTConfig(vocab_size=args.vocab, max_seq_len=args.seq, hidden=args.hidden, heads=args.heads,
                    layers=args.layers, dropout=0.0)
    torch.manual_seed(0)  # same initial weights on every rank (autopar shards them)
    with torch.device(device):
        model = GPT(cfg)
    data = MarkovData(args.vocab)
    tokens, targets = data.batch(args.batch, args.seq)
    tokens, targets = tokens.to(device), targets.to(device)

    constraints = PLANS[args.plan]
    kwargs = {}
    if constraints is not None:
        kwargs["constraints"] = constraints
        if "dp" in axes:
            kwargs["data_axes"] = ("dp",)
    t0 = time.perf_counter()
    pm = autopar.compile(model, mesh, (tokens,), loss_fn=lm_loss, example_targets=(targets,), **kwargs)
    compile_s = time.perf_counter() - t0
    if rank == 0:
        print(pm.plan)  # placements by layer, collectives, predicted step time and memory
    n_params = sum(p.numel() for p in model.parameters())
    say(f"GPT: {n_params / 1e6:.2f}M parameters, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers; "
        f"plan '{args.plan}' on mesh {args.mesh}; compiled in {compile_s:.1f} s")
    say(f"loss at uniform guess ln(vocab) = {math.log(args.vocab):.3f}; data entropy (best reachable) = "
        f"{data.entropy():.3f}")

    opt = pm.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.0)  # whatever the plan shards or offloads
    losses: list[float] = []
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                        console=console, disable=rank != 0)
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=args.steps, loss="-")
        for step in range(args.steps):
            if step:
                tokens, targets = (t.to(device) for t in data.batch(args.batch, args.seq))
            loss = pm.step(tokens, targets)  # forward and backward of the step, pipelined or not
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.to_local().item()  # replicated: every rank holds the full value
            losses.append(value)
            progress.update(task, advance=1, loss=f"{value:.4f}")
    train_s = time.perf_counter() - t0
    say(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} "
        f"(mean of last 10: {sum(losses[-10:]) / len(losses[-10:]):.4f}); "
        f"{args.steps} steps in {train_s:.1f} s ({1e3 * train_s / args.steps:.1f} ms/step)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
