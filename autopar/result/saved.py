"""A plan read back from its JSON (``Plan.to_json``, the CLI's ``--json``): every dataclass of the result
rebuilt field by field from its type hints, so that ``Plan.from_json(plan.to_json()) == plan`` and a saved
plan can be run again without searching (``autopar.compile(..., plan=...)``)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

from autopar.errors import InputError

T = TypeVar("T")


def from_json(cls: type[T], data: Any) -> T:
    """``data`` (what ``dataclasses.asdict`` made of a ``cls``, through JSON or not) as a ``cls``."""
    return _value(cls, data, cls.__name__)


def _value(hint: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return data
    if origin in (typing.Union, types.UnionType):  # the result's unions are all ``X | None``
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        assert len(options) == 1, f"{where}: only optional values are read, not {hint}"
        return None if data is None else _value(options[0], data, where)
    if dataclasses.is_dataclass(hint):
        return _dataclass(hint, data, where)
    if origin in (list, tuple, dict):
        return _container(hint, origin, data, where)
    if hint in (float, int, str, bool):
        if hint is float and isinstance(data, int) and not isinstance(data, bool):
            return float(data)
        if not isinstance(data, hint) or (hint is int and isinstance(data, bool)):
            raise InputError(f"{where}: expected {hint.__name__}, got {data!r}")
        return data
    return data


def _dataclass(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected an object for {cls.__name__}, got {type(data).__name__}")
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in data:
            values[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InputError(f"{where}: {cls.__name__} needs {f.name!r}, which the JSON lacks")
    return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, evaluated once: a plan holds hundreds of each record, and evaluating the
    postponed annotations again for every one was most of reading a plan back."""
    return typing.get_type_hints(cls)


def _container(hint: Any, origin: type, data: Any, where: str) -> Any:
    args = typing.get_args(hint)
    if origin is dict:
        if not isinstance(data, dict):
            raise InputError(f"{where}: expected an object, got {type(data).__name__}")
        key, value = args or (Any, Any)
        return {_value(key, k, where): _value(value, v, f"{where}[{k!r}]") for k, v in data.items()}
    if not isinstance(data, (list, tuple)):
        raise InputError(f"{where}: expected a list, got {type(data).__name__}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        return tuple(_value(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    item = args[0] if args else Any
    items = [_value(item, v, f"{where}[{i}]") for i, v in enumerate(data)]
    return tuple(items) if origin is tuple else items
