"""One error on every rank: what failed on any rank is raised on all of them together (none
left waiting in a collective), of the failing error's own type where it is the user's
(an ``InputError``: a ``MemoryLimitError``, a ``CaptureError``, ...), so that
``except autopar.InputError`` catches it on every rank; anything else is a ``CompileError``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from autopar.errors import CompileError, InputError

T = TypeVar("T")


Failure = tuple[type[Exception], str]
"""What failed on a rank: the type every rank raises, and the message."""


def failure_of(exc: Exception) -> Failure:
    """``exc`` as every rank raises it again: its own type if an InputError (the nearest importable
    one: a class defined in a function does not travel between ranks), else CompileError."""
    if not isinstance(exc, InputError):
        return CompileError, describe_error(exc)
    kind = next(k for k in type(exc).__mro__ if issubclass(k, InputError) and "<locals>" not in k.__qualname__)
    return kind, describe_error(exc)


def describe_error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def gather_errors(what: str, error: str | Failure | None, error_type: type[Exception] = CompileError) -> None:
    """Raise on every rank if ``error`` is set on any (a collective: every rank must call it):
    of the failing rank's type (``error_type`` for a message alone)."""
    failure = (error_type, error) if isinstance(error, str) and error else error or None
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = [(rank, f) for rank, f in enumerate(failures) if f]
    if failed:
        rank, (kind, message) = failed[0]
        raise kind(f"{what} failed on rank {rank} (of {len(failed)} failing): {message}")


def on_every_rank(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails anywhere, raise on every rank (no rank hangs)."""
    result: Any = None
    failure: Failure | None = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        failure = failure_of(exc)
    gather_errors(what, failure)
    return result


def on_rank_zero(what: str, fn: Callable[[], T], bare: type[Exception] | None = None) -> T:
    """Run ``fn`` on rank 0 only and hand its result (or its error) to every rank. An error of
    type ``bare`` keeps its own message (the pipeline search reads it as ``plan`` would)."""
    box: list[Any] = [None, None, False]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            box[1], box[2] = failure_of(exc), bare is not None and isinstance(exc, bare)
            if box[2]:
                box[1] = (box[1][0], str(exc))
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        kind, message = box[1]
        raise kind(message if box[2] else f"{what} failed on rank 0: {message}")
    return box[0]


def agree(what: str, fingerprint: str) -> None:
    """Raise on every rank unless every rank computed the same ``fingerprint``."""
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, fingerprint)
    if len(set(hashes)) != 1:
        raise CompileError(f"ranks planned differently ({what}; hashes {dict(enumerate(hashes))}): pass the "
                           "same model, inputs, mesh and options on every rank")
