"""Which inputs of an op autograd saves for backward.

ZeRO-3 frees a parameter's gathered copy after its forward use and gathers it again for
each saved use in backward (``autopar.runtime.regather``). So a consuming edge costs a
backward all-gather exactly when its op saves that input (or a view of it: linear saves
``weight.t()``), and a ZeRO-2 parameter stays gathered until backward only through such
uses. Examples (checked in tests/test_numerics_zero.py against eager autograd):
``linear`` saves its weight (for the input's gradient) but not its bias; ``layer_norm``
saves weight and bias; ``rms_norm`` and ``mul`` save a factor when the other factor
needs a gradient; ``embedding`` saves only its indices, so its table is never regathered.

The answer is read off autograd itself: the op runs once on meta tensors (no data, no
compute) under ``saved_tensors_hooks`` that note which inputs, or views of them, get
saved. Results are cached per op, argument geometry and which inputs need gradients.

The same probe says what an op keeps besides its inputs (``saved_tensors``): its own
outputs (``gelu`` keeps its input, ``silu``'s consumer ``mul`` its factors, but
``log_softmax``, ``exp`` and SDPA keep their outputs) and tensors it makes inside and keeps
(a composite ``cross_entropy_loss`` keeps its ``log_softmax``, ``rms_norm`` its normalized
input, SDPA its log-sum-exp). That is the activation memory a training step holds from
forward to backward (``autopar.problem.saved_activations``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass(frozen=True)
class SavedTensors:
    """What autograd keeps of one op call for its backward."""

    inputs: tuple[bool, ...]
    """Per tensor argument (order as ``saved_inputs``): kept, itself or a view of it."""
    outputs: tuple[bool, ...]
    """Per tensor output (flattened): kept, itself or a view of it."""
    internal_bytes: int
    """Bytes of kept tensors that are neither an argument nor an output (each storage once)."""


_CACHE: OrderedDict[Any, SavedTensors] = OrderedDict()
"""Probe results by (op, argument geometry, tree structure, which inputs need gradients),
the least recently used dropped beyond ``_CACHE_SIZE`` (a long-lived process plans many models)."""
_CACHE_SIZE = 16384
"""Over 100x the distinct probes of a memory search of the Llama-3-8B shape on 8 H100s at 16 GiB
(125, captured at 1, 2, 4 and 8 micro-batches)."""


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _describe(value: Any) -> Any:
    """A hashable stand-in for one argument: tensors by geometry and dtype."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_describe(v) for v in value))
    return ("V", repr(value))


def saved_inputs(target: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None = None,
                 needs_grad: Sequence[bool] | None = None) -> tuple[bool, ...]:
    """For each tensor argument of ``target(*args, **kwargs)`` (positional ones first, inside
    lists too, then keyword ones: the order insert_reshards lists an op's tensor slots),
    whether autograd saves it, or a view of it, for backward.

    Tensors may be real, fake or meta; only their shapes and dtypes are read.
    ``needs_grad`` says which of them require a gradient (default: every floating one).
    """
    return saved_tensors(target, args, kwargs, needs_grad).inputs


def saved_tensors(target: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None = None,
                  needs_grad: Sequence[bool] | None = None) -> SavedTensors:
    """Which arguments and outputs of ``target(*args, **kwargs)`` autograd keeps for backward,
    and the bytes of what else it keeps (arguments as ``saved_inputs``)."""
    kwargs = kwargs or {}
    leaves, spec = tree_flatten((list(args), dict(kwargs)))
    tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if needs_grad is None:
        needs_grad = [leaves[i].is_floating_point() for i in tensor_at]
    if len(needs_grad) != len(tensor_at):
        raise ValueError(f"needs_grad has {len(needs_grad)} entries for {len(tensor_at)} tensor arguments")
    key = (target, _describe(leaves), str(spec), tuple(bool(g) for g in needs_grad))
    if key in _CACHE:  # the key is all tuples of strings, shapes and dtypes: it hashes
        _CACHE.move_to_end(key)
        return _CACHE[key]
    fused = _fused_attention(target, leaves, tensor_at, key[3])
    _CACHE[key] = found = fused if fused is not None else _probe(target, list(leaves), spec, key[3])
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return found


def _fused_attention(target: Callable[..., Any], leaves: list[Any], tensor_at: list[int],
                     needs_grad: tuple[bool, ...]) -> SavedTensors | None:
    """SDPA as the fused kernels run it (flash on CPU and GPU, memory-efficient): they keep
    q, k, v (and a mask), the output and a float32 log-sum-exp per query row. On meta
    tensors SDPA would take the math path, which keeps the attention matrix instead."""
    if target is not torch.ops.aten.scaled_dot_product_attention.default or not any(needs_grad):
        return None
    q = leaves[tensor_at[0]]
    rows = q.numel() // q.shape[-1] if q.ndim else 1
    return SavedTensors(tuple(True for _ in tensor_at), (True,), rows * 4)


def saves_input(target: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None, index: int,
                needs_grad: Sequence[bool] | None = None) -> bool:
    """Whether autograd saves the ``index``-th tensor argument (order as ``saved_inputs``)."""
    return saved_inputs(target, args, kwargs, needs_grad)[index]


def _probe(target: Callable[..., Any], leaves: list[Any], spec: Any, needs_grad: tuple[bool, ...]
           ) -> SavedTensors:
    inputs: list[torch.Tensor] = []
    grads = iter(needs_grad)
    for i, v in enumerate(leaves):
        if isinstance(v, torch.Tensor):
            t = torch.empty(tuple(v.shape), dtype=v.dtype, device="meta")
            leaves[i] = t.requires_grad_(next(grads) and t.is_floating_point())
            inputs.append(leaves[i])
    saved_roots: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_roots.append(_root(t))
        return t

    args, kwargs = tree_unflatten(leaves, spec)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op meta tensors cannot run (it reads data): assume it
        # saves every input, the side that never underprices memory; its outputs are counted
        # where a consumer saves them (or by op_cost's default: all of them)
        return SavedTensors(tuple(True for _ in inputs), (), 0)
    outputs = [_root(t) for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    known = [*inputs, *outputs]
    internal: dict[int, int] = {}
    for r in saved_roots:
        if not any(r is t for t in known):
            internal[id(r)] = r.untyped_storage().nbytes()
    return SavedTensors(tuple(any(r is t for r in saved_roots) for t in inputs),
                        tuple(any(r is t for r in saved_roots) for t in outputs), sum(internal.values()))


def saved_inputs_of_node(node: torch.fx.Node, needs_grad: Sequence[bool] | None = None) -> tuple[bool, ...]:
    """``saved_inputs`` of a call in a captured graph, its arguments read from ``meta["val"]``."""
    def val(a: torch.fx.Node) -> Any:
        return a.meta.get("val")
    return saved_inputs(node.target, torch.fx.node.map_arg(node.args, val),  # type: ignore[arg-type]
                        torch.fx.node.map_arg(node.kwargs, val), needs_grad)
