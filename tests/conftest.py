"""Make ``autopar`` and ``examples`` importable from a checkout without installing it, and mark the
tests that fork ranks (``ranks``), so that the fast tier (``-m "not ranks and not sweep and not slow"``)
runs without them; a module of sweeps only is then not even collected (collecting the OpInfo sweep
traces every sample)."""

import functools
import inspect
import sys
import types
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from autopar.runtime.forked import run_ranks  # noqa: E402

# Multi-rank tests fork this process; a forked child hangs if the parent already started
# an OpenMP pool, so the whole session computes on one intra-op thread.
torch.set_num_threads(1)


SWEEP_MODULES = ("test_opinfo_sweep.py", "test_rules_bruteforce.py")
"""Modules marked ``sweep`` as a whole (``pytestmark``) whose collection itself costs seconds."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip collecting a sweep module when the marker expression leaves sweeps out."""
    if collection_path.name in SWEEP_MODULES and "not sweep" in (config.getoption("markexpr") or ""):
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test forks ranks when its function, or a function of the tests' or examples' own it calls, names
    ``run_ranks``: marked ``ranks`` (no list of such tests to keep up to date)."""
    seen: dict[types.CodeType, bool] = {}
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and _reaches(function, seen):
            item.add_marker(pytest.mark.ranks)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("ranks") is not None:
        _warm_the_tracer()


@functools.cache
def _warm_the_tracer() -> None:
    """Export a tiny step in this process once, before its first forked test: torch.export's first use
    imports ~400 modules (networkx and inductor's among them) and fills its tables, which every rank forked
    from a process that never exported pays again (a 4-rank test of tests/test_numerics.py took 5 s
    rather than 3)."""
    linear = torch.nn.Linear(4, 4)

    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.scaled_dot_product_attention(x, x, linear(x), is_causal=True)
            return torch.nn.functional.cross_entropy(y.flatten(0, 1), torch.zeros(4, dtype=torch.long))

    torch.export.export(Step(), (torch.ones(1, 4, 4),), strict=False)


def _reaches(function: types.FunctionType, seen: dict[types.CodeType, bool]) -> bool:
    """Whether ``function`` names ``run_ranks``, directly or through the tests' and examples' functions."""
    code = function.__code__
    if code in seen:
        return seen[code]
    seen[code] = False  # a recursion through this function adds nothing
    found = any(_named(name, function, seen) for name in _names(code))
    seen[code] = found
    return found


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _named(name: str, function: types.FunctionType, seen: dict[types.CodeType, bool]) -> bool:
    value = function.__globals__.get(name)
    if value is run_ranks:
        return True
    return inspect.isfunction(value) and _ours(value) and _reaches(value, seen)


def _ours(function: types.FunctionType) -> bool:
    """A function of the tests or the examples (whose calls are followed), not of autopar or a library."""
    path = Path(function.__code__.co_filename).resolve()
    return any(path.is_relative_to(Path(ROOT) / folder) for folder in ("tests", "examples"))
