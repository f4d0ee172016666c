"""The context-layout level of the search: a sequence split on context axes is cut into contiguous
chunks or, where the axes may (``problem.zigzag``), zig-zag ones that balance causal attention; each
layout's memory search runs (``search.memory``) and the faster plan is kept, the contiguous one on a
tie. ``context_layout`` pins one."""

from __future__ import annotations

import contextlib
from dataclasses import replace

from autopar.errors import InputError
from autopar.problem.zigzag import zigzag_axes
from autopar.search.memory import Bound, Pruned, Solved, search_memory
from autopar.search.planned import PlannedStep, finish
from autopar.search.account import timed
from autopar.search.problem import Place, Problems


def layouts(problems: Problems, place: Place) -> list[Place]:
    """The places of the layouts to search: contiguous first, zig-zag where some context axis may be."""
    config = problems.config
    contiguous = replace(place, mesh=place.mesh.with_zigzag(()))
    layout = config.context.layout or ("contiguous" if config.context.attention == "ulysses" else None)  # no rows
    if layout == "contiguous" or not config.axes.context:
        return [contiguous]
    axes, why = zigzag_axes(problems.at(contiguous).captured, place.mesh, tuple(config.axes.context),
                            dict(config.memory.zero or {}))
    if layout == "zigzag" and not axes:
        raise InputError(f"context_layout='zigzag': {why}")
    if not axes:
        return [contiguous]
    zigzag = replace(place, mesh=place.mesh.with_zigzag(axes))
    return [zigzag] if layout == "zigzag" else [contiguous, zigzag]


def search_context(problems: Problems, place: Place, limit: float, bound: Bound = Bound()) -> Solved | Pruned:
    """The faster of the layouts' plans at ``place`` within ``limit``; where none gives one, why the
    first did not."""
    places = layouts(problems, place)
    with timed("solve", problems.at(places[0]).timings, problems.account):
        found = []
        for at in places:
            with problems.account.inside(_layout(at)) if len(places) > 1 else contextlib.nullcontext():
                found.append(search_memory(problems, at, limit, bound))
    solved = [f for f in found if isinstance(f, Solved)]
    best = min(solved, key=lambda s: s.solution.objective_s) if solved else None  # the first (contiguous) of equals
    if len(places) > 1:
        for at, result in zip(places, found):
            problems.account.record("layout", _layout(at), "chosen" if result is best else
                                    "planned" if isinstance(result, Solved) else "no plan",
                                    result.solution.objective_s if isinstance(result, Solved) else None,
                                    "" if isinstance(result, Solved) else result.reason)
    return best if best is not None else found[0]


def _layout(place: Place) -> str:
    zigzag = sorted(place.mesh.zigzag)
    return f"zig-zag on {', '.join(zigzag)}" if zigzag else "contiguous"


def plan_on(problems: Problems, place: Place, limit: float, bound: Bound = Bound()) -> PlannedStep | Pruned:
    """The step planned at ``place`` without a pipeline: its layouts' memory searches, the fastest kept
    (``bound``: what the caller already has)."""
    found = search_context(problems, place, limit, bound)
    return found if isinstance(found, Pruned) else finish(found.problem, found.solution)
