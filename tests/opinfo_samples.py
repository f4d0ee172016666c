"""PyTorch's OpInfo sample inputs, traced to the aten calls autopar plans, as ``OpCase``s.

An OpInfo (``torch.testing._internal.common_methods_invocations.op_db``) names a
python-level op (``torch.add``, ``F.conv2d``, ``Tensor.__getitem__``) with a generator
of sample inputs. ``trace_calls`` runs a sample under torch.export's own tracer (``make_fx``
with ``pre_dispatch=True``: the training IR autopar captures, where ``aten.linear``,
``aten.conv2d`` or ``aten.softmax.int`` stay whole) and replays the graph to record
every aten call with its concrete arguments. Calls whose overload has a rule become
``OpCase``s for the brute-force checker.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sharding_sim import OpCase
from test_rules_bruteforce import UNTESTED, _describe
from torch.fx.experimental.proxy_tensor import make_fx

_frozen = torch.backends.flags_frozen()
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.opinfo.core import OpInfo  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

from autopar.capture.export import lean_tracing  # noqa: E402
from autopar.rules import DEFAULT_RULES  # noqa: E402

if not _frozen:  # importing torch's test utilities froze torch.backends flags for the whole session: undo
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

Call = tuple[Any, tuple[Any, ...], dict[str, Any]]
"""An aten call as recorded: target, positional and keyword arguments (concrete values)."""

SAMPLES_PER_OP = int(os.environ.get("AUTOPAR_OPINFO_SAMPLES", "8"))
"""Samples per OpInfo, spread evenly over its sample list (OpInfos have 1 to 1440 samples;
tracing, not checking, is what costs: ~10 ms a sample)."""
DTYPES = (torch.float64, torch.int64, torch.bool)
"""The first of these an OpInfo supports on CPU is swept (float64 keeps Partial sums exact)."""
SEED = 0
"""Sample values come from the global generators: seeded per OpInfo, then restored."""


@dataclass
class Sample:
    """One OpInfo sample, traced to the aten calls that have a rule."""

    opinfo: str
    """OpInfo name and variant (``nn.functional.pad.reflect``)."""
    index: int
    """Position in the OpInfo's sample generator (``sample_inputs_func``, torch seeded ``SEED``)."""
    dtype: torch.dtype
    cases: list[OpCase]
    """The traced calls that have a rule, in graph order, with their actual arguments."""

    @property
    def id(self) -> str:
        return f"{self.opinfo}-s{self.index}"


class _Recorder(torch.fx.Interpreter):
    """Runs a traced graph, keeping each call's target and concrete arguments."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.calls: list[Call] = []

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Copies as they are now: a later in-place op would change the tensors themselves.
        self.calls.append((target, *tree_map_only(torch.Tensor, torch.clone, (args, dict(kwargs)))))
        return super().call_function(target, args, kwargs)


def trace_calls(fn: Callable[..., Any], *inputs: Any) -> list[Call]:
    """The aten calls ``fn(*inputs)`` makes, as torch.export's training IR records them."""
    with lean_tracing():  # as autopar captures: the recorder reads no stack trace, no graph code
        gm = make_fx(fn, pre_dispatch=True)(*inputs)
    recorder = _Recorder(gm)
    recorder.run(*inputs)
    return recorder.calls


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """torch's, numpy's and python's generators seeded ``SEED``, and restored after."""
    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(SEED)  # CPU only: torch.manual_seed formats a stack per device
            random.seed(SEED)
            np.random.seed(SEED)
            yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def opinfo_name(op: OpInfo) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def swept_dtype(op: OpInfo) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    return next((d for d in DTYPES if d in supported), None)


def spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), first and last included."""
    if n <= k or k == 1:
        return list(range(min(n, k)))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def checkable(target: Any) -> bool:
    """Has a rule, and the simulator can compare it (``UNTESTED``: uninitialized factories, getitem)."""
    return DEFAULT_RULES.lookup(target) is not None and target not in UNTESTED


def label(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``overload-shapes``: ``add.Tensor-5x5,5``."""
    shapes = ",".join(s for s in map(_describe, (*args, *kwargs.values())) if s)
    return "-".join(p for p in (str(target).removeprefix("aten."), shapes) if p)


def trace_opinfo(op: OpInfo, samples_per_op: int = SAMPLES_PER_OP) -> tuple[list[Sample], str | None]:
    """The OpInfo's swept samples that reach a rule, and why some could not be traced (else None)."""
    dtype = swept_dtype(op)
    if dtype is None:
        return [], "supports none of float64, int64, bool on CPU"
    with _seeded():
        # The generator itself: ``op.sample_inputs`` wraps it in a tracker that walks the
        # stack with ``inspect.stack()`` per sample (seconds under pytest's deep stacks).
        samples = list(op.sample_inputs_func(op, "cpu", dtype, False))
    out: list[Sample] = []
    errors: list[str] = []
    for index in spread(len(samples), samples_per_op):
        s = samples[index]
        try:
            with _seeded():
                calls = trace_calls(lambda x, a, kw: op.op(x, *a, **kw), s.input, s.args, s.kwargs)
        except Exception as e:  # noqa: BLE001 - data-dependent (item, equal), CUDA-only, sparse: export fails too
            errors.append(f"not traceable: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
            continue
        cases = [OpCase(t, a, kw, label=label(t, a, kw)) for t, a, kw in calls if checkable(t)]
        if cases:
            out.append(Sample(opinfo_name(op), index, dtype, cases))
    return out, (errors[0] if errors else None)


def sweep(samples_per_op: int = SAMPLES_PER_OP) -> tuple[list[Sample], dict[str, str]]:
    """Every swept sample that reaches a rule, and the OpInfos not swept (wholly or some samples), with why."""
    samples: list[Sample] = []
    left_out: dict[str, str] = {}
    for op in op_db:
        found, why = trace_opinfo(op, samples_per_op)
        samples += found
        if why is not None:
            left_out[opinfo_name(op)] = why
    return samples, left_out
