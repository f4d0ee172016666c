"""A dropless mixture-of-experts layer as one op: ``autopar::moe_experts``.

Hugging Face's default experts (``grouped_mm_experts_forward``, transformers 5) sort all ``T * k``
(token, expert) pairs of the batch by expert, gather the tokens, run two grouped matmuls on the
stacked expert weights (SwiGLU between them), weight each pair by its router probability,
undo the sort and sum each token's ``k`` pairs. Op by op, the sort needs every pair on one rank,
so on a data axis the pairs were gathered and every rank computed every token's experts. As a
region, though, the computation is row-wise in the tokens: each token's output depends on its own
row, expert ids and weights, and on the expert weights. ``collapse_moe_regions`` (capture/moe_region.py)
replaces the region by one call of this op, whose rule (``rules.routing.moe_experts_rule``) can
then split the tokens (each rank sorts its own) or, with the tokens, the experts: expert
parallelism, run by ``runtime.moe`` with variable-split all-to-alls.

The op's kernel is composite (``CompositeImplicitAutograd``): it runs the same computation as the
region, with the region's own grouped matmul (named by ``grouped_mm``), so autograd differentiates
it op by op, meta tensors run it (the planner's saved-activation probe) and one device computes
what the captured region computed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MOE_OP_NAME = "autopar::moe_experts"
_LIB = torch.library.Library("autopar", "DEF")
_LIB.define("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor down, str grouped_mm) "
            "-> Tensor")


@functools.lru_cache(maxsize=None)
def grouped_mm_op(name: str) -> torch._ops.OpOverload:
    """The grouped matmul the captured region ran (``"transformers::grouped_mm_fallback"``,
    ``"aten::_grouped_mm"``): its overload, ``(rows, weight (experts, in, out), offs) -> rows``."""
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op).default


def swiglu_rows(rows: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                grouped_mm: str) -> torch.Tensor:
    """Mixtral's expert MLP on rows grouped by expert (groups end at ``offs``):
    ``down(silu(gate(x)) * up(x))``, ``gate_up`` (experts, 2F, H) holding gate then up, ``down``
    (experts, H, F), as HF's ``_grouped_linear`` with ``is_transposed=False``."""
    mm = grouped_mm_op(grouped_mm)
    gate, up = mm(rows, gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
    return mm(F.silu(gate) * up, down.transpose(-2, -1), offs)


def sort_pairs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs sorted by expert: (sorted expert ids, permutation), flat."""
    return torch.sort(ids.reshape(-1))


def expert_offsets(sorted_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Where each expert's group of sorted rows ends (int32, as grouped matmuls take them).
    ``histc`` on floats, as HF counts: its output size is fixed (``bincount``'s is data)."""
    counts = torch.histc(sorted_ids.float(), bins=experts, min=0, max=experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def combine_pairs(out: torch.Tensor, perm: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Sorted pair outputs weighted by their router probability, put back in (token, choice)
    order and summed over each token's choices (in choice order, as HF sums)."""
    out = out * weights.reshape(-1)[perm].unsqueeze(-1)
    with torch.no_grad():
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return out[inverse].view(-1, top_k, out.shape[-1]).sum(dim=1)


def _moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, grouped_mm: str) -> torch.Tensor:
    """The whole layer on one device (or on a rank's tokens with every expert, or with every expert's
    slice of a tensor-parallel split: then the result is that rank's partial sum)."""
    sorted_ids, perm = sort_pairs(ids)
    offs = expert_offsets(sorted_ids, gate_up.shape[0])
    rows = x[perm // ids.shape[-1]]
    out = swiglu_rows(rows, offs, gate_up, down, grouped_mm)
    return combine_pairs(out, perm, weights, ids.shape[-1]).to(x.dtype)


_LIB.impl("moe_experts", _moe_experts, "CompositeImplicitAutograd")
MOE_EXPERTS = torch.ops.autopar.moe_experts.default
"""``moe_experts(x (T, H), ids (T, k), weights (T, k), gate_up (E, 2F, H), down (E, H, F), grouped_mm) -> (T, H)``."""
