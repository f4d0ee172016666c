"""What a model must offer to be planned for serving, and the example inputs of its serving steps.

A servable model keeps its own KV cache and runs one program for both phases (the example Llama,
``examples/llama.py``, is one):

- ``setup_cache(slots, max_len)``: give the model a KV cache of ``slots`` sequences of up to
  ``max_len`` tokens, as module buffers (slots, max_len, kv heads, ...) on the weights' device (the meta
  device plans without allocating);
- ``forward(tokens, positions, slots)``: ``tokens`` and ``positions`` (batch, steps) int64,
  ``slots`` (batch,) int64: row b continues cache slot ``slots[b]`` at ``positions[b]``.

A prefill chunk is batch 1 x ``chunk`` steps; a decode step is batch = requests x 1 step. Planning calls
``setup_cache`` for every step it plans (up to 128 slots of the longest request): a model with real weights
then allocates those caches, so build large models on the meta device; the model is left with the last
planned step's cache (call ``setup_cache`` again before serving). Hugging
Face causal LMs keep their cache outside the module; ``plan_serving`` and ``compile_serving`` take one
as it is, through ``autopar.hf.servable`` (slot-indexed cache buffers behind a transformers ``Cache``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.errors import InputError, InputTypeError

_FORWARD_ARGS = ("tokens", "positions", "slots")
KV_HEADS_DIM = 2
"""The KV heads' dim of a cache buffer (slots, max_len, kv heads, ...): split under TP where they divide."""


def check_servable(model: Any) -> None:
    """Raise an ``InputError`` saying what is missing when ``model`` is not servable (module docstring)."""
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"plan_serving needs an nn.Module, got {type(model).__name__}")
    setup = getattr(model, "setup_cache", None)
    if not callable(setup):
        raise InputError(f"{type(model).__name__} is not servable: it has no setup_cache(slots, max_len) method "
                         "(a servable model keeps its KV cache as buffers and runs forward(tokens, positions, slots); "
                         "see autopar/serving/servable.py and examples/llama.py)")
    try:
        params = inspect.signature(setup).parameters
        setup_ok = len(params) >= 2
        forward_ok = len([p for p in inspect.signature(model.forward).parameters.values()
                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= len(_FORWARD_ARGS)
    except (TypeError, ValueError):  # builtins without signatures: let the first call tell
        return
    if not setup_ok:
        raise InputError(f"{type(model).__name__}.setup_cache must take (slots, max_len)")
    if not forward_ok:
        raise InputError(f"{type(model).__name__}.forward must take (tokens, positions, slots) to be servable: "
                         "a serving step names each row's positions and cache slot")


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's weights (the meta device for a model built to plan only)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """One serving step to plan: ``batch`` rows of ``steps`` new tokens over a cache of ``max_len``."""

    batch: int
    """Rows: 1 for a prefill chunk, the requests for a decode step."""
    steps: int
    """New tokens per row: the chunk's for prefill, 1 for decode."""
    max_len: int
    """Cache positions per slot: the context each row attends over (its new tokens included)."""

    @property
    def tokens(self) -> int:
        return self.batch * self.steps

    @property
    def pairs(self) -> int:
        """(query, key) pairs the step's program computes: every new token against its row's
        whole cache (the mask is applied, not skipped)."""
        return self.tokens * self.max_len

    @property
    def context_tokens(self) -> int:
        """KV-cache tokens the step reads: every row's whole slot."""
        return self.batch * self.max_len


def step_inputs(model: nn.Module, shape: StepShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``model`` a cache for ``shape`` and return its step's (tokens, positions, slots): each row
    at the end of its context (positions max_len - steps .. max_len - 1), as a step that fills the cache."""
    if shape.steps > shape.max_len:
        raise InputError(f"a step of {shape.steps} tokens does not fit a cache of {shape.max_len} positions")
    try:
        model.setup_cache(shape.batch, shape.max_len)  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - the user's method: say which call failed
        raise InputError(f"{type(model).__name__}.setup_cache({shape.batch}, {shape.max_len}) raised "
                         f"{type(exc).__name__}: {exc}") from exc
    device = model_device(model)
    start = shape.max_len - shape.steps
    positions = torch.arange(start, shape.max_len, device=device).expand(shape.batch, shape.steps)
    tokens = torch.zeros(shape.batch, shape.steps, dtype=torch.long, device=device)
    slots = torch.arange(shape.batch, device=device)
    return tokens, positions.contiguous(), slots


def cache_buffers(model: nn.Module, shape: StepShape) -> dict[str, torch.Tensor]:
    """The model's KV-cache buffers after ``step_inputs(model, shape)``: those whose leading dims are
    (slots, max_len). Each holds ``prod(shape[2:])`` elements per token."""
    found = {name: b for name, b in model.named_buffers()
             if b.dim() >= 2 and tuple(b.shape[:2]) == (shape.batch, shape.max_len)}
    if not found:
        raise InputError(f"{type(model).__name__}.setup_cache({shape.batch}, {shape.max_len}) made no buffer of "
                         f"leading shape ({shape.batch}, {shape.max_len}): a servable model keeps its KV cache as "
                         "buffers (slots, max_len, ...)")
    return found


def kv_bytes_per_token(buffers: dict[str, torch.Tensor]) -> int:
    """KV-cache bytes one token takes over every cache buffer (all layers, keys and values)."""
    return sum(math.prod(b.shape[2:]) * b.element_size() for b in buffers.values())
