"""The forward at a large-vocabulary loss stays under the predicted peak, so it is not priced apart
(issue 31.3).

At the end of forward every saved activation is alive and the loss allocates its own transients:
the logits (a bf16 compute copy's, and their fp32 copy where the loss upcasts: ``logits.float()``)
and the log-probabilities ``log_softmax`` writes (saved for backward, so already counted). Beyond
what is saved the loss's forward holds one fp32 logits-sized tensor (fp32 logits) or one and a half
(bf16 logits and their fp32 copy). Its backward holds two fp32 logits-sized gradients beside the same
saved log-probabilities (``cost.backward``: nll_loss's and log_softmax's), and no parameter gradient
exists in either (one micro-batch: ``zero_grad`` left none, and none is made before the loss's
backward), so the backward row the peak already holds (``memory.backward``) is at least half a
logits tensor above the forward: measured with torch's ``MemTracker`` below, one fp32 logits (fp32)
and half of one (bf16 with the loss upcasting) under the predicted peak, which is the measured
step's peak within ``TOLERANCE``.

The case by hand: a linear head of V=8,192 words over 32 features, 1,024 tokens, fp32, one device.
Its forward allocates the logits and the log-probabilities (2 x 1,024 x 8,192 x 4 = 64 MiB) and two
scalars (the loss and nll_loss's total weight: 8 B); its backward adds the two gradients and frees
the logits (one more logits, 32 MiB, above the forward).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

import autopar
from examples import llama
from tests.test_backward_memory import Head

TOLERANCE = 0.01
"""Measured against predicted bytes: the prediction counts what the step allocates on CPU (eager,
one device) up to a few scalars."""
CPU = torch.device("cpu")

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _WithLoss(nn.Module):
    """The model and its loss as one module, so MemTracker's forward peak includes the loss's."""

    def __init__(self, model: nn.Module, loss_fn: Loss) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(x), y)


def _measure(model: nn.Module, loss_fn: Loss, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int, int, int]:
    """(bytes at the step's start, its forward's peak, its backward's, the whole step's) of one eager
    AdamW step after a first one (the optimizer's state exists, as in every step of a run)."""
    module = _WithLoss(model, loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        module(x, y).backward()
        opt.step()
        opt.zero_grad()

    step()
    tracker = MemTracker()
    tracker.track_external(module, opt, x, y)
    with tracker:
        start = tracker.get_tracker_snapshot()[CPU]["Total"]
        step()
    snapshots = tracker.memory_tracking[module].snapshots
    return (start, snapshots[_ModState.PEAK_FW][-1][CPU]["Total"], snapshots[_ModState.PEAK_BW][-1][CPU]["Total"],
            tracker.get_tracker_snapshot("peak")[CPU]["Total"])


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def _upcast_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: cross entropy over an fp32 copy of the (bf16) logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def test_head_forward_holds_logits_and_log_probabilities() -> None:
    """By hand (module docstring): the forward adds 64 MiB and 8 B, the backward one logits more; the
    predicted peak is the backward's, one logits above the forward."""
    torch.manual_seed(0)
    tokens, features, vocab = 1024, 32, 8192
    logits = tokens * vocab * 4
    head, x, labels = Head(features, vocab), torch.randn(tokens, features), torch.randint(0, vocab, (tokens,))
    plan = autopar.plan(head, autopar.Mesh({"dp": 1}, "cpu"), (x,), loss_fn=_cross_entropy,
                        example_targets=(labels,), pipeline=False)
    start, forward, backward, peak = _measure(head, _cross_entropy, x, labels)
    assert forward - start == 2 * logits + 8
    assert backward - start == 3 * logits + 8 and peak == backward
    assert plan.predicted.peak_memory_bytes - forward == pytest.approx(logits, abs=16)


@pytest.mark.parametrize(("dtype", "loss_fn", "below"), [
    (torch.float32, llama.lm_loss, 1.0),  # the logits; the log-probabilities are saved
    (torch.bfloat16, _upcast_loss, 0.5),  # bf16 logits and their fp32 copy: 1.5 of 2
], ids=["fp32", "bf16-upcast"])
def test_forward_at_the_loss_is_under_the_predicted_peak(dtype: torch.dtype, loss_fn: Loss, below: float) -> None:
    """A Llama whose 8,192-word loss over 512 tokens (16 MiB of fp32 logits) sets the step's peak: the
    measured peak is the predicted one, and the forward's is ``below`` fp32 logits under it."""
    cfg = llama.LlamaConfig(vocab_size=8192, max_seq_len=256, hidden=64, heads=4, kv_heads=2, ffn_hidden=128,
                            layers=1)
    model, inputs, _, targets = llama.build(cfg, batch=2)
    model = model.to(dtype)
    plan = autopar.plan(model, autopar.Mesh({"dp": 1}, "cpu"), inputs, loss_fn=loss_fn, example_targets=targets,
                        pipeline=False, precision="bf16" if dtype == torch.bfloat16 else "fp32")
    predicted = plan.predicted.peak_memory_bytes
    _, forward, backward, peak = _measure(model, loss_fn, inputs[0], targets[0])
    logits = 2 * 256 * 8192 * 4
    assert peak == backward and peak == pytest.approx(predicted, rel=TOLERANCE)
    assert predicted - forward == pytest.approx(below * logits, abs=TOLERANCE * predicted)
