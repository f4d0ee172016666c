"""Sharding strategies in DTensor's vocabulary, for one mesh dimension and for N.

A rule describes an op for *one* mesh dimension (``DimStrategy``): which placement
each tensor input needs and which placement each output then has. ``expand`` turns
those into N-D strategies (one placement per mesh dimension per tensor), keeping the
combinations whose sharded dimensions divide evenly.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from collections.abc import Hashable
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.capture.graph import TensorMeta
from autopar.capture.schema import positional_args, schema_arg

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def strided(dim: int, factor: int) -> _StridedShard:
    """Dim ``dim`` viewed as ``factor`` equal blocks, each block split across the ranks.

    A rank holds its piece of every block, concatenated: the layout a fused projection
    (``qkv = x @ [Wq; Wk; Wv].T``) needs so that ``split(h)`` and the heads stay local,
    Megatron's interleaved QKV. DTensor's ``_StridedShard(dim, split_factor=factor)``.
    """
    return _StridedShard(dim, split_factor=factor)


@functools.cache
def _shards(kind: type) -> bool:
    """Whether placements of this class split a dim. By class, once: placements' metaclass
    (torch's ``OpaqueBaseMeta``) runs ``isinstance`` in Python, and planning a large model asks it
    about every strategy of every node."""
    return issubclass(kind, (Shard, _StridedShard))


@functools.cache
def _strided(kind: type) -> bool:
    return issubclass(kind, _StridedShard)


@functools.cache
def _partial(kind: type) -> bool:
    return issubclass(kind, Partial)


@functools.cache
def _replicate(kind: type) -> bool:
    return issubclass(kind, Replicate)


def is_partial(p: Placement) -> bool:
    """``isinstance(p, Partial)``, by class once (see ``_shards``)."""
    return _partial(type(p))


def is_replicate(p: Placement) -> bool:
    """``isinstance(p, Replicate)``, by class once (see ``_shards``)."""
    return _replicate(type(p))


def shard_dim(p: Placement) -> int | None:
    """The tensor dim a placement splits (plain or strided), else None."""
    return p.dim if _shards(type(p)) else None  # type: ignore[attr-defined]


def split_factor(p: Placement) -> int:
    """Blocks of a strided shard; 1 for anything else."""
    return p.split_factor if _strided(type(p)) else 1  # type: ignore[attr-defined]


def is_strided(p: Placement) -> bool:
    return _strided(type(p))


Placements = tuple[Placement, ...]
"""One placement per mesh dimension."""


@dataclass(frozen=True)
class DimStrategy:
    """One way to run an op along one mesh dimension."""

    outputs: tuple[Placement | None, ...]
    """Placement of each output (None for an output that is not a tensor)."""
    inputs: tuple[Placement, ...]
    """Placement each tensor input must arrive in, in ``OpCall.tensor_inputs`` order."""
    sizes: tuple[int, ...] = ()
    """Sizes besides tensor dims that this strategy divides among the mesh dim's ranks (a
    grouped convolution's groups): ``expand`` keeps a combination only where each divides
    by the product of the mesh dims splitting it."""
    exclusive: bool = False
    """At most one mesh dim (of more than one rank) may take this strategy: its runtime works on
    one process group (expert parallelism's all-to-alls, ``runtime.moe``)."""


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on the whole mesh: per tensor, one placement per mesh dim."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]
    zero1: int | None = None
    """A trainable parameter's strategy only: the mesh dim (replicated there) its optimizer
    state is sharded on (ZeRO-1, ``autopar.cost.zero1``); None: whole state (DDP on the dims
    it is replicated on). A twin of the same placement without it is a separate choice."""
    offload: bool = False
    """A trainable parameter's strategy only: its optimizer state and fp32 master weights live
    in host memory and update there (``autopar.cost.offload``); a twin of the same placement
    without it is a separate choice."""

    def is_active(self, mesh_dim: int) -> bool:
        """True when the op's work is split along ``mesh_dim`` (some output not Replicate).

        A replicated input of an active op receives a Partial gradient: each rank
        only computed part of the uses of that input.
        """
        return mesh_dim in self._active_dims

    @functools.cached_property
    def _active_dims(self) -> frozenset[int]:  # once per strategy: edge pricing asks per pair
        return frozenset(d for o in self.outputs if o is not None for d, p in enumerate(o) if not p.is_replicate())


@dataclass(frozen=True)
class OpCall:
    """An op application as rules see it: tensors replaced by their TensorMeta."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[TensorMeta | None, ...] = ()

    @property
    def tensor_inputs(self) -> list[TensorMeta]:
        """Tensor arguments flattened in order (lists such as cat's are expanded)."""
        found: list[TensorMeta] = []
        for a in (*self.args, *self.kwargs.values()):
            if isinstance(a, TensorMeta):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                found.extend(x for x in a if isinstance(x, TensorMeta))
        return found

    def get(self, name: str, default: Any = None) -> Any:
        """The argument the op's schema calls ``name``, however it was passed (positionally,
        by keyword, or left at the schema's default); ``default`` where the schema has none."""
        return schema_arg(self.target, self.args, self.kwargs, name, default)

    @functools.cached_property
    def identity(self) -> Hashable | None:
        """``call_key``, made once per call: saved-tensor probes ask per edge (an 8B Llama's
        plan, ~10,000 times)."""
        return _identity(self)


def call_key(call: OpCall) -> Hashable | None:
    """A hashable identity of an op call (target, arguments, output metas), or None."""
    return call.identity


def _frozen(a: Any) -> Any:
    """``a`` with its lists, tuples and dicts made hashable tuples (not a closure: a recursive one is a
    reference cycle, left to the cyclic collector)."""
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_frozen(x) for x in a))
    if isinstance(a, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in a.items()))
    return a


def _identity(call: OpCall) -> Hashable | None:
    key = (call.target, _frozen(call.args), _frozen(call.kwargs), call.outputs)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def replicate_all(call: OpCall) -> DimStrategy:
    """Every rank computes the whole op: always valid."""
    return DimStrategy(tuple(R if o is not None else None for o in call.outputs),
                       tuple(R for _ in call.tensor_inputs))


def normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def divides(meta: TensorMeta, placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    """Every sharded tensor dim divides by the product of the mesh dims sharding it, and none is
    ragged (a data-dependent size: a rank's share of it is no contiguous shard)."""
    if meta.ragged and any(shard_dim(p) in meta.ragged for p, n in zip(placements, mesh_shape) if n > 1):
        return False
    return _divides(tuple(meta.shape), tuple(placements), tuple(mesh_shape))


@functools.lru_cache(maxsize=65536)
def _divides(shape: tuple[int, ...], placements: Placements, mesh_shape: tuple[int, ...]) -> bool:
    ndim = len(shape)
    ways = [1] * ndim
    factor = [1] * ndim
    for p, n in zip(placements, mesh_shape):
        d = shard_dim(p)
        if d is not None:
            if not 0 <= d < ndim:
                return False
            if factor[d] > 1 or (is_strided(p) and ways[d] > 1):
                return False  # a strided dim is split on one mesh dim only (no nesting rules needed)
            ways[d] *= n
            factor[d] = split_factor(p)
    return all(w == 1 or (size % (w * f) == 0 and size >= w * f)
               for w, f, size in zip(ways, factor, shape))


def dedupe(strategies: list[DimStrategy]) -> list[DimStrategy]:
    seen: dict[DimStrategy, None] = {}
    for s in strategies:
        seen.setdefault(s, None)
    return list(seen)


def expand(call: OpCall, dim_strategies: list[DimStrategy], mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """All N-D strategies whose every mesh dim follows one single-dim strategy and divides evenly; on a
    mesh dim of one rank (a pipeline took the axis's others) the replicated one alone, as the others
    are the same plan under another name (duplicates multiply an ILP's size and its symmetric optima).

    A single-dim strategy placing a bool tensor Partial is dropped here, for every rule: a
    Partial is a pending sum and a bool tensor has none (an all-reduce cannot make one)."""
    dim_strategies = dedupe([replicate_all(call), *(s for s in dim_strategies if _sums_are_defined(call, s))])
    metas_in = call.tensor_inputs
    out: list[Strategy] = []
    whole = [dim_strategies[0]]  # a one-rank axis holds every tensor whole: its placements all mean Replicate
    for combo in itertools.product(*(dim_strategies if n > 1 else whole for n in mesh_shape)):
        outputs = tuple(
            None if combo[0].outputs[i] is None else tuple(c.outputs[i] for c in combo)  # type: ignore[misc]
            for i in range(len(call.outputs))
        )
        inputs = tuple(tuple(c.inputs[i] for c in combo) for i in range(len(metas_in)))
        ok = all(divides(m, pl, mesh_shape) for m, pl in zip(metas_in, inputs))
        ok = ok and all(pl is None or m is None or divides(m, pl, mesh_shape)
                        for m, pl in zip(call.outputs, outputs))
        ok = ok and _sizes_divide(combo, mesh_shape)
        ok = ok and sum(1 for c, n in zip(combo, mesh_shape) if c.exclusive and n > 1) <= 1
        if ok:
            out.append(Strategy(outputs, inputs))  # type: ignore[arg-type]
    return out


def _sums_are_defined(call: OpCall, strategy: DimStrategy) -> bool:
    placed = [*zip(call.tensor_inputs, strategy.inputs), *zip(call.outputs, strategy.outputs)]
    return not any(m is not None and p is not None and p.is_partial() and m.dtype == torch.bool for m, p in placed)


def _sizes_divide(combo: tuple[DimStrategy, ...], mesh_shape: tuple[int, ...]) -> bool:
    ways: dict[int, int] = {}
    for strategy, n in zip(combo, mesh_shape):
        for size in strategy.sizes:
            ways[size] = ways.get(size, 1) * n
    return all(size % w == 0 for size, w in ways.items())


def local_numel(meta: TensorMeta, placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """Elements one rank holds of a tensor with these placements."""
    ways = 1
    for p, n in zip(placements, mesh_shape):  # a loop, not prod over a generator: pricing's hottest call
        if _shards(type(p)):
            ways *= n
    return meta.numel // ways


def placement_str(placements: Placements | None) -> str:
    """Compact form used in plans: ``S(0)R``, ``RP``; a strided shard is ``S(2/3)`` (dim 2, 3 blocks)."""
    if placements is None:
        return "-"
    parts = []
    for p in placements:
        if is_strided(p):
            parts.append(f"S({p.dim}/{split_factor(p)})")
        elif isinstance(p, Shard):
            parts.append(f"S({p.dim})")
        elif isinstance(p, Partial):
            parts.append("P")
        else:
            parts.append("R")
    return "".join(parts)


def is_float(meta: TensorMeta | None) -> bool:
    return meta is not None and meta.dtype.is_floating_point


__all__ = ["R", "P", "S", "strided", "shard_dim", "split_factor", "is_strided", "DimStrategy", "Strategy", "OpCall", "Placements", "expand",
           "replicate_all", "normalize_dim", "schema_arg", "positional_args", "divides", "local_numel", "placement_str", "parse_placements"]


def parse_placements(text: str) -> Placements:
    """Inverse of ``placement_str``: ``"S(0)P"`` -> ``(Shard(0), Partial())``."""
    out: list[Placement] = []
    i = 0
    while i < len(text):
        if text[i] == "R":
            out.append(R)
            i += 1
        elif text[i] == "P":
            out.append(P)
            i += 1
        elif text.startswith("S(", i):
            end = text.index(")", i)
            dim, _, factor = text[i + 2:end].partition("/")
            out.append(strided(int(dim), int(factor)) if factor else Shard(int(dim)))
            i = end + 1
        else:
            raise ValueError(f"bad placements {text!r}")
    return tuple(out)
