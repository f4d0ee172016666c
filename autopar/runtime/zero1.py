"""ZeRO-1 at the optimizer step: gradients reduce-scattered into each rank's chunk, updated
chunks all-gathered into the whole parameters, in the plan's buckets (``Plan.shard_buckets``,
laid out as ``autopar.cost.zero1`` prices them).

A ZeRO-1 parameter's local tensor, flattened and padded to ``n * c`` elements, is n chunks
of c; the rank at index i on the parameter's ZeRO-1 mesh dim owns chunk i (``Chunk.view``:
the real elements of it, a view of the parameter's own storage, so the optimizer updates
the parameter in place and holds state for those elements only). Backward leaves each
rank's own (unreduced on that dim) gradient in ``.grad``, accumulated over micro-batches
and scaled as any gradient; ``reduce_scatter`` sums it over the dim into the chunk's
gradient, ``all_gather`` copies every rank's updated chunk into the parameter. A bucket
holds columns ``[start, stop)`` of its parameters' chunks: row r of its input is chunk r's
columns, so one ``reduce_scatter_tensor`` leaves each rank its own columns summed, and
one ``all_gather_tensor`` returns every rank's. Every bucket runs at every step on every
rank (a parameter without a gradient contributes zeros and is not stepped), so all ranks
issue the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import math
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as fc
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.buckets import ShardBucket
from autopar.cost.zero1 import ALL_GATHER, REDUCE_SCATTER
from autopar.runtime.ops import CollectiveLog


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Where one ZeRO-1 parameter's chunk lies."""

    param: nn.Parameter
    """The module's parameter (this rank's local tensor of it)."""
    mesh_dim: int
    """The mesh dim its optimizer state is sharded on."""
    ways: int
    """Ranks on ``mesh_dim``."""
    index: int
    """This rank's index on ``mesh_dim``: it owns chunk ``index``."""
    size: int
    """Elements per chunk, padding included (``ceil(numel / ways)``)."""

    @property
    def lo(self) -> int:
        return min(self.index * self.size, self.param.numel())

    @property
    def hi(self) -> int:
        return min((self.index + 1) * self.size, self.param.numel())

    def view(self) -> torch.Tensor:
        """This rank's real elements of the parameter, sharing its storage (the optimizer's tensor)."""
        return self.param.detach().view(-1)[self.lo:self.hi]

    @property
    def whole(self) -> bool:
        """The chunks hold exactly the parameter's elements: no padding."""
        return self.ways * self.size == self.param.numel()

    def padded(self, flat: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of the parameter's elements (or zeros for None), padded and viewed (ways, size):
        without padding, in its dtype, a view (no copy: the bucket's row copy is the one copy)."""
        if flat is not None and self.whole and flat.dtype == dtype and flat.is_contiguous():
            return flat.view(self.ways, self.size)
        out = torch.zeros(self.ways * self.size, dtype=dtype, device=self.param.device)
        if flat is not None:
            out[: flat.numel()] = flat.reshape(-1)
        return out.view(self.ways, self.size)


class ZeroOneShards:
    """The ZeRO-1 parameters of one rank and the plan's buckets for them."""

    def __init__(self, buckets: list[ShardBucket], params: dict[str, nn.Parameter], mesh: DeviceMesh,
                 settle: Callable[[], None] = lambda: None) -> None:
        self.buckets = buckets
        self.settle = settle
        """Waits for the collectives the program left in flight (``Comm.settle``): on a CPU
        mesh no two collectives may run at once."""
        self.mesh = mesh
        self.log: CollectiveLog | None = None
        self.chunks: dict[str, Chunk] = {}  # parameter node -> its chunk (every one is in an all-gather bucket)
        for bucket in buckets:
            for name in bucket.params:
                param = params[name]
                if not param.is_contiguous():
                    raise RuntimeError(f"ZeRO-1 parameter {name} is not contiguous: its chunk would not be a view")
                self.chunks[name] = Chunk(param=param, mesh_dim=bucket.mesh_dim, ways=bucket.ways,
                                          index=mesh.get_local_rank(bucket.mesh_dim),
                                          size=math.ceil(param.numel() / bucket.ways))
        self.scattered = frozenset(id(params[n]) for b in buckets if b.kind == REDUCE_SCATTER for n in b.params)
        """Parameters whose ``.grad`` the step reduce-scatters (by id): backward leaves them this
        rank's own there; the others' gradient is already whole on every rank."""
        # reduced in fp32 at least, as the plan prices gradients (reduce_dtype=fp32)
        self.dtype = torch.float32 if not self.chunks else torch.promote_types(
            torch.float32, max((c.param.dtype for c in self.chunks.values()), key=lambda t: t.itemsize))

    def reduce_scatter(self) -> dict[str, torch.Tensor | None]:
        """Each ZeRO-1 parameter's gradient chunk, summed over its dim where the plan reduces it
        there and taken from ``.grad`` as it is elsewhere (None: no gradient on any rank)."""
        grads: dict[str, torch.Tensor | None] = {}
        scattered: set[str] = set()  # taken from the buckets below
        for name, chunk in self.chunks.items():
            grad = chunk.param.grad
            if grad is None:
                grads[name] = None
            elif id(chunk.param) in self.scattered:
                scattered.add(name)
            else:  # not reduced on this dim: every rank holds the whole gradient, and takes its chunk
                grads[name] = grad.reshape(-1)[chunk.lo:chunk.hi].clone()
        for bucket in self.buckets:
            if bucket.kind != REDUCE_SCATTER:
                continue
            width = sum(s.stop - s.start for s in bucket.slices)
            rows = torch.empty(bucket.ways, width, dtype=self.dtype, device=self._device(bucket))
            offset = 0
            for s in bucket.slices:
                chunk = self.chunks[s.param]
                rows[:, offset: offset + s.stop - s.start] = chunk.padded(chunk.param.grad, self.dtype)[:, s.start:s.stop]
                offset += s.stop - s.start
            self._record(REDUCE_SCATTER, bucket, rows)
            self.settle()
            mine = fc.wait_tensor(fc.reduce_scatter_single(rows.view(-1), "sum", 0, self.mesh.get_group(bucket.mesh_dim)))
            self._scatter(bucket, mine, grads, scattered)
        return grads

    def _scatter(self, bucket: ShardBucket, mine: torch.Tensor, grads: dict[str, torch.Tensor | None],
                 scattered: set[str]) -> None:
        """This rank's reduced columns as its chunks' gradients (of the ``scattered`` parameters):
        a chunk whose real elements are all in this bucket, in the gradient's dtype, is a view of
        them (no copy); one cut across buckets is copied in piece by piece."""
        offset = 0
        for s in bucket.slices:
            if s.param in scattered:
                chunk = self.chunks[s.param]
                dtype, real = chunk.param.grad.dtype, chunk.hi - chunk.lo  # type: ignore[union-attr]
                grad = grads.get(s.param)
                if grad is None and s.start == 0 and s.stop >= real and mine.dtype == dtype:
                    grads[s.param] = mine[offset: offset + real]
                else:
                    if grad is None:
                        grad = grads[s.param] = torch.empty(real, dtype=dtype, device=mine.device)
                    stop = min(s.stop, real)  # past the real elements: padding
                    if stop > s.start:
                        grad[s.start:stop] = mine[offset: offset + stop - s.start].to(dtype)
            offset += s.stop - s.start

    def all_gather(self) -> None:
        """Every rank's updated chunks into the whole parameters, bucket by bucket."""
        self.settle()
        for bucket in self.buckets:
            if bucket.kind != ALL_GATHER:
                continue
            dtypes = {self.chunks[s.param].param.dtype for s in bucket.slices}
            if len(dtypes) > 1:
                raise RuntimeError(f"ZeRO-1 all-gather bucket mixes dtypes {sorted(map(str, dtypes))}: the plan "
                                   "prices one width for every parameter")
            dtype, = dtypes
            width = sum(s.stop - s.start for s in bucket.slices)
            pieces = []  # each chunk's columns, zeros past its real elements (the padding)
            for s in bucket.slices:
                own = self.chunks[s.param].view()
                piece = own[min(s.start, own.numel()):min(s.stop, own.numel())]
                pieces.append(piece)
                if piece.numel() < s.stop - s.start:
                    pieces.append(own.new_zeros(s.stop - s.start - piece.numel()))
            mine = torch.cat(pieces)
            self._record(ALL_GATHER, bucket, mine, bucket.ways)
            rows = fc.wait_tensor(fc.all_gather_single(mine, 0, self.mesh.get_group(bucket.mesh_dim)))
            self._gather(bucket, rows.view(bucket.ways, width))

    @torch.no_grad()
    def _gather(self, bucket: ShardBucket, rows: torch.Tensor) -> None:
        offset = 0
        for s in bucket.slices:
            chunk = self.chunks[s.param]
            flat = chunk.param.detach().view(-1)
            width = s.stop - s.start
            if chunk.whole:  # every rank's columns in one copy
                flat.view(bucket.ways, chunk.size)[:, s.start:s.stop].copy_(rows[:, offset: offset + width])
            else:
                for r in range(bucket.ways):
                    lo, hi = r * chunk.size + s.start, min(r * chunk.size + s.stop, flat.numel())
                    if hi > lo:
                        flat[lo:hi] = rows[r, offset: offset + hi - lo]
            offset += width

    def gather_whole(self, chunk: Chunk, value: torch.Tensor) -> torch.Tensor:
        """A tensor of ``chunk``'s size (optimizer state) as the parameter's whole local tensor,
        from every rank's chunk (one all-gather on the chunk's dim; not one of the step's)."""
        padded = torch.zeros(chunk.size, dtype=value.dtype, device=value.device)
        padded[: value.numel()] = value
        self.settle()
        whole = fc.wait_tensor(fc.all_gather_single(padded, 0, self.mesh.get_group(chunk.mesh_dim)))
        return whole[: chunk.param.numel()].view(chunk.param.shape).clone()

    def _device(self, bucket: ShardBucket) -> torch.device:
        return self.chunks[bucket.slices[0].param].param.device

    def _record(self, kind: str, bucket: ShardBucket, sent: torch.Tensor, ways: int = 1) -> None:
        """Log the collective with its M (the bytes before scattering, or after gathering)."""
        if self.log is not None:
            self.log.entries.append(("optimizer", kind, bucket.mesh_dim, ways * sent.numel() * sent.element_size()))
