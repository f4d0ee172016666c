"""Greedy generation on a serving deployment's two steps: chunked prefill into cache slots, then
decode steps of every slot at once (the slot mapping of the example Llama's ``KVCache`` and vLLM).

A step is called ``step(tokens, positions, slots)``: row b continues cache slot ``slots[b]`` at
``positions[b]``. Prefill runs one request's prompt in chunks of the compiled length; the last
chunk is padded. The padding rows write the slot's cache at the first position after the prompt,
which no real row can see (each row attends to the positions up to its own) and which the first
decode step writes (its token sits there) before any query reads it; so padding changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar.errors import InputError

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]
"""A serving step: (tokens, positions, slots) -> logits (batch, steps, vocab), a tensor or DTensor."""


@dataclass(kw_only=True)
class Generation:
    """What ``generate`` produced."""

    tokens: list[list[int]]
    """The new tokens of each prompt, in order (``max_new_tokens`` each)."""
    logits: list[torch.Tensor] = field(default_factory=list)
    """Per generated token, the logits it was chosen from: (prompts, vocab), fp32, whole."""


def whole(logits: Any) -> torch.Tensor:
    """A step's logits as one whole local tensor (a DTensor split over ranks is gathered)."""
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    logits = getattr(logits, "logits", logits)  # a Hugging Face model output
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def generate(prefill: Step, decode: Step, prompts: list[list[int]], max_new_tokens: int, *, chunk: int,
             slots: int, max_len: int | None = None, pad_token: int = 0) -> Generation:
    """Greedy tokens for each prompt: prompt i prefilled into cache slot i (``chunk`` tokens a
    step, as ``prefill`` was compiled), then ``max_new_tokens - 1`` decode steps over all ``slots``
    (as ``decode`` was compiled; slots without a prompt compute a throwaway token at their position 0).
    ``ServingModule.prefill``/``.decode`` or a single-device model called the same way. ``max_len``
    (the cache's positions per slot), when given, refuses prompts that would run past it."""
    if not prompts or len(prompts) > slots or any(not p for p in prompts):
        raise InputError(f"generate takes 1 to {slots} (the decode step's slots) non-empty prompts, "
                         f"got {len(prompts)} of lengths {[len(p) for p in prompts]}")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    # the last token fed sits at position len + max_new_tokens - 2; padding at len (< max_len)
    longest = max(len(p) + max(max_new_tokens - 1, 1) for p in prompts)
    if max_len is not None and longest > max_len:
        raise InputError(f"a prompt of {max(len(p) for p in prompts)} tokens and {max_new_tokens} new ones need "
                         f"{longest} cache positions; the cache holds {max_len} per slot")
    out = Generation(tokens=[[] for _ in prompts])
    last = [_prefill_one(prefill, prompt, slot, chunk, pad_token) for slot, prompt in enumerate(prompts)]
    out.logits.append(torch.stack(last).float())
    for i, row in enumerate(last):
        out.tokens[i].append(int(row.argmax()))
    lengths = [len(p) for p in prompts]
    for step in range(max_new_tokens - 1):
        tokens = torch.zeros(slots, 1, dtype=torch.long)
        positions = torch.zeros(slots, 1, dtype=torch.long)
        for i, generated in enumerate(out.tokens):
            tokens[i, 0], positions[i, 0] = generated[-1], lengths[i] + step
        logits = whole(decode(tokens, positions, torch.arange(slots)))[: len(prompts), -1]
        out.logits.append(logits.float())
        for i, row in enumerate(logits):
            out.tokens[i].append(int(row.argmax()))
    return out


def _prefill_one(prefill: Step, prompt: list[int], slot: int, chunk: int, pad_token: int) -> torch.Tensor:
    """Run ``prompt`` into cache ``slot`` chunk by chunk; the logits after its last token (vocab,)."""
    length = len(prompt)
    logits = torch.empty(0)
    for start in range(0, length, chunk):
        real = prompt[start:start + chunk]
        tokens = torch.tensor([real + [pad_token] * (chunk - len(real))])
        # padding sits at the first position after the prompt: hidden from the prompt's rows, written by decode
        positions = torch.tensor([[min(p, length) for p in range(start, start + chunk)]])
        logits = whole(prefill(tokens, positions, torch.tensor([slot])))[0, len(real) - 1]
    return logits
