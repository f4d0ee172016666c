"""Random ops drawn from the counter-based stream: each sampler (``bernoulli_``, ``rand_like``,
``native_dropout``, ...) as elementwise arithmetic on 32-bit words, one word per element.

``sample(func, args, kwargs, bits)`` runs the op as the dispatcher reached it; ``bits`` (a
``Bits``: ``runtime.stream.CounterDraw``) gives the stream's values for the elements of the
drawn tensor this caller holds, shaped as the local shape (on one device the whole tensor,
on a rank its piece): the words (int64 in [0, 2^32)), or, computed with them in one pass, a
mask ``word < threshold`` or a uniform from the word's top bits. ``sub`` picks one of two
independent words per element (Box-Muller needs two). Every sampler is elementwise in its
tensor arguments, so it reads only the local pieces, and the same element gets the same
value however the tensor is split.

Distributions: a uniform float keeps as many of the word's top bits as its dtype's mantissa
holds (so it stays below 1 after rounding); a scalar-probability Bernoulli (dropout's mask)
compares the word with ``round(p * 2^32)``; normals are Box-Muller; exponential, Cauchy,
log-normal and geometric invert their CDFs; ``randint`` takes the word modulo the range
(a bias below range / 2^32); ``randperm`` sorts n words (ties broken by position).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

aten = torch.ops.aten


class Bits(Protocol):
    """One draw's values for this caller's elements of the drawn tensor (``runtime.stream``)."""

    def words(self, shape: tuple[int, ...], sub: int = 0) -> torch.Tensor:
        """int64 words in [0, 2^32), shaped ``shape``."""
        ...

    def below(self, shape: tuple[int, ...], threshold: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``word < threshold`` (sub-stream 0): a bool mask, or 0/1 written into ``out``."""
        ...

    def uniform(self, shape: tuple[int, ...], bits: int, dtype: torch.dtype, sub: int = 0) -> torch.Tensor:
        """``(word >> (32 - bits)) * 2^-bits`` in ``dtype`` (float32 or float64)."""
        ...


def _bits(dtype: torch.dtype) -> int:
    return min(round(-math.log2(torch.finfo(dtype).eps)) + 1, 32)


def uniform(words: Bits, shape: tuple[int, ...], dtype: torch.dtype, sub: int = 0) -> torch.Tensor:
    """U[0, 1) in ``dtype`` (computed in fp32, fp64 for fp64), below 1 after rounding to ``dtype``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return words.uniform(shape, _bits(dtype), work, sub).to(dtype)


def normal(words: Bits, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """N(0, 1) by Box-Muller on two words per element."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u1 = 1.0 - uniform(words, shape, work, 0)  # (0, 1]: log is finite
    u2 = uniform(words, shape, work, 1)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)


def keep_below(words: Bits, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """Bool mask, True with probability ``p`` (a word below ``threshold(p)``)."""
    return words.below(shape, threshold(p))


def threshold(p: float) -> int:
    """The word below which a Bernoulli(``p``) draw is True: ``round(p * 2^32)``."""
    return round(min(max(float(p), 0.0), 1.0) * 2 ** 32)


def _shape(*tensors: Any) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(t.shape for t in tensors if isinstance(t, torch.Tensor))))


def _factory(kwargs: dict[str, Any]) -> tuple[torch.dtype, torch.device]:
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    return dtype, torch.device(kwargs.get("device") or "cpu")


def _like(x: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.dtype, torch.device]:
    return kwargs.get("dtype") or x.dtype, torch.device(kwargs.get("device") or x.device)


def _bernoulli(words: Bits, p: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if isinstance(p, torch.Tensor):
        work = torch.float64 if p.dtype == torch.float64 else torch.float32
        return (uniform(words, shape, work) < p).to(dtype)
    return keep_below(words, shape, p).to(dtype)


def _native_dropout(words: Bits, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    keep = keep_below(words, tuple(x.shape), 1.0 - p)
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return x * keep * scale, keep


def _fused_dropout(words: Bits, x: torch.Tensor, p: float, generator: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    keep = keep_below(words, tuple(x.shape), p)  # ``p`` is the probability to keep here
    return x * keep * (0.0 if p <= 0.0 else 1.0 / p), keep.to(torch.uint8)


def _randint(words: Bits, shape: tuple[int, ...], low: int, high: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    return (low + words.words(shape) % (high - low)).to(dtype=dtype, device=device)


def _randperm(words: Bits, n: int, kwargs: dict[str, Any]) -> torch.Tensor:
    keys = words.words((n,)) * n + torch.arange(n, device=kwargs.get("device") or "cpu")  # distinct keys
    return torch.argsort(keys).to(kwargs.get("dtype") or torch.int64)


def _inplace(fill: Callable[[Bits, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An in-place sampler writing ``fill(words, self)`` into ``self``; its functional twin
    returns a new tensor of ``self``'s shape and dtype."""
    def run(words: Bits, self_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self_.copy_(fill(words, self_, *args, **{k: v for k, v in kwargs.items() if k != "generator"}))
    return run


def _functional(fill: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(words: Bits, self_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return fill(words, self_, *args, **{k: v for k, v in kwargs.items() if k != "generator"})
    return run


def _fill_uniform(words: Bits, x: torch.Tensor, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    return low + (high - low) * uniform(words, tuple(x.shape), x.dtype)


def _fill_normal(words: Bits, x: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    return mean + std * normal(words, tuple(x.shape), x.dtype)


def _fill_exponential(words: Bits, x: torch.Tensor, lambd: float = 1.0) -> torch.Tensor:
    return -torch.log1p(-uniform(words, tuple(x.shape), x.dtype)) / lambd


def _fill_cauchy(words: Bits, x: torch.Tensor, median: float = 0.0, sigma: float = 1.0) -> torch.Tensor:
    return median + sigma * torch.tan(math.pi * (uniform(words, tuple(x.shape), x.dtype) - 0.5))


def _fill_log_normal(words: Bits, x: torch.Tensor, mean: float = 1.0, std: float = 2.0) -> torch.Tensor:
    return torch.exp(mean + std * normal(words, tuple(x.shape), x.dtype))


def _fill_geometric(words: Bits, x: torch.Tensor, p: float) -> torch.Tensor:
    u = 1.0 - uniform(words, tuple(x.shape), torch.float64)  # (0, 1]
    return torch.ceil(torch.log(u) / math.log1p(-p)).clamp_(min=1.0).to(x.dtype)


def _fill_bernoulli(words: Bits, x: torch.Tensor, p: Any = 0.5) -> torch.Tensor:
    return _bernoulli(words, p, _shape(x, p), x.dtype)


def _bernoulli_inplace(words: Bits, self_: torch.Tensor, p: Any = 0.5, generator: Any = None) -> torch.Tensor:
    """``bernoulli_``: a scalar probability's 0/1 written straight into a contiguous ``self``
    by the draw (what ``dropout`` runs on CPU: no mask, cast or copy pass after it)."""
    if not isinstance(p, torch.Tensor) and self_.is_contiguous():
        words.below(tuple(self_.shape), threshold(p), out=self_)
        return self_
    return self_.copy_(_fill_bernoulli(words, self_, p))


SAMPLERS: dict[Any, Callable[..., Any]] = {
    aten.bernoulli_.float: _bernoulli_inplace,
    aten.bernoulli_.Tensor: _inplace(_fill_bernoulli),
    aten.bernoulli.p: _functional(_fill_bernoulli),
    aten.bernoulli.Tensor: _functional(_fill_bernoulli),
    aten.bernoulli.default: lambda w, probs, generator=None: _bernoulli(w, probs, tuple(probs.shape), probs.dtype),
    aten.native_dropout.default: _native_dropout,
    aten._fused_dropout.default: _fused_dropout,
    aten.uniform_.default: _inplace(_fill_uniform),
    aten.uniform.default: _functional(_fill_uniform),
    aten.normal_.default: _inplace(_fill_normal),
    aten.exponential_.default: _inplace(_fill_exponential),
    aten.exponential.default: _functional(_fill_exponential),
    aten.cauchy_.default: _inplace(_fill_cauchy),
    aten.cauchy.default: _functional(_fill_cauchy),
    aten.log_normal_.default: _inplace(_fill_log_normal),
    aten.log_normal.default: _functional(_fill_log_normal),
    aten.geometric_.default: _inplace(_fill_geometric),
    aten.geometric.default: _functional(_fill_geometric),
    aten.normal.Tensor_float: lambda w, mean, std=1.0, generator=None:
        mean + std * normal(w, tuple(mean.shape), mean.dtype),
    aten.normal.float_Tensor: lambda w, mean, std, generator=None: mean + std * normal(w, tuple(std.shape), std.dtype),
    aten.normal.Tensor_Tensor: lambda w, mean, std, generator=None:
        mean + std * normal(w, _shape(mean, std), torch.promote_types(mean.dtype, std.dtype)),
    aten.rand_like.default: lambda w, x, **kw: uniform(w, tuple(x.shape), _like(x, kw)[0]).to(_like(x, kw)[1]),
    aten.randn_like.default: lambda w, x, **kw: normal(w, tuple(x.shape), _like(x, kw)[0]).to(_like(x, kw)[1]),
    aten.randint_like.default: lambda w, x, high, **kw: _randint(w, tuple(x.shape), 0, high, *_like(x, kw)),
    aten.randint_like.low_dtype: lambda w, x, low, high, **kw: _randint(w, tuple(x.shape), low, high, *_like(x, kw)),
    aten.rand.default: lambda w, size, **kw: uniform(w, tuple(size), _factory(kw)[0]).to(_factory(kw)[1]),
    aten.randn.default: lambda w, size, **kw: normal(w, tuple(size), _factory(kw)[0]).to(_factory(kw)[1]),
    aten.randint.default: lambda w, high, size, **kw:
        _randint(w, tuple(size), 0, high, kw.get("dtype") or torch.int64, _factory(kw)[1]),
    aten.randint.low: lambda w, low, high, size, **kw:
        _randint(w, tuple(size), low, high, kw.get("dtype") or torch.int64, _factory(kw)[1]),
    aten.normal.float_float: lambda w, mean, std, size, **kw:
        (mean + std * normal(w, tuple(size), _factory(kw)[0])).to(_factory(kw)[1]),
    aten.randperm.default: lambda w, n, **kw: _randperm(w, n, kw),
}
"""The draws the stream answers, as the dispatcher reaches them (``dropout`` and attention
dropout arrive as ``bernoulli_``)."""


def drawn_shape(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """The shape of the tensor ``func`` draws (its output's, broadcast over its tensor arguments)."""
    if func in (aten.rand.default, aten.randn.default):
        return tuple(args[0])
    if func in (aten.randint.default, aten.normal.float_float):
        return tuple(args[1] if func == aten.randint.default else args[2])
    if func == aten.randint.low:
        return tuple(args[2])
    if func == aten.randperm.default:
        return (int(args[0]),)
    if func._schema.is_mutable:
        return tuple(args[0].shape)
    return _shape(*args, *kwargs.values())


def sample(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], words: Bits) -> Any:
    """``func(*args, **kwargs)`` drawn from ``words`` (module docstring); KeyError for a draw
    the stream does not answer (``SAMPLERS``)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("generator", "layout", "pin_memory", "memory_format")}
    return SAMPLERS[func](words, *args, **kwargs)
