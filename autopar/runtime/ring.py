"""Ring attention: what ``self.ring_attention(...)`` calls in per-rank programs run
(``passes.localize_attention`` writes them for attention calls planned with their keys split
on the sequence, ``rules.attention.ring_dim``).

Each rank holds its query rows and its block of keys and values. For n ranks on the ring, n
steps: at step j the rank computes its rows against the block it holds (rank (i - j) mod n's),
only the pieces its rows attend to (``rules.ring.step_pieces``: global positions, zig-zag
aware, blocks after every row skipped), while that block goes on to the next rank and the
previous rank's arrives (``batch_isend_irecv``, issued before the block's compute and waited
after it). Each piece runs the attention kernel, which returns its output and log-sum-exp;
the pieces merge online (``merge``): out = sum_b out_b exp(lse_b - lse), lse = log sum_b exp(lse_b).

Backward is a custom ``autograd.Function`` running the ring again, rather than autograd
through the pieces: the kernel's log-sum-exp output has no gradient, and merging by hand
would keep every block's scores. Forward keeps q, its own k and v, the merged output and
log-sum-exp (what one device's flash attention keeps, split n ways: no block in flight is
kept). Backward passes k and v around again and, with them, dK and dV accumulators: at step j
the rank adds its rows' contribution to the accumulators of the block it holds (the kernel's
backward with the *merged* output and log-sum-exp gives exactly that block's share), dQ stays
local; after n steps each accumulator has met every rank's rows and one last send brings it
home. The accumulators' send is waited after the next step's compute, so it overlaps too.

Every transfer is logged as a ``send_recv`` of the bytes the rank sends (``cost.ring`` lists
the same): forward n-1 of (K, V); backward n-1 of (K, V) and n of (dK, dV).

The kernel is the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its backward): a plan choosing ring attention on another device is refused when its program
is built (``check_ring_device``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture.schema import positional_args
from autopar.errors import InputError
from autopar.rules.attention import ATTENTION_OPS, held_chunks, query_positions
from autopar.rules.ring import DIAGONAL, MASKED, SEND_RECV, Piece, block_positions, step_pieces
from autopar.rules.strategy import parse_placements
from autopar.runtime.attention import _resolve
from autopar.runtime.ops import Comm

aten = torch.ops.aten
KERNEL = aten._scaled_dot_product_flash_attention_for_cpu.default
KERNEL_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
Wait = Callable[[], list[torch.Tensor]]


class RingLink(Protocol):
    """Where a rank sends to the next rank on the ring and receives from the previous one."""

    size: int
    index: int

    def start(self, tensors: list[torch.Tensor], phase: str, tag: int) -> Wait:
        """Send ``tensors`` on, receive the previous rank's (same shapes); the wait returns them."""
        ...


class P2PLink:
    """A ring over one mesh dim's process group, by ``batch_isend_irecv``, logged on ``comm``."""

    def __init__(self, comm: Comm, mesh_dim: int) -> None:
        self.comm, self.mesh_dim = comm, mesh_dim
        self.group = comm.mesh.get_group(mesh_dim)
        self.size, self.index = comm.mesh.size(mesh_dim), comm.coordinate[mesh_dim]
        self.next = dist.get_global_rank(self.group, (self.index + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.index - 1) % self.size)

    def start(self, tensors: list[torch.Tensor], phase: str, tag: int) -> Wait:
        self.comm.record_bytes(phase, SEND_RECV, self.mesh_dim, sum(t.numel() * t.element_size() for t in tensors))
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        self.comm.settle()
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        works = dist.batch_isend_irecv(ops)

        def wait() -> list[torch.Tensor]:
            for w in works:
                w.wait()
            return received
        return wait


class RingSchedule:
    """One call's ring: the link, the rows' positions, each block's pieces, the kernel's options."""

    def __init__(self, link: RingLink, q_positions: torch.Tensor, q_chunk: int, blocks: list[torch.Tensor],
                 k_chunk: int, causal: bool, scale: float | None) -> None:
        self.link, self.q_positions, self.blocks, self.scale = link, q_positions, blocks, scale
        self.pieces = [step_pieces(q_positions, q_chunk, b, k_chunk, causal) for b in blocks]

    def source(self, step: int) -> int:
        return (self.link.index - step) % self.link.size


def merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one piece's (out, lse) into the running ones (fp32 or wider, in place); rows that saw
    no key yet have lse -inf and weigh nothing."""
    total = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weight = torch.exp(part_lse - finite).unsqueeze(-1)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(part.to(out.dtype) * weight)
    lse.copy_(total)


def _piece_mask(piece: Piece, mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask (the kernel takes the query's dtype) of one piece: the call's own mask
    at the piece's rows and its keys' columns, and the causal mask where the piece needs one."""
    own = None
    if mask is not None:
        own = mask.narrow(-2, piece.q_first, piece.q_count) if mask.ndim >= 2 and mask.shape[-2] > 1 else mask
        if own.shape[-1] > 1:  # the key dim is whole: the block's columns by their global positions
            own = own.index_select(-1, k_pos.to(own.device))
        own = torch.zeros(own.shape, dtype=dtype, device=own.device).masked_fill(~own, float("-inf")) \
            if own.dtype == torch.bool else own.to(dtype)
    if piece.mode == MASKED or (piece.mode == DIAGONAL and own is not None):
        forbidden = k_pos.to(q_pos.device)[None, :] > q_pos[:, None]
        causal = torch.zeros(forbidden.shape, dtype=dtype, device=forbidden.device)
        causal = causal.masked_fill(forbidden, float("-inf"))
        own = causal if own is None else own + causal
    return own


def _slices(piece: Piece, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (q.narrow(-2, piece.q_first, piece.q_count), k.narrow(-2, piece.k_first, piece.k_count),
            v.narrow(-2, piece.k_first, piece.k_count))


def _piece_args(s: RingSchedule, step: int, piece: Piece, mask: torch.Tensor | None, dtype: torch.dtype
                ) -> tuple[torch.Tensor | None, bool]:
    q_pos = s.q_positions[piece.q_first:piece.q_first + piece.q_count]
    k_pos = s.blocks[s.source(step)][piece.k_first:piece.k_first + piece.k_count]
    m = _piece_mask(piece, mask, q_pos, k_pos, dtype)
    return m, piece.mode == DIAGONAL and m is None  # the kernel's own causal mask on the diagonal


def ring_forward(s: RingSchedule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.promote_types(q.dtype, torch.float32)  # the kernel's log-sum-exp dtype; fp32 at least
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    blocks = [k, v]
    for step in range(s.link.size):
        arriving = s.link.start(blocks, "forward", 1) if step < s.link.size - 1 else None
        for piece in s.pieces[s.source(step)]:
            m, causal = _piece_args(s, step, piece, mask, q.dtype)
            qs, ks, vs = _slices(piece, q, *blocks)
            part, part_lse = KERNEL(qs, ks, vs, 0.0, causal, attn_mask=m, scale=s.scale)
            if m is not None:  # the kernel returns lse 0 for a row every key is masked from: nothing seen
                part_lse = part_lse.masked_fill(m.isneginf().all(-1).expand_as(part_lse), float("-inf"))
            merge(out.narrow(-2, piece.q_first, piece.q_count), lse.narrow(-1, piece.q_first, piece.q_count),
                  part, part_lse)
        if arriving is not None:
            blocks = arriving()
    return out.to(q.dtype), lse


def ring_backward(s: RingSchedule, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = s.link.size
    dq = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    blocks, owed, carried = [k, v], None, None
    for step in range(n):
        arriving = s.link.start(blocks, "backward", 1) if step < n - 1 else None
        parts = []
        for piece in s.pieces[s.source(step)]:
            m, causal = _piece_args(s, step, piece, mask, q.dtype)
            qs, ks, vs = _slices(piece, q, *blocks)
            rows = (grad.narrow(-2, piece.q_first, piece.q_count), out.narrow(-2, piece.q_first, piece.q_count),
                    lse.narrow(-1, piece.q_first, piece.q_count))
            parts.append((piece, KERNEL_BACKWARD(rows[0], qs, ks, vs, rows[1], rows[2], 0.0, causal, attn_mask=m,
                                                 scale=s.scale)))
        # the block's accumulators: made here at step 0, else the previous rank's, arriving
        carried = [torch.zeros_like(k), torch.zeros_like(v)] if owed is None else owed()
        for piece, (dq_part, dk_part, dv_part) in parts:
            dq.narrow(-2, piece.q_first, piece.q_count).add_(dq_part)
            carried[0].narrow(-2, piece.k_first, piece.k_count).add_(dk_part)
            carried[1].narrow(-2, piece.k_first, piece.k_count).add_(dv_part)
        owed = s.link.start(carried, "backward", 2)
        if arriving is not None:
            blocks = arriving()
    assert owed is not None
    dk, dv = owed()  # home: every rank's rows have added to them
    return dq.to(q.dtype), dk, dv


class RingFunction(torch.autograd.Function):
    """(out, lse) of ring attention; backward by the ring (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                schedule: RingSchedule) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = ring_forward(schedule, q, k, v, mask)
        ctx.schedule, ctx.mask = schedule, mask
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.schedule, grad.contiguous(), q, k, v, ctx.mask, out, lse)
        return dq, dk, dv, None, None


def ring_call(link: RingLink, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], q_placements: str,
              kv_placements: str, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], ring: int,
              zigzag: frozenset[int]) -> Any:
    """``target(*args, **kwargs)`` (an attention call planned as ring attention on mesh dim
    ``ring``) on this rank's rows and key block: its output, and for the CPU kernel its
    log-sum-exp too (as the op returns them)."""
    if target not in ATTENTION_OPS:
        raise ValueError(f"ring attention runs {sorted(map(str, ATTENTION_OPS))}, not {target}")
    bound = dict(zip([a.name for a in target._schema.arguments], positional_args(target, args, kwargs)))
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound["attn_mask"]
    if float(bound.get("dropout_p") or 0.0) > 0.0:
        raise ValueError("ring attention does not draw dropout (rules.attention does not offer it)")
    if mask is not None and mask.requires_grad:
        raise ValueError("ring attention takes no gradient for attn_mask")
    qp, kp = parse_placements(q_placements), parse_placements(kv_placements)
    dim = q.ndim - 2
    q_positions = query_positions(q.shape[-2], dim, qp, mesh_shape, coordinate, zigzag)
    blocks = [block_positions(k.shape[-2], k.ndim - 2, kp, mesh_shape, coordinate, ring, src, zigzag)
              for src in range(mesh_shape[ring])]
    schedule = RingSchedule(link, q_positions.to(q.device), q.shape[-2] // held_chunks(dim, qp, zigzag), blocks,
                            k.shape[-2] // held_chunks(k.ndim - 2, kp, zigzag), bool(bound["is_causal"]),
                            bound.get("scale"))
    if q.ndim == 3:  # the kernel takes (batch, heads, seq, dim): one head, the mask's dims aligned alike
        q, k, v = q.unsqueeze(-3), k.unsqueeze(-3), v.unsqueeze(-3)
        mask = mask.unsqueeze(-3) if mask is not None and mask.ndim >= 3 else mask
        out, lse = RingFunction.apply(q, k, v, mask, schedule)
        out, lse = out.squeeze(-3), lse.squeeze(-2)
    else:
        out, lse = RingFunction.apply(q, k, v, mask, schedule)
    return out if target is aten.scaled_dot_product_attention.default else (out, lse)


class RingAttention(nn.Module):
    """``self.ring_attention(op, q_placements, kv_placements, ring_dim, *args, **kwargs)``."""

    def __init__(self, comm: Comm, zigzag: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.comm, self.zigzag = comm, frozenset(zigzag)
        self.links: dict[int, P2PLink] = {}

    def forward(self, op: str, q_placements: str, kv_placements: str, ring: int, *args: Any, **kwargs: Any) -> Any:
        link = self.links.get(ring)
        if link is None:
            link = self.links[ring] = P2PLink(self.comm, ring)
        return ring_call(link, _resolve(op), args, kwargs, q_placements, kv_placements, tuple(self.comm.mesh.shape),
                         tuple(self.comm.coordinate), ring, self.zigzag)


def check_ring_device(device_type: str, rings: int) -> None:
    """Refuse ring attention off the CPU: its kernel is the CPU flash kernel (module docstring)."""
    if rings and device_type != "cpu":
        raise InputError(f"the plan runs {rings} attention call(s) as ring attention, which runs on CPU meshes only "
                         f"so far (its kernel is {KERNEL}), not {device_type!r}: pin context_attention='allgather'")
