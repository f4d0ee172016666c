"""The counter-based random stream: every element's random bits are a pure function of
(seed, draw number, the element's index in the drawn tensor on one device).

Design (as JAX's partitionable threefry): a step's draws are numbered in the order they run
(the dispatcher's ``bernoulli_``, ``rand_like``, ...; a dropout is one draw), the same order on
every rank and on one device, since every rank runs the same program. Element ``i`` (row-major
in the drawn tensor's single-device shape) of draw ``d`` is lane ``i % 4`` of Philox-4x32-10
at counter ``(i // 4, d)`` under key ``seed`` (``autopar.runtime.philox``), turned into the
op's distribution by ``autopar.runtime.samplers``. A caller holding some of the elements (a
rank's plain, strided or zig-zag piece, a micro-batch, a pipeline stage) computes only those:
a ``Layout`` says which global indices its local elements have. Replicas compute the same
values, split pieces disjoint parts of one global tensor, and the values do not depend on the
mesh. The state is two integers (seed, draws taken), saved and restored like a generator's
(``get_state``/``set_state``: activation checkpointing replays a block's draws).

Where the layout keeps the drawn tensor's last dim whole and it is a multiple of 4, the
counters of whole rows are computed once per 4 elements (``row_words``); otherwise each
element computes its own counter and takes its lane (4x the rounds).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from autopar.runtime.philox import LANES, element_words, row_words
from autopar.runtime.samplers import Words


class Layout(Protocol):
    """Which elements of a drawn tensor the caller holds."""

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The drawn tensor's single-device shape, given the shape the caller draws."""
        ...

    def indices(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """int64 row-major indices, in a tensor of single-device shape ``shape``, of the
        caller's elements, shaped as the caller holds them."""
        ...

    def keeps_last_dim(self, ndim: int) -> bool:
        """The caller holds whole rows of the last dim (of ``ndim``), in order."""
        ...


class WholeLayout:
    """One device: every element, in place."""

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return local_shape

    def indices(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.arange(math.prod(shape), device=device).view(shape)

    def keeps_last_dim(self, ndim: int) -> bool:
        return True


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

    def take(self, layout: Layout, device: torch.device) -> Words:
        """The next draw's words for ``layout``'s elements (``samplers.Words``)."""
        draw = self.draws
        self.draws += 1
        seed = self.seed

        def words(local_shape: tuple[int, ...], sub: int) -> torch.Tensor:
            shape = layout.global_shape(tuple(local_shape))
            if shape and shape[-1] % LANES == 0 and layout.keeps_last_dim(len(shape)):
                groups = layout.indices((*shape[:-1], shape[-1] // LANES), device)
                return row_words(seed, draw, groups, sub).reshape(local_shape)
            return element_words(seed, draw, layout.indices(shape, device), sub).reshape(local_shape)
        return words
