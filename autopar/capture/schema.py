"""Arguments of an op call by its schema: by name, wherever they were passed."""

from __future__ import annotations

from typing import Any


def schema_arg(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call to ``target`` by the op's schema (never by a fixed index:
    overloads put the same argument at different positions)."""
    if name in kwargs:
        return kwargs[name]
    schema = getattr(target, "_schema", None)
    if schema is None:
        return default
    for index, argument in enumerate(schema.arguments):
        if argument.name != name:
            continue
        if index < len(args) and not argument.kwarg_only:
            return args[index]
        return argument.default_value if argument.has_default_value() else default
    return default


def positional_args(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every schema argument of a call to ``target`` in schema order, defaults filled in."""
    out = list(args)
    for argument in target._schema.arguments[len(args):]:
        out.append(kwargs.get(argument.name, argument.default_value if argument.has_default_value() else None))
    return out
