"""The compiled modules' random stream on one device: ``with autopar.random.stream(seed): ...``
makes every random op run inside (dropout, attention dropout, ``rand_like``, ``bernoulli``,
...) draw from the counter-based stream (``autopar.runtime.stream``) seeded ``seed``, as a
module compiled with ``seed=seed`` draws on any mesh. A step run inside equals the compiled
step mask for mask; the stream's draws continue from one ``with`` block to the next of the
same object (``s = stream(seed)``, then ``with s:`` per step).

Attention with dropout runs its math backend inside, as compiled modules run it (a fused
kernel draws inside itself, where the stream cannot answer). A seeded op the stream does not
draw (``poisson``, a fused RNN's dropout) raises ``RandomDrawError``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.rules.dropout import ATTENTION_DROPOUT, draws_random
from autopar.errors import RandomDrawError
from autopar.runtime.samplers import SAMPLERS, sample
from autopar.runtime.stream import CounterStream, WholeLayout

__all__ = ["stream", "RandomDrawError"]


class _Draws(TorchDispatchMode):
    def __init__(self, counter: CounterStream) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not draws_random(func, args, kwargs):
            return func(*args, **kwargs)
        if func not in SAMPLERS:
            raise RandomDrawError(f"{func} draws random numbers the counter stream does not draw")
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        device = tensor.device if tensor is not None else torch.device(kwargs.get("device") or "cpu")
        return sample(func, args, kwargs, self.counter.take(WholeLayout(), device))


class _MathAttention(TorchFunctionMode):
    """Attention with dropout on its math backend, which draws through ``bernoulli_``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention or func in ATTENTION_DROPOUT:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p > 0:
                with sdpa_kernel([SDPBackend.MATH]):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


class stream:  # noqa: N801 - used as a context manager, like torch.no_grad
    """The counter-based stream seeded ``seed`` for the ops run inside (module docstring)."""

    def __init__(self, seed: int) -> None:
        self.counter = CounterStream(seed)
        self._modes: list[Any] = []

    def get_state(self) -> tuple[int, int]:
        return self.counter.get_state()

    def set_state(self, state: tuple[int, int]) -> None:
        self.counter.set_state(state)

    def __enter__(self) -> stream:
        self._modes = [_MathAttention(), _Draws(self.counter)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 trace: TracebackType | None) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(kind, value, trace)
        self._modes = []
