"""The training step that is captured: model forward plus loss, as one module; the checks
on what the user hands in, and the calling convention the compiled step keeps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path

from autopar.errors import CaptureError, InputError, InputTypeError


_CONSTANT_TYPES = (bool, int, float, type(None))
"""Non-tensor values export can take as inputs (specialized into the graph)."""


def describe(value: Any) -> str:
    """What a value is, for error messages: a tensor's dtype and shape, not 'FakeTensor'."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}" + (f" (first: {describe(value[0])})" if value else "")
    if isinstance(value, dict):
        return f"a {type(value).__name__} with keys {sorted(map(str, value))}"
    return f"{value!r} ({type(value).__name__})" if isinstance(value, (str, *_CONSTANT_TYPES)) else type(value).__name__


def check_step_arguments(model: Any, example_inputs: Any, loss_fn: Any, example_kwargs: Any,
                         example_targets: Any) -> None:
    """Types of what ``plan``/``compile`` receive, checked before tracing so that a wrong
    builder return value is named instead of failing deep inside torch.export."""
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"the model must be a torch.nn.Module, got {describe(model)}")
    if loss_fn is not None and not callable(loss_fn):
        raise InputTypeError(f"loss_fn must be callable (or None when the model returns its loss), "
                             f"got {describe(loss_fn)}")
    if not isinstance(example_kwargs, dict) or not all(isinstance(k, str) for k in example_kwargs):
        raise InputTypeError(f"example_kwargs must be a dict of keyword name -> value, got {describe(example_kwargs)}")
    for what, values in (("example_inputs", example_inputs), ("example_targets", example_targets)):
        if not isinstance(values, tuple):
            raise InputTypeError(f"{what} must be a tuple (write (x,) for one tensor), got {describe(values)}")
    own = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for what, values in (("example_inputs", example_inputs), ("example_kwargs", example_kwargs),
                         ("example_targets", example_targets)):
        leaves, _ = tree_flatten_with_path(values)
        for path, leaf in leaves:
            if not isinstance(leaf, (torch.Tensor, *_CONSTANT_TYPES)):
                raise InputTypeError(f"{what}{keystr(path)} is {describe(leaf)}; inputs must be tensors (or tuples, "
                                     "lists or dicts of tensors, numbers, bools and None)")
            # export traces float64 values into the model's float32 matmuls, which eager refuses
            if what != "example_targets" and isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float64 \
                    and own and torch.float64 not in own:
                dtype = sorted(map(str, own))[0]
                raise InputError(f"{what}{keystr(path)} is {describe(leaf)}, but the model's parameters are "
                                 f"{', '.join(sorted(map(str, own)))}: pass it as the model computes (.to({dtype}))")


def loss_from_output(output: Any) -> torch.Tensor:
    """The scalar loss a model returned itself (a tensor, or an object with ``.loss``)."""
    loss = output["loss"] if isinstance(output, dict) and "loss" in output else getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        if loss is None and output is not None:
            got = f"{type(output).__name__} whose .loss is None (a Hugging Face model computes it only when called with labels=...)"
        elif loss is output:
            got = describe(output)
        else:
            got = f"{type(output).__name__} whose .loss is {describe(loss)}"
        raise CaptureError(
            f"loss_fn=None needs the model to return the scalar loss (a one-element tensor or an "
            f"object with .loss, as a Hugging Face model called with labels), but it returned {got}; "
            "pass loss_fn=... or train=False")
    return loss.reshape(())


@dataclass(frozen=True, kw_only=True)
class StepSignature:
    """How the captured step is called: ``model(*inputs, **kwargs)``, then ``loss_fn(out, *targets)``.

    The compiled module takes the same values: ``pm(*inputs, *targets, **kwargs)``; its
    program has one placeholder per leaf of ``(*inputs, *kwargs.values(), *targets)``.
    """

    num_inputs: int
    """Positional inputs of the model."""
    kwarg_names: tuple[str, ...]
    """Keyword inputs of the model, in the order they were captured."""
    num_targets: int
    """Positional inputs of the loss after the model's output."""
    spec: TreeSpec
    """Structure of the flat values (nested tuples, lists and dicts of inputs)."""
    labels: tuple[str, ...]
    """Per leaf, how the user names it: "input 0", "keyword input 'labels'", "target 0[1]"."""
    constants: dict[int, Any]
    """Leaf index -> the non-tensor value captured (export specializes the graph on it)."""
    tensors: dict[int, tuple[tuple[int, ...], torch.dtype]]
    """Leaf index -> shape and dtype a call must pass there: the program is specialized on
    them (view sizes, a mean loss's count). The captured (global) shape, or this rank's
    shard of it when each rank passes its own shard."""
    shard_note: str = ""
    """Why ``tensors`` differ from the captured shapes, for the error message ("" when they do not)."""
    micro_batches: int = 1
    """A step runs the program this many times, once per micro-batch (``pm.step``)."""
    batch_leaves: frozenset[int] = frozenset()
    """Leaves whose leading dim is the batch: a step takes them ``micro_batches`` times as
    long (the whole batch) and cuts them into micro-batches; other leaves go whole to each."""

    @classmethod
    def of(cls, inputs: tuple[Any, ...], kwargs: dict[str, Any], targets: tuple[Any, ...]) -> "StepSignature":
        names = [f"input {i}" for i in range(len(inputs))] + [f"keyword input {k!r}" for k in kwargs]
        names += [f"target {i}" for i in range(len(targets))]
        leaves, spec = tree_flatten_with_path((*inputs, *kwargs.values(), *targets))
        labels = tuple(names[path[0].idx] + keystr(path[1:]) for path, _ in leaves)  # type: ignore[attr-defined]
        values = [v for _, v in leaves]
        return cls(num_inputs=len(inputs), kwarg_names=tuple(kwargs), num_targets=len(targets), spec=spec,
                   labels=labels, constants={i: v for i, v in enumerate(values) if not isinstance(v, torch.Tensor)},
                   tensors={i: (tuple(v.shape), v.dtype) for i, v in enumerate(values) if isinstance(v, torch.Tensor)})

    def sharded(self, shapes: dict[int, tuple[int, ...]], note: str) -> "StepSignature":
        """The same signature taking this rank's shards: leaf index -> its local shape."""
        tensors = {i: (shapes.get(i, shape), dtype) for i, (shape, dtype) in self.tensors.items()}
        return replace(self, tensors=tensors, shard_note=note)

    def micro_batched(self, micro_batches: int, batch_leaves: frozenset[int]) -> "StepSignature":
        """The same signature for a step of ``micro_batches`` calls, cutting ``batch_leaves``."""
        return replace(self, micro_batches=micro_batches, batch_leaves=batch_leaves)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """``pm(*inputs, *targets, **kwargs)``'s values as the leaves the step was captured with."""
        leaves = self._flatten(args, kwargs)
        for index, value in enumerate(leaves):
            self._check_leaf(index, value, self.tensors.get(index, ((), None))[0])
        return leaves

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[Any]]:
        """``pm.step(...)``'s values (the whole batch) as one list of leaves per micro-batch:
        each batch leaf cut into ``micro_batches`` consecutive blocks of rows, in order, the
        other leaves passed whole to every micro-batch."""
        m = self.micro_batches
        leaves = self._flatten(args, kwargs)
        for index, value in enumerate(leaves):
            shape = self.tensors.get(index, ((), None))[0]
            if index in self.batch_leaves:
                shape = (shape[0] * m, *shape[1:])
            self._check_leaf(index, value, shape)
        return [[v.narrow(0, i * self.tensors[k][0][0], self.tensors[k][0][0]) if k in self.batch_leaves else v
                 for k, v in enumerate(leaves)] for i in range(m)]

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The call's values as the step's leaves, unchecked (``bind``/``split`` check them)."""
        return self._flatten(args, kwargs)

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        expected = self.num_inputs + self.num_targets
        if len(args) != expected:
            raise InputTypeError(f"expected {expected} positional value{'s' if expected != 1 else ''} "
                                 f"({self.num_inputs} model inputs, then {self.num_targets} loss targets), "
                                 f"got {len(args)}")
        missing = [n for n in self.kwarg_names if n not in kwargs]
        unexpected = [n for n in kwargs if n not in self.kwarg_names]
        if missing or unexpected:
            problems = [f"missing keyword input {n!r}" for n in missing]
            problems += [f"unexpected keyword input {n!r}" for n in unexpected]
            raise InputTypeError(f"{'; '.join(problems)}: the step was compiled with keyword inputs "
                                 f"{list(self.kwarg_names)} (example_kwargs)")
        flat = (*args[: self.num_inputs], *(kwargs[n] for n in self.kwarg_names), *args[self.num_inputs:])
        leaves, spec = tree_flatten(flat)
        if spec != self.spec:
            raise InputTypeError(f"the inputs are nested differently from the compiled step's: {spec} vs {self.spec}")
        return leaves

    def _check_leaf(self, index: int, value: Any, shape: tuple[int, ...]) -> None:
        """``value`` is the constant compiled at ``index``, or a tensor of ``shape`` and the compiled dtype."""
        if index in self.constants:
            if isinstance(value, torch.Tensor) or value != self.constants[index]:
                raise InputError(f"{self.labels[index]} was {self.constants[index]!r} at compile time and is "
                                 f"{describe(value)} now: non-tensor inputs are fixed when compiling")
        elif not isinstance(value, torch.Tensor):
            raise InputTypeError(f"{self.labels[index]} must be a tensor, as when compiled; got {describe(value)}")
        elif value.shape != shape or value.dtype != self.tensors[index][1]:
            self._wrong_tensor(index, value, shape)

    def _wrong_tensor(self, index: int, value: torch.Tensor, shape: tuple[int, ...]) -> None:
        dtype = self.tensors[index][1]
        step = ""
        if index in self.batch_leaves and self.micro_batches > 1:
            step = (f" (the whole batch of a step: {self.micro_batches} micro-batches of "
                    f"{self.tensors[index][0]}, as compiled with micro_batches={self.micro_batches})")
        raise InputError(
            f"{self.labels[index]} is {describe(value)}, but the step was compiled for a {dtype} tensor of shape "
            f"{shape}{step}{self.shard_note}: the program is specialized on the compiled shapes and dtypes (view "
            "sizes, a mean loss's count), so pass that, or compile again for this shape and dtype")


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
            raise CaptureError(f"loss_fn must return a one-element tensor, got {describe(loss)}")
        return loss.reshape(())
