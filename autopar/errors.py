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


class CaptureError(InputError, RuntimeError):
    """The model (or its loss) cannot be turned into a graph; the message names why and where."""


class MemoryLimitError(InputError):
    """No plan fits the memory limit; the message says what the leanest plan needs."""


class SolverTimeLimitError(InputError, RuntimeError):
    """The ILP solver reached its time limit before finding any plan."""


class CompileError(RuntimeError):
    """Raised on every rank when any rank failed to compile (not for what the user handed in: that
    is an ``InputError``, of its own type), or ranks disagree."""


class CheckpointError(RuntimeError):
    """A save or load failed on some rank (every rank raises it); the message names each
    failing rank's error, and the DCP exception it comes from (with tracebacks) is its cause."""


class GradientPlanError(RuntimeError):
    """The plan and autograd disagree about which parameters get a gradient (an autopar bug)."""


class RandomDrawError(RuntimeError):
    """A random op cannot be drawn as this rank's slice of one global draw."""


class KVCapacityError(InputError):
    """A request needs more KV cache than a replica of its pool holds: it could never run."""
