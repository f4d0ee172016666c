"""The errors autopar raises for what a user hands it (not for its own bugs).

Every stage raises these for input it cannot plan or run as given, so that a caller (the
command line: exit 2) can tell them from an internal error (exit 1, with the traceback).
They subclass ValueError (and TypeError for wrong types), so ``except ValueError`` callers
keep working.
"""

from __future__ import annotations


class InputError(ValueError):
    """What the user handed in cannot be planned or run as given; the message says what and where."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (a TypeError too, as Python's own type errors are)."""
