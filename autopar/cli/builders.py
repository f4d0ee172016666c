"""What both commands need of the user's code: loading a builder function from a file, calling it
with its exceptions reported as bad input at their own line, and parsing positive numbers."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autopar.errors import InputError


def _user_traceback(exc: BaseException, skip: int) -> str:
    """The traceback below the CLI's own ``skip`` frames (import machinery dropped)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)[skip:] if not f.filename.startswith("<frozen")]
    return "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)).rstrip()


def run_user_code(what: str, fn: Callable[[], Any]) -> Any:
    """Call the user's code; an exception in it becomes an InputError keeping its location.

    ``fn`` is a lambda around the user's call: the traceback drops this frame and the
    lambda's (``skip=2``), so the user's own function is the first frame shown."""
    try:
        return fn()
    except SystemExit as exc:  # the builder ended the process: no plan, which is not a success
        raise InputError(f"{what} exited (sys.exit({exc.code!r})) instead of returning\n"
                         f"{_user_traceback(exc, skip=2)}") from exc
    except Exception as exc:  # noqa: BLE001 - reported with the user's own traceback
        raise InputError(f"{what} raised {type(exc).__name__}: {exc}\n{_user_traceback(exc, skip=2)}") from exc


def load_builder(spec: str) -> Any:
    """Import ``path/to/file.py:function`` (or ``package.module:function``) and return the function."""
    target, sep, func = spec.rpartition(":")
    if not sep or not target or not func:
        raise InputError(f"expected FILE.py:FUNCTION, got {spec!r}")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.exists():
            raise InputError(f"no such file {target}")
        # appended, not put first: a builder named rich.py or copy.py must not shadow a library module,
        # and loaded under its own name only (not in sys.modules as 'copy'); its folder's parent lets
        # 'examples/x.py' import 'examples.y'
        for folder in (str(path.parent), str(path.parent.parent)):
            if folder not in sys.path:
                sys.path.append(folder)
        name = f"autopar_builder_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses look their module up while defining
        run_user_code(f"importing {target}", lambda: module_spec.loader.exec_module(module))  # type: ignore[union-attr]
    else:
        module = run_user_code(f"importing {target}", lambda: importlib.import_module(target))
    if not callable(getattr(module, func, None)):
        raise InputError(f"{target} has no function {func!r}")
    return getattr(module, func)


def positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse
