"""Measured curves: a quantity as a function of a size, read off published measurements.

A ``Curve`` holds (x, y) points at increasing x and answers y at any x by linear
interpolation in log x (measurements are taken at powers of two: message bytes, FLOPs per
call, sequence lengths), holding the end values beyond the measured range: a kernel larger
than any measured one runs at the largest measured rate, a smaller one at the smallest.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from autopar.errors import InputError


@dataclass(frozen=True)
class Curve:
    """y as a function of x > 0, through ``points``."""

    points: tuple[tuple[float, float], ...]
    """(x, y) pairs, x strictly increasing and positive, y positive."""

    def __post_init__(self) -> None:
        points = tuple((float(x), float(y)) for x, y in self.points)
        if not points:
            raise InputError("a curve needs at least one (x, y) point")
        xs = [x for x, _ in points]
        if any(not math.isfinite(x) or x <= 0 for x in xs) or any(b <= a for a, b in zip(xs, xs[1:])):
            raise InputError(f"a curve's x values must be positive and increasing, got {xs}")
        if any(not math.isfinite(y) or y <= 0 for _, y in points):
            raise InputError(f"a curve's y values must be positive, got {[y for _, y in points]}")
        object.__setattr__(self, "points", points)

    def __call__(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        if x <= xs[0]:
            return self.points[0][1]
        if x >= xs[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(xs, x)
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + t * (y1 - y0)

    def scaled(self, factor: float) -> "Curve":
        """This curve with every y multiplied by ``factor``."""
        return Curve(tuple((x, y * factor) for x, y in self.points))

    def to_json(self) -> list[list[float]]:
        return [[x, y] for x, y in self.points]

    @classmethod
    def from_json(cls, value: object, what: str) -> "Curve":
        """A curve from ``[[x, y], ...]``; ``what`` names it in the error for anything else."""
        if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
            raise InputError(f"{what} must be a list of [x, y] pairs, got {value!r}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for p in value for v in p):
            raise InputError(f"{what} must hold numbers, got {value!r}")
        try:
            return cls(tuple((float(x), float(y)) for x, y in value))
        except InputError as exc:
            raise InputError(f"{what}: {exc}") from None
