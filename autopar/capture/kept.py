"""Captures kept for the process: a model planned or compiled before is not traced again.

``autopar.plan`` then ``autopar.compile`` of one model, or ``compile`` again with a saved plan or
other options, capture the same step: export traces shapes, never values, so the graph of a model
object whose structure has not changed, called with arguments of the same shapes, dtypes and
devices (``export._reuse_key``), is the graph captured before. Each model keeps its last few
captures (weakly: a model dropped drops them), each with the model's ``fingerprint`` when it was
traced; a model whose fingerprint changed since (a module swapped, a parameter reshaped or frozen,
a mode, hyperparameter or config attribute changed, a forward replaced) is traced again. Nothing
else is skipped: every rank still captures (here or by tracing) and the ranks agree on the
capture's hash, and every plan is checked as before.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable

from torch import nn

from autopar.capture.graph import CapturedGraph

KEPT_PER_MODEL = 4
"""Captures kept per model (its step at a few micro-batch sizes or argument shapes)."""

_KEPT: weakref.WeakKeyDictionary[nn.Module, OrderedDict[Hashable, tuple[Hashable, CapturedGraph]]] = \
    weakref.WeakKeyDictionary()

_PLAIN = (bool, int, float, str, type(None))


def fingerprint(model: nn.Module) -> Hashable:
    """What of ``model`` a trace can read besides tensor values: each module's type, mode, plain
    attributes (ints, floats, strings, tuples of them), the repr of any ``config`` it holds (a Hugging
    Face model's), a forward set on the instance, and each parameter's and buffer's name, shape, dtype,
    device and ``requires_grad``."""
    configs: dict[int, str] = {}
    modules = []
    for path, module in model.named_modules():
        attrs = []
        for name, value in vars(module).items():
            if name.startswith("_") or name == "training":
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                attrs.append((name, value))
            elif name == "config":
                attrs.append((name, configs.setdefault(id(value), repr(value))))
            elif name == "forward":
                attrs.append((name, getattr(value, "__code__", None) or id(value)))
        modules.append((path, type(module).__qualname__, type(module).__module__, module.training, tuple(attrs)))
    state = tuple((name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                  for name, t in (*model.named_parameters(remove_duplicate=False),
                                  *model.named_buffers(remove_duplicate=False)))
    return tuple(modules), state, _tied(model)


def _tied(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Parameter names sharing one tensor (tied weights trace as one placeholder)."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return tuple(tuple(names) for names in seen.values() if len(names) > 1)


def kept(model: nn.Module, key: Hashable) -> CapturedGraph | None:
    """The capture kept for ``model`` and ``key``, if the model has not changed since."""
    found = _KEPT.get(model, {}).get(key)
    if found is None or found[0] != fingerprint(model):
        return None
    return found[1]


def keep(model: nn.Module, key: Hashable, captured: CapturedGraph) -> None:
    """Keep ``captured`` for ``model`` and ``key`` (the model's oldest beyond ``KEPT_PER_MODEL`` go)."""
    captures = _KEPT.setdefault(model, OrderedDict())
    captures[key] = (fingerprint(model), captured)
    captures.move_to_end(key)
    while len(captures) > KEPT_PER_MODEL:
        captures.popitem(last=False)


def forget() -> None:
    """Drop every kept capture (``autopar.capture.kept``): the next capture of any model traces."""
    _KEPT.clear()
