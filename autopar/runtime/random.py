"""One random stream for the whole mesh: what ``self.random(...)`` calls in per-rank programs run.

``self.random('aten.dropout.default', 'S(0)R', (8, 64, 128), x, 0.1, True)`` runs the op on
this rank's pieces as it is; each draw it makes (``bernoulli_``, ``native_dropout``,
``rand_like``, ... as the op reaches the dispatcher) is answered for this rank's elements of
the global tensor, which the op's output placements (``S(0)R``) name: the slice a reshard
from Replicate would hand it. Two streams:

- counter (the default, ``autopar.runtime.stream``): the draw's values for this rank's
  elements alone, computed from (seed, draw number, global element index), so a draw costs
  the rank's local elements, and the values are the same on any mesh and on one device
  under ``autopar.random.stream(seed)``;
- torch (``compile(random_stream='torch')``): the global tensor drawn from a torch generator
  on every rank, this rank keeping its slice: the values of the single-device op drawing
  from the default generator in that state, at the price of the global draw on every rank.
  Tensor arguments of such a draw take this rank's place in a global tensor of ones first.

Either way the op's own arithmetic runs on the local pieces unchanged, every rank runs the
same draws in graph order, and ranks agree on the seed (``agree_seed``), so the stream
stays in lockstep. DTensor's ``OffsetBasedRNGTracker`` is not used: in torch 2.13 it
refuses CPU meshes, and on CUDA a shard draws at a philox offset of ``shard index * local
numel``, which is not the slice of the single-device draw.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from autopar.errors import InputError, RandomDrawError
from autopar.philox_spec import Region, rank_region
from autopar.rules import dropout as random_rules
from autopar.rules.redistribute import piece_view
from autopar.rules.strategy import Placements, parse_placements, shard_dim
from autopar.runtime.samplers import SAMPLERS, sample
from autopar.runtime.stream import CounterStream

aten = torch.ops.aten
SLICEABLE = random_rules.ELEMENTWISE_SAMPLERS | {aten.native_dropout.default, aten._fused_dropout.default}
"""Draws whose i-th output element belongs to the i-th element of their tensor arguments."""
READS_VALUES = frozenset({
    aten.bernoulli.default, aten.bernoulli.Tensor, aten.bernoulli_.Tensor, aten.normal.Tensor_float,
    aten.normal.float_Tensor, aten.normal.Tensor_Tensor, aten.native_dropout.default, aten._fused_dropout.default,
})
"""Draws that read their tensor arguments' values (probabilities, means, dropout's input);
the others read only their shape (``rand_like(x)``, ``bernoulli_(p=0.9)``)."""


@functools.cache
def _resolve(op: str) -> torch._ops.OpOverload:
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _generator_arg(func: torch._ops.OpOverload) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments)


Stream = CounterStream | torch.Generator
"""What a rank's random ops draw from (module docstring); both get_state/set_state."""


@dataclass(frozen=True)
class RandomSource:
    """The stream compile builds on every rank: its seed, and ``exact_torch`` for a torch
    generator drawing the global tensor (module docstring)."""

    seed: int
    exact_torch: bool = False

    def stream(self, device_type: str) -> Stream:
        if self.exact_torch:
            return make_generator(device_type, self.seed)
        return CounterStream(self.seed, _device(device_type))


class RandomOps(nn.Module):
    """``self.random(op, placements, global_shape, *args, **kwargs)``: ``op`` on this rank's
    pieces, each draw answered for this rank's elements of the global tensor from
    ``generator`` (a ``CounterStream``, or a torch generator drawing the global tensor).

    ``placements`` are the op's (first) output placements as printed in plans,
    ``global_shape`` the shape of that output on one device.
    """

    def __init__(self, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], generator: Stream,
                 zigzag: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.mesh_shape = tuple(mesh_shape)
        self.coordinate = tuple(coordinate)
        self.generator = generator
        self.zigzag = frozenset(zigzag)
        """Mesh dims whose shards are zig-zag (``Mesh.zigzag``)."""

    def forward(self, op: str, placements: str, global_shape: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
        target = _resolve(op)
        mode = _LocalDraws if isinstance(self.generator, CounterStream) else _GlobalDraws
        with mode(self, op, parse_placements(placements), tuple(global_shape)):
            if target in random_rules.ATTENTION_DROPOUT:
                # The math backend draws through dropout (the one CPU picks for dropout
                # anyway); fused kernels draw inside, where no slice can be taken.
                with sdpa_kernel([SDPBackend.MATH]):
                    return target(*args, **kwargs)
            return target(*args, **kwargs)

    def draw(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` with this module's generator (its own argument, or the device's
        default generator swapped in for ops that take none)."""
        if _generator_arg(func):
            return func(*args, **{**kwargs, "generator": self.generator})
        device = self.generator.device
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
            if device.type == "cpu":
                torch.set_rng_state(self.generator.get_state())
            else:
                torch.get_device_module(device.type).set_rng_state(self.generator.get_state(), device)
            out = func(*args, **kwargs)
            state = torch.get_rng_state() if device.type == "cpu" else \
                torch.get_device_module(device.type).get_rng_state(device)
            self.generator.set_state(state)
        return out

    def region(self, whole: torch.Tensor, placements: Placements) -> torch.Tensor:
        """This rank's elements of the global ``whole`` as a view (no copy), in its local
        tensor's order (``rules.redistribute.piece_view``)."""
        return piece_view(whole, placements, self.mesh_shape, self.coordinate, self.zigzag)


class _LocalDraws(TorchDispatchMode):
    """Answers each draw ``op`` makes from the counter stream, for this rank's elements only."""

    def __init__(self, owner: RandomOps, op: str, placements: Placements, out_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.owner, self.op, self.placements, self.out_shape = owner, op, placements, out_shape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not random_rules.draws_random(func, args, kwargs):
            return func(*args, **kwargs)
        split = any(shard_dim(p) is not None for p in self.placements)
        if func not in SAMPLERS or (split and func not in SLICEABLE):
            raise RandomDrawError(f"{self.op} draws with {func}, which the counter stream cannot draw as "
                                  f"{''.join(map(str, self.placements))}: only elementwise draws split "
                                  f"(random_stream='torch' draws any op replicated)")
        stream = self.owner.generator
        assert isinstance(stream, CounterStream)
        layout = _RankLayout(self, func)
        return sample(func, args, kwargs, stream.take(layout, _out_device(args, kwargs, stream.device)))


class _RankLayout:
    """``stream.Layout`` of this rank's piece of one draw (placements of the op's output)."""

    def __init__(self, draws: _LocalDraws, func: Any) -> None:
        self.draws, self.func = draws, func

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return _global_shape(self.draws.owner, self.draws.op, self.draws.placements, self.draws.out_shape,
                             self.func, local_shape)

    def region(self, shape: tuple[int, ...]) -> Region:
        owner = self.draws.owner
        return rank_region(shape, self.draws.placements, owner.mesh_shape, owner.coordinate, owner.zigzag)


def _out_device(args: tuple[Any, ...], kwargs: dict[str, Any], default: torch.device) -> torch.device:
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if tensor is not None:
        return tensor.device
    return torch.device(kwargs["device"]) if kwargs.get("device") is not None else default


def _global_shape(owner: RandomOps, op: str, placements: Placements, out_shape: tuple[int, ...], func: Any,
                  local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The single-device shape of a draw of ``local_shape`` on this rank: each split dim times its ways."""
    shape = list(local_shape)
    for p, n in zip(placements, owner.mesh_shape):
        d = shard_dim(p)
        if d is not None:
            if d >= len(shape):
                raise RandomDrawError(f"{op} draws {func} of shape {local_shape}, which has no dim {d} to split")
            shape[d] *= n
    for p in placements:
        d = shard_dim(p)
        if d is not None and (len(out_shape) <= d or shape[d] != out_shape[d]):
            raise RandomDrawError(f"{op} draws {func} of local shape {local_shape}, not indexed like its "
                                  f"output {out_shape} on the split dim {d}")
    return tuple(shape)


class _GlobalDraws(TorchDispatchMode):
    """Turns each draw ``op`` makes into this rank's slice of the global draw."""

    def __init__(self, owner: RandomOps, op: str, placements: Placements, out_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.owner, self.op, self.placements, self.out_shape = owner, op, placements, out_shape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not random_rules.draws_random(func, args, kwargs):
            return func(*args, **kwargs)
        if all(shard_dim(p) is None for p in self.placements):
            return self.owner.draw(func, args, kwargs)  # replicated: the local tensor is the global one
        if func not in SLICEABLE:
            raise RandomDrawError(f"{self.op} draws with {func}, which cannot be split as "
                                  f"{''.join(map(str, self.placements))}: only elementwise draws can")
        return self._draw_slice(func, args, kwargs)

    def _draw_slice(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inplace = func._schema.is_mutable  # the in-place samplers write ``self``
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        local_shape = tuple(args[0].shape) if inplace else tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        global_shape = self._global_shape(func, local_shape)

        def embed(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            if func not in READS_VALUES:
                return torch.empty(global_shape, dtype=a.dtype, device=a.device)
            # This rank's elements (a broadcast argument broadcast first) in their global
            # places; ones elsewhere (valid probabilities; draws do not depend on them).
            whole = torch.ones(global_shape, dtype=a.dtype, device=a.device)
            mine = self.owner.region(whole, self.placements)
            mine.copy_(a.expand(local_shape).reshape(mine.shape))
            return whole

        def take(drawn: Any) -> Any:
            if not isinstance(drawn, torch.Tensor):
                return drawn
            return self.owner.region(drawn, self.placements).clone(memory_format=torch.contiguous_format) \
                .view(local_shape)  # a copy: the local tensor must not keep the global draw alive

        if inplace:
            self_ = args[0]
            whole = torch.empty(global_shape, dtype=self_.dtype, device=self_.device)
            drawn = self.owner.draw(func, (whole, *tree_map(embed, args[1:])), tree_map(embed, kwargs))
            return self_.copy_(self.owner.region(drawn, self.placements).reshape(local_shape))
        return tree_map(take, self.owner.draw(func, tree_map(embed, args), tree_map(embed, kwargs)))

    def _global_shape(self, func: Any, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return _global_shape(self.owner, self.op, self.placements, self.out_shape, func, local_shape)


def agree_seed(seed: int | None) -> int:
    """The seed every rank's generator starts from: ``seed``, which must be the same on
    every rank (else ValueError on every rank), or rank 0's ``torch.initial_seed()`` when
    every rank passed None."""
    pairs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, (seed, torch.initial_seed()))
    given = {s for s, _ in pairs}
    if len(given) > 1:
        seeds = ", ".join(f"rank {r}: {s}" for r, (s, _) in enumerate(pairs))
        raise InputError(f"ranks passed different seeds ({seeds}): pass the same seed= on every rank")
    return seed if seed is not None else pairs[0][1]


def _device(device_type: str) -> torch.device:
    """This rank's device: the current one of its type."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def make_generator(device_type: str, seed: int) -> torch.Generator:
    """A torch generator on this rank's device, seeded ``seed``."""
    return torch.Generator(device=_device(device_type)).manual_seed(seed)
