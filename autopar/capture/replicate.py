"""Trace a few of a model's repeated blocks and replicate them in the graph.

torch.export costs ~75 ms per transformer block (an 80-layer model: seconds), and a deep
model is mostly a stack of identical blocks: an ``nn.ModuleList`` (or ``nn.Sequential``) of
one class with the same parameters, buffers and settings. ``capture`` traces the model with
that list cut to its first ``TRACED`` blocks, then ``replicate_graph`` copies the last traced
block's nodes once per missing block, wired as the traced blocks show block i+1 is wired to
block i. The checks here are on the modules, before any tracing (cheap); the graph's own
checks are in ``replicate_graph``. Whatever does not fit the pattern is traced in full.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputSpec

from autopar.capture.replicate_graph import Pattern, check, rebuild, split

TRACED = 3
"""Blocks traced: two show how block i+1 reads block i, a third that the wiring repeats."""
MIN_BLOCKS = 4
"""Fewer blocks than this are traced in full: replication would save (almost) nothing."""
ENV_SWITCH = "AUTOPAR_REPLICATE_BLOCKS"
"""Set to 0 to trace every block (debugging); ``capture(..., replicate_blocks=False)`` too."""

_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
"""``nn.Module.__dict__`` entries compared otherwise (tensors by shape, children by walk)."""


@dataclass(frozen=True)
class Stack:
    """The repeated blocks: ``path`` (FQN in the user's model, e.g. ``model.layers``) holds ``count``."""

    path: str
    container: nn.Module
    count: int
    indexed: tuple[tuple[str, str], ...] = ()
    """(submodule inside the block, attribute) where every block holds its own index (``layer_idx``)."""

    @property
    def label(self) -> str:
        return self.path or "the model"

    def note(self) -> str:
        return f"{self.label}: traced {TRACED} of {self.count} blocks, replicated the rest in the graph"


def enabled(replicate_blocks: bool) -> bool:
    return replicate_blocks and os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def find_stack(model: nn.Module) -> tuple[Stack | None, str | None]:
    """The model's largest list of identical blocks, or None and why not (None: no list of one
    class at all, nothing worth a note)."""
    candidates = []
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            children = list(module._modules.values())
            if all(c is not None and type(c) is type(children[0]) for c in children):
                size = sum(p.numel() for p in module.parameters())
                candidates.append((size, path, module))
    if not candidates:
        return None, None
    _, path, container = max(candidates, key=lambda c: c[0])
    if len(container) < MIN_BLOCKS:
        return None, f"blocks not replicated: {path or 'the model'} has {len(container)} blocks, " \
                     f"fewer than {MIN_BLOCKS}"
    indexed = _differences(list(container._modules.values()))
    why = indexed if isinstance(indexed, str) else _shares_tensors(model, container) or _reads_length(model, path)
    if why:
        return None, f"blocks not replicated: {path or 'the model'}: {why}"
    return Stack(path, container, len(container), tuple(indexed)), None


def _differences(blocks: list[nn.Module]) -> str | list[tuple[str, str]]:
    """How the blocks differ, or the attributes where each block holds its own index (Hugging
    Face's ``layer_idx``), the one difference allowed: ``shortened`` watches that the traced
    blocks' forwards do not use them."""
    signatures = [_signature(block) for block in blocks]
    first = signatures[0]
    for index, other in enumerate(signatures[1:], start=1):
        if [key for key, _ in other] != [key for key, _ in first]:
            return f"block {index} has other modules, tensors or attributes than block 0"
    indexed = []
    for position, (key, _) in enumerate(first):
        values = [signature[position][1] for signature in signatures]
        if all(v == values[0] for v in values):
            continue
        if isinstance(key, tuple) and values == [(int, i) for i in range(len(blocks))]:
            indexed.append(key)
            continue
        index = next(i for i, v in enumerate(values) if v != values[0])
        return f"block {index} differs from block 0 in {'.'.join(filter(None, key)) if isinstance(key, tuple) else key}"
    return indexed


def _signature(block: nn.Module) -> list[tuple[str | tuple[str, str], Any]]:
    """What must agree between blocks: module classes, tensors' names, shapes, dtypes and
    grad flags, and every plain attribute. Hooks make a block different (their effect on the
    graph is unknown, and export may not see them as a full trace would)."""
    out: list[tuple[str | tuple[str, str], Any]] = []
    for name, module in block.named_modules():
        out.append((name or "<block>", type(module)))
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks \
                or getattr(module, "_backward_pre_hooks", None) or module._state_dict_hooks:
            out.append((f"{name} hooks", _Opaque(module)))
        for key, value in module._parameters.items():
            out.append((f"{name}.{key}", _tensor(value)))
        for key, value in module._buffers.items():
            out.append((f"{name}.{key}", (_tensor(value), key in module._non_persistent_buffers_set)))
        for key, value in sorted(module.__dict__.items()):
            if key not in _MODULE_STATE and "hook" not in key:
                out.append(((name, key), _plain(value)))
    return out


def _tensor(value: torch.Tensor | None) -> tuple[Any, ...] | None:
    if value is None:
        return None
    return tuple(value.shape), value.dtype, value.requires_grad, type(value)


class _Opaque:
    """A value that cannot be compared: two blocks holding one are only equal if it is one object."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _plain(value: object, depth: int = 0) -> object:
    """``value`` as something blocks can compare; containers and helper modules are looked into
    two levels deep (a deeper one, or a cycle, compares by identity)."""
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(value), value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str, type(None))) for v in value):
        return (type(value), tuple(value))
    if depth >= 2:
        return _Opaque(value)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return (dict, tuple((k, _plain(v, depth + 1)) for k, v in sorted(value.items())))
    if isinstance(value, nn.Module) and _stateless(value):
        # A per-block helper module kept outside the module tree (Hugging Face's kernel
        # functions): alike when its class and plain attributes agree.
        return (type(value), tuple((k, _plain(v, depth + 1)) for k, v in sorted(value.__dict__.items())
                                   if k not in _MODULE_STATE and "hook" not in k))
    return _Opaque(value)  # configs, functions, shared objects: the same object in every block


def _stateless(module: nn.Module) -> bool:
    """No tensors, submodules or hooks: nothing of it reaches the graph but its code."""
    return not (module._parameters or module._buffers or module._modules or module._forward_hooks
                or module._forward_pre_hooks)


def _shares_tensors(model: nn.Module, container: nn.Module) -> str | None:
    """Whether a block's parameter or buffer is also another block's or the rest of the model's
    (tied weights): export names it once, under the first name, so copies would be wrong."""
    inside = [id(t) for _, t in (*container.named_parameters(remove_duplicate=False),
                                 *container.named_buffers(remove_duplicate=False))]
    if len(set(inside)) != len(inside):
        return "blocks share parameters or buffers"
    path = _path_of(model, container)
    outside = {id(t) for name, t in (*model.named_parameters(remove_duplicate=False),
                                     *model.named_buffers(remove_duplicate=False)) if not _under(name, path)}
    if outside & set(inside):
        return "a block's parameter is tied to one outside the blocks"
    return None


def _path_of(model: nn.Module, container: nn.Module) -> str:
    return next(path for path, module in model.named_modules() if module is container)


def _under(fqn: str, path: str) -> bool:
    return fqn.startswith(path + ".") if path else True


def _reads_length(model: nn.Module, path: str) -> str | None:
    """Whether the forward that owns the list reads its length (``len(self.layers)``, a scale or
    a last-block test): with the list cut, the traced value would be wrong. Read from the source,
    cheaply; a forward without source is assumed not to."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    try:
        source = inspect.getsource(type(parent).forward)
    except (OSError, TypeError):
        return None
    if re.search(rf"len\(\s*self\.{re.escape(attr)}\s*\)", source):
        return f"{type(parent).__name__}.forward reads len(self.{attr})"
    return None


class _WatchedIndex(int):
    """A block's index that records every use made of it (comparing, hashing, arithmetic,
    indexing, printing): a forward that branches on its block's index would trace differently
    for blocks that were not traced."""

    def __new__(cls, value: int, uses: list[str]) -> "_WatchedIndex":
        made = super().__new__(cls, value)
        made.value, made.uses = value, uses
        return made


def _recording(name: str) -> Any:
    def method(self: _WatchedIndex, *args: Any) -> Any:
        self.uses.append(name)
        return getattr(int, name)(self.value, *args)
    return method


for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__", "__index__",
              "__int__", "__float__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__mod__",
              "__floordiv__", "__truediv__", "__pow__", "__neg__", "__and__", "__or__", "__format__", "__str__",
              "__repr__"):
    setattr(_WatchedIndex, _name, _recording(_name))


@contextlib.contextmanager
def shortened(stack: Stack, keep: int = TRACED) -> Iterator[list[str]]:
    """The stack holds only its first ``keep`` blocks inside (the same container object, so
    every reference to it sees the cut), all of them again afterwards, whatever happens.
    Yields the uses the traced blocks' forwards made of their index attributes (``Stack.indexed``)."""
    container = stack.container
    full = container._modules
    blocks = list(full.values())[:keep]
    uses: list[str] = []
    watched = [(block.get_submodule(name), attr, i) for i, block in enumerate(blocks) for name, attr in stack.indexed]
    originals = [module.__dict__[attr] for module, attr, _ in watched]
    container.__dict__["_modules"] = OrderedDict(list(full.items())[:keep])
    try:
        for module, attr, i in watched:
            module.__dict__[attr] = _WatchedIndex(i, uses)
        yield uses
    finally:
        container.__dict__["_modules"] = full
        for (module, attr, _), original in zip(watched, originals):
            module.__dict__[attr] = original


def replicate(program: ExportedProgram, stack: Stack, step: nn.Module
              ) -> tuple[list[InputSpec], dict[str, torch.Tensor]] | str:
    """Rewrite ``program``'s graph (traced under ``shortened(stack)``) to hold all the stack's
    blocks. Returns the new input specs and the tensors of the new inputs (FQN in ``step`` ->
    the model's own parameter or buffer), or why the traced graph does not allow it (the
    program untouched)."""
    pattern = Pattern(stack.path)
    specs = list(program.graph_signature.input_specs)
    traced = split(program.graph_module.graph, specs, pattern, TRACED)
    if isinstance(traced, str):
        return traced
    why = check(traced, pattern)
    if why:
        return why
    new_specs = rebuild(program.graph_module, traced, specs, pattern, stack.count)
    known = {s.target for s in specs}
    tensors = {}
    for spec in new_specs:
        if spec.target not in known:
            module, _, name = spec.target.rpartition(".")  # type: ignore[union-attr]
            owner = step.get_submodule(module)
            tensors[spec.target] = owner._parameters.get(name, owner._buffers.get(name))  # type: ignore
    return new_specs, tensors  # type: ignore[return-value]


__all__ = ["replicate", "TRACED", "MIN_BLOCKS", "ENV_SWITCH", "Stack", "enabled", "find_stack", "shortened"]
