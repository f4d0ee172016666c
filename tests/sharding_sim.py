"""A one-process simulator of sharded op execution, used to brute-force check sharding rules.

For a strategy (one placement per mesh dim for every tensor input and output) the
simulator builds each rank's local inputs from the full tensors, runs the op on every
rank's local inputs, reassembles each output from the ranks' local results by its
placements and returns it, so a test can compare it with the unsharded op.

Conventions follow DTensor:
- ``Shard(d)`` on mesh dim i: dim d is cut into ``mesh_shape[i]`` equal contiguous
  chunks. A dim sharded on several mesh dims is cut by mesh dim 0 first, then each
  chunk again by mesh dim 1, ... (mesh-dim-0 outermost).
- ``_StridedShard(d, split_factor=k)``: dim d is cut into k blocks, each block into
  ``mesh_shape[i]`` chunks, and rank j holds its chunk of every block (cut here by
  DTensor's own ``_split_tensor``, independent of autopar's runtime helpers).
- ``Replicate``: every rank of that mesh dim holds the same value.
- ``Partial`` (sum): the value is the sum of the ranks' values. Inputs get random
  parts that sum to the tensor, so an op that is not linear where the rule claims it
  is gives a visibly wrong sum.

A random op (dropout with p > 0, samplers) runs as the runtime runs it
(``autopar.runtime.random``): each rank draws from a generator seeded ``RANDOM_SEED``
and keeps its slice of the global draw; the unsharded op draws from the default
generator seeded the same, so the two must agree exactly.

Every rank gets its own copy of its inputs, and after the op the inputs too are
reassembled and compared with the full op's: an op that writes an input in place
(batch norm's running statistics) must leave the same values, the same on every
replica.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.capture.graph import TensorMeta
from autopar.cost.collectives import grad_placement_at_consumer, grad_placement_at_producer
from autopar.rules import loss as loss_rules
from autopar.rules.attention import ring_dim, splits_causal_rows
from autopar.rules.dropout import draws_random
from autopar.rules.embedding import splits_rows
from autopar.rules.strategy import OpCall, Strategy, placement_str
from autopar.runtime.attention import ContextAttention
from autopar.runtime.random import RandomOps
from autopar.runtime.vocab import VocabEmbedding
from autopar.runtime.ring import ring_call
from ring_threads import ThreadRing, run_threads

aten = torch.ops.aten

Coord = tuple[int, ...]
"""A rank's coordinates on the mesh, one index per mesh dim."""

# Ops whose arguments spell the *output* shape: on a rank they must get the local one.
SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.expand.default}
RANDOM_SEED = 4321
"""The state random ops draw from, unsharded and on every simulated rank alike."""
# Convolutions take ``groups``: a rank holding some whole groups runs with fewer.
CONV_OPS = {aten.conv1d.default, aten.conv1d.padding, aten.conv2d.default, aten.conv2d.padding,
            aten.conv3d.default, aten.conv3d.padding, aten.conv_transpose1d.default,
            aten.conv_transpose2d.input, aten.conv_transpose3d.input, aten.convolution.default}


@dataclass
class OpCase:
    """One op applied to concrete full-size tensors."""

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    """Readable test id (op name and shapes)."""

    def __repr__(self) -> str:  # the tensors' values would drown pytest's report
        return f"OpCase({self.label})"

    def run_full(self) -> tuple[torch.Tensor | None, ...]:
        return self.run_full_with_inputs()[0]

    def is_random(self) -> bool:
        return draws_random(self.op, self.args, self.kwargs)

    def run_full_with_inputs(self) -> tuple[tuple[torch.Tensor | None, ...], list[torch.Tensor]]:
        """The op's outputs, and its tensor inputs after it ran (on copies: the case's own
        tensors never change, even for an op that writes an input in place). A random op
        draws from the default generator seeded ``RANDOM_SEED``."""
        copies = [t.clone() for t in self.tensor_inputs()]
        flat = _replace_tensors([*self.args, *self.kwargs.values()], iter(copies))
        n_kw = len(self.kwargs)
        args = flat[:len(flat) - n_kw] if n_kw else flat
        kwargs = dict(zip(self.kwargs, flat[len(flat) - n_kw:])) if n_kw else {}
        if not self.is_random():
            return flatten_outputs(self.op(*args, **kwargs)), copies
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            return flatten_outputs(self.op(*args, **kwargs)), copies

    def op_call(self) -> OpCall:
        """The call as rules see it: tensors replaced by TensorMeta, outputs flattened."""
        return OpCall(self.op, tuple(_to_meta(a) for a in self.args),
                      {k: _to_meta(v) for k, v in self.kwargs.items()},
                      tuple(TensorMeta.of(o) if o is not None else None for o in self.run_full()))

    def tensor_inputs(self) -> list[torch.Tensor]:
        """Tensor arguments in ``OpCall.tensor_inputs`` order."""
        return list(_iter_tensors((*self.args, *self.kwargs.values())))


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _iter_tensors(values: Sequence[Any]) -> Iterator[torch.Tensor]:
    # Same traversal as OpCall.tensor_inputs: top level, then one level of lists.
    for a in values:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _replace_tensors(values: Sequence[Any], replacements: Iterator[torch.Tensor]) -> list[Any]:
    """``values`` with each tensor (same traversal as ``_iter_tensors``) replaced in order."""
    out: list[Any] = []
    for a in values:
        if isinstance(a, torch.Tensor):
            out.append(next(replacements))
        elif isinstance(a, (list, tuple)):
            out.append(type(a)(next(replacements) if isinstance(x, torch.Tensor) else x for x in a))
        else:
            out.append(a)
    return out


def flatten_outputs(result: Any) -> tuple[torch.Tensor | None, ...]:
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (list, tuple)):
        return tuple(r if isinstance(r, torch.Tensor) else None for r in result)
    return (None,)


def ranks(mesh_shape: tuple[int, ...]) -> list[Coord]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _partial_parts(x: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """n random tensors summing to x (exactly for ints, to rounding for floats)."""
    if x.dtype == torch.bool:
        raise ValueError(f"Partial placement on a {x.dtype} tensor has no meaning")
    if x.is_complex():
        parts = [torch.randn(x.shape, generator=gen, dtype=torch.complex128).to(x.dtype) for _ in range(n - 1)]
    elif x.is_floating_point():
        parts = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) for _ in range(n - 1)]
    else:
        parts = [torch.randint(-5, 6, x.shape, generator=gen).to(x.dtype) for _ in range(n - 1)]
    rest = x.clone()
    for p in parts:
        rest = rest - p
    return [*parts, rest]


def distribute(x: torch.Tensor, placements: Sequence[Placement], mesh_shape: tuple[int, ...],
               gen: torch.Generator) -> dict[Coord, torch.Tensor]:
    """Every rank's local tensor for full tensor ``x`` placed by ``placements``."""
    locals_: dict[Coord, torch.Tensor] = {(): x}
    for placement, n in zip(placements, mesh_shape):  # mesh dim 0 outermost
        refined: dict[Coord, torch.Tensor] = {}
        for coord, t in locals_.items():
            if isinstance(placement, _StridedShard):
                size = t.shape[placement.dim]
                if size % (n * placement.split_factor):
                    raise ValueError(f"dim {placement.dim} of size {size} does not split {placement}")
                pieces = placement._split_tensor(t, n, with_padding=False)[0]
            elif isinstance(placement, Shard):
                size = t.shape[placement.dim]
                if size % n:
                    raise ValueError(f"dim {placement.dim} of size {size} does not split {n} ways")
                pieces = list(torch.chunk(t, n, dim=placement.dim))
            elif isinstance(placement, Partial):
                pieces = _partial_parts(t, n, gen)
            else:
                pieces = [t] * n
            for i, piece in enumerate(pieces):  # a copy per rank: ops may write inputs in place
                refined[(*coord, i)] = piece.clone(memory_format=torch.contiguous_format)
        locals_ = refined
    return locals_


class ReplicaMismatch(AssertionError):
    """A Replicate output that differs between ranks."""


def assemble(locals_: dict[Coord, torch.Tensor], placements: Sequence[Placement],
             mesh_shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's local one, undoing mesh dims innermost first."""
    current = dict(locals_)
    for mesh_dim in reversed(range(len(mesh_shape))):
        placement = placements[mesh_dim]
        merged: dict[Coord, torch.Tensor] = {}
        for outer in {c[:mesh_dim] for c in current}:
            pieces = [current[(*outer, i)] for i in range(mesh_shape[mesh_dim])]
            if isinstance(placement, _StridedShard):  # block j is every rank's j-th chunk, in rank order
                k = placement.split_factor
                chunks = [p.chunk(k, dim=placement.dim) for p in pieces]
                merged[outer] = torch.cat([c[j] for j in range(k) for c in chunks], dim=placement.dim)
            elif isinstance(placement, Shard):
                merged[outer] = torch.cat(pieces, dim=placement.dim)
            elif isinstance(placement, Partial):
                merged[outer] = torch.stack(pieces).sum(0).to(pieces[0].dtype)
            else:
                for i, p in enumerate(pieces[1:], 1):
                    if p.shape != pieces[0].shape or not _close(p, pieces[0]):
                        raise ReplicaMismatch(f"Replicate on mesh dim {mesh_dim}: rank {(*outer, i)} "
                                              f"differs from rank {(*outer, 0)}")
                merged[outer] = pieces[0]
        current = merged
    return current[()]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        assert_matches(a, b)
    except AssertionError:
        return False
    return True


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Tight comparison: float64 to ~1e-9, lower precisions to torch's defaults, ints exactly."""
    if expected.dtype == torch.float64:
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9, equal_nan=True)
    else:
        torch.testing.assert_close(actual, expected, equal_nan=True)


def local_shape(meta: TensorMeta, placements: Sequence[Placement], mesh_shape: tuple[int, ...]) -> list[int]:
    """The shape every rank holds of a tensor with these placements (even splits)."""
    shape = list(meta.shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, (Shard, _StridedShard)):
            shape[p.dim] //= n
    return shape


def localize_shape_args(case: OpCase, call: OpCall, args: list[Any], strategy: Strategy,
                        mesh_shape: tuple[int, ...]) -> tuple[Any, list[Any]]:
    """The op and arguments one rank runs, where the op's arguments depend on global shapes.

    view/reshape/_unsafe_view/expand take the output shape; unflatten the sizes of the
    dims it creates: both get the local shape. squeeze decides *which* dims to drop
    from the shape it sees, and a split dim can be size 1 locally but not globally, so
    it runs as squeeze.dims over the dims that are size 1 globally (a runtime must do
    the same). split sizes are the pieces' sizes along the split dim, local when a
    strided input splits locally. chunk counts, slice bounds and select indices refer to
    a dim the rules never split, so they stay as they are.
    """
    op = case.op
    if not call.outputs:  # unbind of a size-0 dim: nothing comes out, nothing to localize
        return op, args
    out_meta, out_pl = call.outputs[0], strategy.outputs[0]
    if op in SHAPE_ARG_OPS:
        args[1] = local_shape(out_meta, out_pl, mesh_shape)
    elif op is aten.unflatten.int:
        dim = args[1] % call.args[0].ndim
        args[2] = local_shape(out_meta, out_pl, mesh_shape)[dim:dim + len(args[2])]
    elif op is aten.split.Tensor:
        dim = (args[2] if len(args) > 2 else 0) % call.args[0].ndim
        args[1] = local_shape(out_meta, out_pl, mesh_shape)[dim]
    elif op is aten.split_with_sizes.default:
        dim = (args[2] if len(args) > 2 else 0) % call.args[0].ndim
        args[1] = [local_shape(m, pl, mesh_shape)[dim] for m, pl in zip(call.outputs, strategy.outputs)]
    elif op in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        shape = call.args[0].shape
        asked = range(len(shape)) if op is aten.squeeze.default else (
            [args[1]] if op is aten.squeeze.dim else args[1])
        dims = sorted({d % len(shape) for d in asked if shape[d] == 1}) if shape else []  # a 0-d tensor stays
        op, args = aten.squeeze.dims, [args[0], dims]
    elif op in CONV_OPS:
        args = _local_conv_groups(case, args, local_shape(out_meta, out_pl, mesh_shape))
    return op, args


def _local_conv_groups(case: OpCase, args: list[Any], out_shape: list[int]) -> list[Any]:
    """Rank-local ``groups``: weight dim 1 holds one group's channels (input channels, or
    output channels when transposed); the rank's input (output) channels are whole groups."""
    names = [a.name for a in case.op._schema.arguments]
    assert "groups" not in case.kwargs, "simulated convolutions pass groups positionally"
    full = list(args) + [a.default_value for a in case.op._schema.arguments[len(args):]]
    x, weight = full[0], full[1]
    channel = x.ndim - (weight.ndim - 1)
    transposed = "conv_transpose" in str(case.op) or (
        case.op is aten.convolution.default and full[names.index("transposed")])
    channels = out_shape[channel] if transposed else x.shape[channel]
    full[names.index("groups")] = channels // weight.shape[1]
    return full


def _local_runner(case: OpCase, call: OpCall, strategy: Strategy, mesh_shape: tuple[int, ...]
                  ) -> Callable[[list[Any], dict[str, Any], Coord], Any]:
    """How one rank computes: the op itself, except for batch-split 'mean' losses, random
    ops, causal attention split on its queries and lookups in a row-split table.

    A Partial 'mean' loss is run as the local sum divided by the *global* count
    (``loss.local_mean_loss``), which is what the runtime does for these ops. A random
    op draws its slice of the global draw (``RandomOps``), as the runtime does. A causal
    attention whose queries are split on L runs on its rows' global positions
    (``ContextAttention``), as the runtime does. A lookup in a table split by rows gives zero
    rows for the indices other ranks hold (``VocabEmbedding``), as the runtime does.
    """
    out_pl = strategy.outputs[0] if strategy.outputs else None  # unbind of a size-0 dim has no outputs
    if (case.op in loss_rules.MEAN_AS_PARTIAL and out_pl is not None
            and any(isinstance(p, Partial) for p in out_pl)
            and loss_rules._reduction(call) == loss_rules.REDUCTION_MEAN):
        count = loss_rules.global_count(case.op, case.args)
        return lambda args, kwargs, coord: loss_rules.local_mean_loss(case.op, tuple(args), count)
    if case.is_random():
        assert out_pl is not None and call.outputs[0] is not None
        where = (str(case.op), placement_str(out_pl), call.outputs[0].shape)

        def draw(args: list[Any], kwargs: dict[str, Any], coord: Coord) -> Any:
            ops = RandomOps(mesh_shape, coord, torch.Generator().manual_seed(RANDOM_SEED))
            return ops(*where, *args, **kwargs)  # each rank has its own copies: in-place draws write them
        return draw
    if strategy.inputs and splits_rows(case.op, strategy.inputs[0]):  # a vocabulary-parallel lookup
        table = placement_str(strategy.inputs[0])
        return lambda args, kwargs, coord: VocabEmbedding(mesh_shape, coord)(table, *args, **kwargs)
    q_placements = strategy.inputs[0] if strategy.inputs else ()
    ring = _ring_of(case, call, strategy)
    if ring is not None:  # ring attention: each ring of ranks (the other coordinates alike) on threads
        rings: dict[Coord, ThreadRing] = {}
        q_where, kv_where = placement_str(q_placements), placement_str(strategy.inputs[1])

        def on_ring(args: list[Any], kwargs: dict[str, Any], coord: Coord) -> Any:
            group = rings.setdefault(coord[:ring] + coord[ring + 1:], ThreadRing(mesh_shape[ring]))
            return ring_call(group.link(coord[ring]), case.op, tuple(args), kwargs, q_where, kv_where, mesh_shape,
                             coord, ring, frozenset())
        return on_ring
    if call.tensor_inputs and splits_causal_rows(case.op, case.args, case.kwargs, q_placements,
                                                 call.tensor_inputs[0].ndim):
        where = placement_str(q_placements)
        return lambda args, kwargs, coord: ContextAttention(mesh_shape, coord)(str(case.op), where, *args, **kwargs)
    return lambda args, kwargs, coord: case.op(*args, **kwargs)


def _ring_of(case: OpCase, call: OpCall, strategy: Strategy) -> int | None:
    """The mesh dim a ring attention strategy runs its ring on (``runtime.ring``), else None."""
    if len(strategy.inputs) < 3 or len(call.tensor_inputs) < 3:
        return None
    return ring_dim(case.op, strategy.inputs[1], call.tensor_inputs[1].ndim)


def _each_rank(coords: list[Coord], work: Callable[[Coord], Any], together: bool) -> list[Any]:
    """``work`` per rank: one after another, or ``together`` on threads (ranks of a ring wait
    for each other)."""
    if together:
        return run_threads(len(coords), lambda i: work(coords[i]))
    return [work(c) for c in coords]


def simulate(case: OpCase, strategy: Strategy, mesh_shape: tuple[int, ...],
             seed: int = 0) -> tuple[torch.Tensor | None, ...]:
    """Run ``case`` sharded by ``strategy`` on a mesh and return each output reassembled."""
    return simulate_with_inputs(case, strategy, mesh_shape, seed)[0]


def simulate_with_inputs(case: OpCase, strategy: Strategy, mesh_shape: tuple[int, ...], seed: int = 0
                         ) -> tuple[tuple[torch.Tensor | None, ...], list[torch.Tensor]]:
    """``simulate``, and every tensor input reassembled by its placement after the op ran."""
    gen = torch.Generator().manual_seed(seed)
    per_input = [distribute(t, pl, mesh_shape, gen) for t, pl in zip(case.tensor_inputs(), strategy.inputs)]
    local_outputs = _run_ranks(case, strategy, per_input, mesh_shape)
    assembled: list[torch.Tensor | None] = []
    for i, pl in enumerate(strategy.outputs):
        if pl is None:
            assembled.append(None)
            continue
        assembled.append(assemble({c: outs[i] for c, outs in local_outputs.items()}, pl, mesh_shape))
    inputs_after = [assemble(d, pl, mesh_shape) for d, pl in zip(per_input, strategy.inputs)]
    return tuple(assembled), inputs_after


def _run_ranks(case: OpCase, strategy: Strategy, per_input: list[dict[Coord, torch.Tensor]],
               mesh_shape: tuple[int, ...]) -> dict[Coord, tuple[torch.Tensor | None, ...]]:
    """Every rank's outputs, computed from its local inputs."""
    call = case.op_call()
    run = _local_runner(case, call, strategy, mesh_shape)
    n_kw = len(case.kwargs)

    def on_rank(coord: Coord) -> tuple[torch.Tensor | None, ...]:
        local = iter([d[coord] for d in per_input])
        flat = _replace_tensors([*case.args, *case.kwargs.values()], local)
        args = flat[:len(flat) - n_kw] if n_kw else flat
        kwargs = dict(zip(case.kwargs, flat[len(flat) - n_kw:])) if n_kw else {}
        op, args = localize_shape_args(case, call, args, strategy, mesh_shape)
        return flatten_outputs(run(args, kwargs, coord) if op is case.op else op(*args, **kwargs))
    coords = ranks(mesh_shape)
    return dict(zip(coords, _each_rank(coords, on_rank, _ring_of(case, call, strategy) is not None)))


def simulate_gradients(case: OpCase, strategy: Strategy, mesh_shape: tuple[int, ...], wanted: Sequence[int],
                       output_grads: Sequence[torch.Tensor | None], seed: int = 0) -> list[torch.Tensor | None]:
    """Autograd on each rank's local op, as the runtime runs backward: each output's
    gradient arrives placed as its producer wants it (sharded as the output, else
    replicated); the input gradients of tensor inputs ``wanted`` come back reassembled
    by the placement the runtime assumes (``grad_placement_at_consumer``: sharded as the
    input; Partial for a replicated input of an op split on that mesh dim; else replicated)."""
    gen = torch.Generator().manual_seed(seed)
    per_input = [distribute(t, pl, mesh_shape, gen) for t, pl in zip(case.tensor_inputs(), strategy.inputs)]
    for i in wanted:
        for t in per_input[i].values():
            t.requires_grad_(True)
    local_outputs = _run_ranks(case, strategy, per_input, mesh_shape)
    grads_out = {i: distribute(g, [grad_placement_at_producer(p) for p in strategy.outputs[i]], mesh_shape, gen)
                 for i, g in enumerate(output_grads) if g is not None}

    def on_rank(coord: Coord) -> tuple[torch.Tensor | None, ...]:
        outs = local_outputs[coord]
        used = [i for i in grads_out if outs[i] is not None and outs[i].requires_grad]
        return torch.autograd.grad([outs[i] for i in used], [per_input[i][coord] for i in wanted],
                                   [grads_out[i][coord] for i in used], allow_unused=True)
    coords = list(local_outputs)
    ring = _ring_of(case, case.op_call(), strategy) is not None  # backward passes dK/dV around the ring
    local_grads = dict(zip(coords, _each_rank(coords, on_rank, ring)))
    assembled: list[torch.Tensor | None] = []
    for k, i in enumerate(wanted):
        placements = [grad_placement_at_consumer(p, strategy.is_active(d)) for d, p in enumerate(strategy.inputs[i])]
        pieces = {c: g[k] if g[k] is not None else torch.zeros_like(per_input[i][c]) for c, g in local_grads.items()}
        assembled.append(assemble(pieces, placements, mesh_shape))
    return assembled


def strategy_str(strategy: Strategy) -> str:
    ins = ", ".join(placement_str(p) for p in strategy.inputs)
    outs = ", ".join(placement_str(p) for p in strategy.outputs)
    return f"({ins}) -> ({outs})"


def check_strategy(case: OpCase, strategy: Strategy, mesh_shape: tuple[int, ...]) -> str | None:
    """None when the sharded run matches the unsharded op, else what went wrong."""
    expected, expected_inputs = case.run_full_with_inputs()
    try:
        actual, actual_inputs = simulate_with_inputs(case, strategy, mesh_shape)
    except ReplicaMismatch as e:
        return f"{strategy_str(strategy)}: {e}"
    except Exception as e:  # a local shape error is as much a wrong rule as a wrong value
        return f"{strategy_str(strategy)}: sharded run failed: {type(e).__name__}: {str(e)[:300]}"
    if len(actual) != len(expected):
        return f"{strategy_str(strategy)}: {len(actual)} outputs, op has {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is None or a is None:
            continue
        try:
            assert a.shape == e.shape, f"shape {tuple(a.shape)} != {tuple(e.shape)}"
            assert a.dtype == e.dtype, f"dtype {a.dtype} != {e.dtype}"
            assert_matches(a, e)
        except AssertionError as err:
            summary = " ".join(line.strip() for line in str(err).strip().splitlines()[:3])
            return f"{strategy_str(strategy)}: output {i} wrong: {summary[:300]}"
    for i, (a, e) in enumerate(zip(actual_inputs, expected_inputs)):
        try:
            assert_matches(a, e)
        except AssertionError as err:
            summary = " ".join(line.strip() for line in str(err).strip().splitlines()[:3])
            return f"{strategy_str(strategy)}: input {i} after the op (written in place?) wrong: {summary[:300]}"
    return None


__all__ = ["OpCase", "simulate", "simulate_with_inputs", "simulate_gradients", "check_strategy", "distribute", "assemble", "strategy_str",
           "ReplicaMismatch"]
