"""The batch of a step's example values, and one micro-batch of them."""

from __future__ import annotations

from typing import Any

from autopar.errors import InputError


def slice_batch(values: Any, batch: int, micro_batches: int) -> Any:
    """The first micro-batch of example values: each tensor whose leading dim is the batch,
    cut to batch / micro_batches rows; other values as they are."""
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t[: batch // micro_batches] if t.ndim and t.shape[0] == batch
                         else t, values)


def example_batch(values: Any) -> int | None:
    """The batch size of example values: the leading dim of the first tensor that has one."""
    import torch
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.ndim:
            return int(leaf.shape[0])
    return None


def micro_batch_examples(examples: tuple[Any, Any, Any], batch: int | None, m: int, train: bool
                         ) -> tuple[Any, Any, Any]:
    """The example values (inputs, kwargs, targets) of one micro-batch: the step is captured at batch / m."""
    if m == 1:
        return examples
    if not train:
        raise InputError("micro_batches applies to training steps (train=True)")
    if batch is None or batch % m:
        raise InputError(f"micro_batches={m} must divide the batch (the leading dim of the first input"
                         f"{'' if batch is None else f', {batch}'})")
    return slice_batch(examples, batch, m)
