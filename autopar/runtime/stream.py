"""The counter-based random stream: every element's random bits are a pure function of
(seed, draw number, the element's index in the drawn tensor on one device).

Design (as JAX's partitionable threefry): a step's draws are numbered in the order they run
(the dispatcher's ``bernoulli_``, ``rand_like``, ...; a dropout is one draw), the same order on
every rank and on one device, since every rank runs the same program. Element ``i`` (row-major
in the drawn tensor's single-device shape) of draw ``d`` is lane ``i % 4`` of Philox-4x32-10
at counter ``(i // 4, d)`` under key ``seed`` (``autopar.philox_spec``), turned into the op's
distribution by ``autopar.runtime.samplers``. A caller holding some of the elements (a rank's
plain, strided or zig-zag piece, a micro-batch, a pipeline stage) computes only those: a
``Layout`` says which global indices its local elements have, as a ``Region`` (an affine map,
the piece being a view of the global tensor). Replicas compute the same values, split pieces
disjoint parts of one global tensor, and the values do not depend on the mesh. The state is
two integers (seed, draws taken), saved and restored like a generator's (``get_state``/
``set_state``: activation checkpointing replays a block's draws).

A draw runs as one fused Triton kernel on CUDA (``runtime.philox_triton``) and as chunked eager
torch ops elsewhere (``runtime.philox_eager``); both write the sampler's finish (a mask, a
uniform, the words) once, for the caller's elements only. ``cost.draws`` prices the one that runs.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from autopar.philox_spec import MASK, Finish, Region
from autopar.runtime.philox_eager import draw as eager_draw
from autopar.runtime.philox_triton import available as kernel_available
from autopar.runtime.philox_triton import draw as kernel_draw
from autopar.runtime.philox_triton import fits as kernel_fits


class Layout(Protocol):
    """Which elements of a drawn tensor the caller holds."""

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The drawn tensor's single-device shape, given the shape the caller draws."""
        ...

    def region(self, shape: tuple[int, ...]) -> Region:
        """The global row-major indices, in a tensor of single-device shape ``shape``, of the
        caller's elements, in the order it holds them."""
        ...


class WholeLayout:
    """One device: every element, in place."""

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return local_shape

    def region(self, shape: tuple[int, ...]) -> Region:
        return Region.whole(shape)


class CounterDraw:
    """One draw's values for a layout's elements (``samplers.Bits``): each method runs the
    generator once, for sub-stream ``sub`` (0 or 1: Box-Muller takes two words an element)."""

    def __init__(self, seed: int, draw: int, layout: Layout, device: torch.device) -> None:
        if not 0 <= draw < 2 ** 63:
            raise ValueError(f"draw {draw}: the counter holds draws below 2^63")
        self.seed, self.draw, self.layout, self.device = seed, draw, layout, device

    def words(self, shape: tuple[int, ...], sub: int = 0) -> torch.Tensor:
        """int64 words in [0, 2^32), shaped ``shape`` (the caller's local shape)."""
        return self._run(shape, sub, "words", torch.empty(shape, dtype=torch.int64, device=self.device))

    def below(self, shape: tuple[int, ...], threshold: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``word < threshold``: a bool mask, or 0/1 written into ``out`` (contiguous, any dtype)."""
        if out is None:
            out = torch.empty(shape, dtype=torch.bool, device=self.device)
        return self._run(shape, 0, "below", out, threshold=threshold)

    def uniform(self, shape: tuple[int, ...], bits: int, dtype: torch.dtype, sub: int = 0) -> torch.Tensor:
        """``(word >> (32 - bits)) * 2^-bits`` in ``dtype`` (float32 or float64: exact)."""
        return self._run(shape, sub, "uniform", torch.empty(shape, dtype=dtype, device=self.device), bits=bits)

    def _run(self, shape: tuple[int, ...], sub: int, finish: Finish, out: torch.Tensor, threshold: int = 0,
             bits: int = 32) -> torch.Tensor:
        assert out.is_contiguous() and tuple(out.shape) == tuple(shape), (out.shape, shape)
        if math.prod(shape) == 0:
            return out
        region = self.layout.region(self.layout.global_shape(tuple(shape)))
        assert region.numel == out.numel(), (region, shape)
        high = (self.draw & MASK, ((self.draw >> 32) & 0x7FFFFFFF) | (sub << 31))
        if out.device.type == "cuda" and kernel_available() and kernel_fits(region):
            kernel_draw(self.seed, high, region, finish, out, threshold, bits)
        else:
            key = (self.seed & MASK, (self.seed >> 32) & MASK)
            eager_draw(key, high, region, finish, out, threshold, bits)
        return out


class CounterStream:
    """Seed and the number of draws taken: the whole state of the stream."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.draws = 0
        self.device = torch.device(device)

    def get_state(self) -> tuple[int, int]:
        """(seed, draws): ``set_state`` it to replay from here. Plain ints, no tensor: taken
        inside checkpointed regions, where a tensor made would be an op of the region."""
        return self.seed, self.draws

    def set_state(self, state: tuple[int, int]) -> None:
        seed, draws = state
        self.seed, self.draws = int(seed) & 0xFFFFFFFFFFFFFFFF, int(draws)

    def take(self, layout: Layout, device: torch.device) -> CounterDraw:
        """The next draw, for ``layout``'s elements on ``device``."""
        draw = CounterDraw(self.seed, self.draws, layout, device)
        self.draws += 1
        return draw
