"""The training step that is captured: model forward plus loss, as one module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class CaptureError(RuntimeError):
    """The model (or its loss) cannot be turned into a graph; the message names why and where."""


def loss_from_output(output: Any) -> torch.Tensor:
    """The scalar loss a model returned itself (a tensor, or an object with ``.loss``)."""
    loss = getattr(output, "loss", output)
    if isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        kind = type(output).__name__
        raise CaptureError(
            f"loss_fn=None needs the model to return the scalar loss (a one-element tensor or an "
            f"object with .loss, as a Hugging Face model called with labels), but it returned {kind}; "
            "pass loss_fn=... or train=False")
    return loss.reshape(())


class TrainStep(nn.Module):
    """``loss_fn(model(*inputs, **kwargs), *targets)`` as a module, so export sees the loss.

    With ``train=False`` the step is the model's forward alone.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 num_inputs: int, kwarg_names: tuple[str, ...], train: bool) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs
        self.kwarg_names = kwarg_names
        self.train_step = train

    def forward(self, *flat: Any) -> Any:
        inputs = flat[: self.num_inputs]
        kwargs = dict(zip(self.kwarg_names, flat[self.num_inputs: self.num_inputs + len(self.kwarg_names)]))
        targets = flat[self.num_inputs + len(self.kwarg_names):]
        output = self.model(*inputs, **kwargs)
        if not self.train_step:
            return output
        if self.loss_fn is None:
            return loss_from_output(output)
        loss = self.loss_fn(output, *targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise CaptureError(f"loss_fn must return a one-element tensor, got {type(loss).__name__}")
        return loss.reshape(())
