"""LLVM FileCheck's core directives over a printed FX program, as xDSL's and MLIR's pass tests use them.

``check(gm, '''
    CHECK:      reshard = self.reshard(x, 'S(0)', 'R')
    CHECK-NEXT: mm = torch.ops.aten.mm.default(reshard, w)
    CHECK-NOT:  self.reshard
''')``

- ``CHECK: p``: some later line holds ``p`` (plain substring, no regexes);
- ``CHECK-NEXT: p``: the line right after the previous match holds ``p``;
- ``CHECK-NOT: p``: no line between the previous match and the next one (or the end) holds ``p``.

The program is ``gm.code`` with each line stripped, blank and comment lines dropped, and FX's
``;  x = y = None`` (freeing dead values) cut off: what a reader compares is the ops.
"""

from __future__ import annotations

import re
import textwrap
from typing import NoReturn

import torch.fx

DIRECTIVES = ("CHECK-NEXT", "CHECK-NOT", "CHECK")
_FREES = re.compile(r";  (\w+ = )+None$")


def program_lines(program: torch.fx.GraphModule | str) -> list[str]:
    """The lines the checks run over (module docstring)."""
    code = program.code if isinstance(program, torch.fx.GraphModule) else program
    lines = (_FREES.sub("", line.strip()) for line in code.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _directives(checks: str) -> list[tuple[str, str]]:
    out = []
    for line in textwrap.dedent(checks).strip().splitlines():
        line = line.strip()
        directive = next((d for d in DIRECTIVES if line.startswith(d + ":")), None)
        if directive is None:
            raise ValueError(f"not a check directive: {line!r} (one of {', '.join(DIRECTIVES)})")
        out.append((directive, line[len(directive) + 1:].strip()))
    return out


def check(program: torch.fx.GraphModule | str, checks: str) -> None:
    """Assert that ``program`` passes ``checks`` (module docstring); the failure shows the program."""
    lines = program_lines(program)
    at, last = 0, -1  # where the next CHECK searches from; the previous match
    pending_nots: list[str] = []
    for directive, pattern in _directives(checks):
        if directive == "CHECK-NOT":
            pending_nots.append(pattern)
            continue
        if directive == "CHECK-NEXT":
            found = last + 1 if last + 1 < len(lines) and pattern in lines[last + 1] else None
        else:
            found = next((i for i in range(at, len(lines)) if pattern in lines[i]), None)
        if found is None:
            _fail(lines, f"{directive}: {pattern!r} not found after line {last + 1}")
        _forbid(lines, at, found, pending_nots)
        pending_nots, at, last = [], found + 1, found
    _forbid(lines, at, len(lines), pending_nots)


def _forbid(lines: list[str], start: int, end: int, patterns: list[str]) -> None:
    for i in range(start, end):
        for pattern in patterns:
            if pattern in lines[i]:
                _fail(lines, f"CHECK-NOT: {pattern!r} found at line {i + 1}")


def _fail(lines: list[str], why: str) -> NoReturn:
    numbered = "\n".join(f"{i + 1:3d}  {line}" for i, line in enumerate(lines))
    raise AssertionError(f"{why} in the program:\n{numbered}")
