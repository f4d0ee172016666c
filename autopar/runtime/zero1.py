"""ZeRO-1 at the optimizer step: gradients reduce-scattered into each rank's row, updated
rows all-gathered into the whole parameters, in the plan's buckets (``Plan.shard_buckets``,
laid out as ``autopar.cost.zero1`` prices them; the buffers: ``runtime.zero1_streams``).

Per ZeRO-1 mesh dim, the parameters the plan reduce-scatters there form one stream and the
others (whose gradient is whole on every rank already) a second; each is a flat buffer the
parameters are views of, n rows of which the rank at index i owns row i (its ``Chunk`` of
each parameter: the view the optimizer steps, with state for those elements only).
Backward leaves each rank's own (unreduced on that dim) gradient in ``.grad``, accumulated
over micro-batches and scaled as any gradient; a reduce-scattered parameter's is moved into
its stream's gradient buffer as soon as backward has accumulated it (and ``.grad`` becomes
its region there). A bucket holds columns ``[start, stop)`` of its kind's streams: row r of
its input is row r's columns, so one ``reduce_scatter_single`` leaves each rank its own
columns summed, and one ``all_gather_single`` returns every rank's. A bucket of a whole
stream reads (and writes) the stream's buffer itself, with no copy. Every bucket runs at
every step on every rank (a parameter without a gradient contributes zeros and is not
stepped), so all ranks issue the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.cost.buckets import ShardBucket
from autopar.cost.zero1 import ALL_GATHER, REDUCE_SCATTER
from autopar.runtime.ops import CollectiveLog
from autopar.runtime.zero1_streams import Chunk, Stream


class ZeroOneShards:
    """The ZeRO-1 parameters of one rank, their streams and the plan's buckets for them."""

    def __init__(self, buckets: list[ShardBucket], params: dict[str, nn.Parameter], mesh: DeviceMesh,
                 settle: Callable[[], None] = lambda: None, reduced_elsewhere: Iterable[str] = ()) -> None:
        """``reduced_elsewhere``: parameters the gradient buckets (``GradSync``) also reduce,
        which set their ``.grad`` themselves at the end of backward."""
        self.buckets = buckets
        self.settle = settle
        """Waits for the collectives the program left in flight (``Comm.settle``): on a CPU
        mesh no two collectives may run at once."""
        self.mesh = mesh
        self.log: CollectiveLog | None = None
        dtypes = [params[s.param].dtype for b in buckets for s in b.slices]
        # reduced in fp32 at least, as the plan prices gradients (reduce_dtype=fp32)
        self.dtype = torch.promote_types(torch.float32, max(dtypes, key=lambda t: t.itemsize)) if dtypes \
            else torch.float32
        # (mesh dim, REDUCE_SCATTER) -> the stream reduce-scattered there, (mesh dim, ALL_GATHER) -> the one only gathered
        self.streams: dict[tuple[int, str], Stream] = {}
        for dim in sorted({b.mesh_dim for b in buckets}):
            on_dim = [b for b in buckets if b.mesh_dim == dim]
            scattered = _stream(b for b in on_dim if b.kind == REDUCE_SCATTER)
            taken = set(scattered)
            kept = [n for n in _stream(b for b in on_dim if b.kind == ALL_GATHER) if n not in taken]
            ways, index = on_dim[0].ways, mesh.get_local_rank(dim)
            for kind, names in ((REDUCE_SCATTER, scattered), (ALL_GATHER, kept)):
                if names:
                    self.streams[(dim, kind)] = Stream(names, params, dim, ways, index,
                                                       self.dtype if kind == REDUCE_SCATTER else None)
        self.chunks: dict[str, Chunk] = {n: c for s in self.streams.values() for n, c in s.chunks.items()}
        """Parameter node -> its chunk (every ZeRO-1 parameter is in an all-gather bucket)."""
        self.scattered = frozenset(id(params[n]) for (_, kind), s in self.streams.items() if kind == REDUCE_SCATTER
                                   for n in s.chunks)
        """Parameters whose ``.grad`` the step reduce-scatters (by id): backward leaves them this
        rank's own there; the others' gradient is already whole on every rank."""
        elsewhere = set(reduced_elsewhere)
        for (_, kind), stream in self.streams.items():
            for name in stream.chunks if kind == REDUCE_SCATTER else ():
                if name not in elsewhere:  # into the buffer as soon as accumulated: no second gradient held
                    params[name].register_post_accumulate_grad_hook(lambda p, s=stream, n=name: s.take_grad(n))

    def reduce_scatter(self) -> dict[str, torch.Tensor | None]:
        """Each ZeRO-1 parameter's gradient on this rank's elements, summed over its dim where
        the plan reduces it there and taken from ``.grad`` as it is elsewhere (None: no
        gradient on any rank, or no elements on this rank)."""
        reduced: dict[int, torch.Tensor] = {}  # mesh dim -> this rank's row of the summed gradients
        for (dim, kind), stream in self.streams.items():
            stream.check_views()
            if kind == REDUCE_SCATTER:
                for name in stream.chunks:
                    stream.take_grad(name)
                reduced[dim] = torch.empty(stream.columns, dtype=self.dtype, device=stream.weights.device)
        for bucket in self.buckets:
            if bucket.kind != REDUCE_SCATTER:
                continue
            stream, (start, stop) = self.streams[(bucket.mesh_dim, REDUCE_SCATTER)], bucket.columns
            buffer = stream.gradient_buffer()
            whole = (start, stop) == (0, stream.columns)
            rows = buffer if whole else stream.rows(buffer, start, stop).contiguous()
            self._record(REDUCE_SCATTER, bucket, rows)
            self.settle()
            dist.reduce_scatter_single(reduced[bucket.mesh_dim][start:stop], rows.view(-1),
                                       group=self.mesh.get_group(bucket.mesh_dim))
        grads: dict[str, torch.Tensor | None] = {}
        for (dim, kind), stream in self.streams.items():
            base = stream.index * stream.columns
            for name, chunk in stream.chunks.items():
                grad = chunk.param.grad
                if grad is None or chunk.lo == chunk.hi:
                    grads[name] = None
                elif kind == REDUCE_SCATTER:
                    grads[name] = reduced[dim][chunk.offset + chunk.lo - base: chunk.offset + chunk.hi - base]
                else:  # not reduced on this dim: every rank holds the whole gradient
                    grads[name] = grad.reshape(-1)[chunk.lo:chunk.hi]
            stream.release()
        return grads

    @torch.no_grad()
    def all_gather(self) -> None:
        """Every rank's updated rows into the whole parameters, bucket by bucket."""
        self.settle()
        for bucket in self.buckets:
            if bucket.kind != ALL_GATHER:
                continue
            parts = self._parts(bucket)
            group = self.mesh.get_group(bucket.mesh_dim)
            if len(parts) == 1 and parts[0][1:] == (0, parts[0][0].columns):  # a whole stream: in place
                stream = parts[0][0]
                mine = stream.weights.view(stream.ways, stream.columns)[stream.index]
                self._record(ALL_GATHER, bucket, mine, bucket.ways)
                dist.all_gather_single(stream.weights, mine, group=group)
                continue
            pieces = [s.weights.view(s.ways, s.columns)[s.index, a:b] for s, a, b in parts]
            mine = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            self._record(ALL_GATHER, bucket, mine, bucket.ways)
            rows = torch.empty(bucket.ways * mine.numel(), dtype=mine.dtype, device=mine.device)
            dist.all_gather_single(rows, mine, group=group)
            offset = 0
            for stream, a, b in parts:
                stream.rows(stream.weights, a, b).copy_(rows.view(bucket.ways, -1)[:, offset: offset + b - a])
                offset += b - a

    def _parts(self, bucket: ShardBucket) -> list[tuple[Stream, int, int]]:
        """An all-gather bucket's columns, per stream: the reduce-scattered stream's columns
        come first in the column space, the kept stream's after them."""
        out, first = [], 0
        for kind in (REDUCE_SCATTER, ALL_GATHER):
            stream = self.streams.get((bucket.mesh_dim, kind))
            if stream is None:
                continue
            a, b = max(bucket.columns[0] - first, 0), min(bucket.columns[1] - first, stream.columns)
            if a < b:
                out.append((stream, a, b))
            first += stream.columns
        return out

    def gather_whole(self, chunk: Chunk, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``chunk``'s elements (optimizer state; None where this rank has none, on
        ``like``'s dtype) as the parameter's whole local tensor, from every rank's elements:
        one all-gather on the chunk's dim, not one of the step's."""
        numel, ways = chunk.param.numel(), self.mesh.size(chunk.mesh_dim)
        padded = torch.zeros(numel, dtype=like.dtype, device=like.device)
        if value is not None:
            padded[chunk.lo:chunk.hi] = value.reshape(-1)
        self.settle()
        gathered = torch.empty(ways * numel, dtype=like.dtype, device=like.device)
        dist.all_gather_single(gathered, padded, group=self.mesh.get_group(chunk.mesh_dim))
        whole = torch.empty_like(padded)
        for rank, row in enumerate(gathered.view(ways, numel)):
            lo, hi = chunk.owned(rank)
            whole[lo:hi] = row[lo:hi]
        return whole.view(chunk.param.shape)

    def _record(self, kind: str, bucket: ShardBucket, sent: torch.Tensor, ways: int = 1) -> None:
        """Log the collective with its M (the bytes before scattering, or after gathering)."""
        if self.log is not None:
            self.log.entries.append(("optimizer", kind, bucket.mesh_dim, ways * sent.numel() * sent.element_size()))


def _stream(buckets: Iterable[ShardBucket]) -> list[str]:
    """The parameters of one stream's buckets, in stream order."""
    start: dict[str, int] = {}
    for bucket in buckets:
        for s in bucket.slices:
            start[s.param] = s.start
    return sorted(start, key=start.__getitem__)

