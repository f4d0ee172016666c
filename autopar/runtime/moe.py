"""Expert parallelism for a dropless expert layer (``autopar::moe_experts``, ``capture.moe``):
what ``self.moe_dispatch_combine(x, ids, weights, gate_up, down, grouped_mm, mesh_dim)`` runs
(``passes.expert_parallel`` writes the calls).

The rank holds its tokens' rows ``x (T_l, H)`` with their expert ids and router weights, and the
experts ``[r * E_l, (r + 1) * E_l)`` of the ``n`` ranks along ``mesh_dim``. It sorts its (token,
choice) pairs by expert, so the rows bound for each rank are contiguous, and:

1. counts its pairs per expert and exchanges the counts (an equal-split all-to-all of ``E``
   ints, outside autograd): each rank learns how many rows it receives, per source and local expert;
2. sends the rows to their experts' ranks by a variable-split all-to-all
   (``all_to_all_single_autograd``: its backward is the all-to-all with the splits swapped);
3. puts the received rows in local-expert order (they arrive by source rank) and runs the
   experts' SwiGLU with the grouped matmul the captured region used;
4. restores the arrival order and sends the rows back (the reverse all-to-all);
5. weights each pair by its router probability, undoes its sort and sums each token's choices,
   as one device does (``capture.moe.combine_pairs``).

Each pair meets the same expert weights and is summed in the same order as on one device, so
the result is the single-device one up to the matmuls' rounding. With the experts' ``F`` also
split on another mesh dim (tensor parallel inside the experts) the rows come back as partial
sums, which the all-to-all and the combine carry linearly (the output is Partial there).

The collectives are logged in the ``CollectiveLog`` like any other, the row all-to-alls with
``DATA_DEPENDENT`` bytes (the plan lists them at the expected bytes, ``cost.moe``), their
backward when the gradient reaches them.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as fc
from torch import nn

from autopar.capture.moe import combine_pairs, sort_pairs, swiglu_rows
from autopar.rules.redistribute import ALL_TO_ALL
from autopar.runtime.ops import DATA_DEPENDENT, Comm


class ExpertDispatch(nn.Module):
    """``self.moe_dispatch_combine(x, ids, weights, gate_up, down, grouped_mm, mesh_dim)``: the
    expert layer with its experts split along ``mesh_dim`` (module docstring)."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, grouped_mm: str, mesh_dim: int) -> torch.Tensor:
        n = self.comm.mesh.size(mesh_dim)
        local_experts = gate_up.shape[0]
        top_k = ids.shape[-1]
        sorted_ids, perm = sort_pairs(ids)
        rows = x[perm // top_k]
        counts, received = self._exchange_counts(sorted_ids, local_experts * n, mesh_dim)
        with torch.no_grad():
            sent = counts.view(n, local_experts).sum(1).tolist()
            arrived = received.sum(1).tolist()
            # arrival order is (source rank, local expert); the experts need their rows together
            expert_of_row = torch.arange(local_experts, device=ids.device).repeat(n).repeat_interleave(
                received.reshape(-1))
            order = torch.sort(expert_of_row, stable=True).indices
            offs = torch.cumsum(received.sum(0), dim=0, dtype=torch.int32)
        rows = self._all_to_all(rows, arrived, sent, mesh_dim)
        out = swiglu_rows(rows[order], offs, gate_up, down, grouped_mm)
        out = torch.empty_like(out).index_copy(0, order, out)  # back in arrival order
        out = self._all_to_all(out, sent, arrived, mesh_dim)
        return combine_pairs(out, perm, weights, top_k).to(x.dtype)

    def _exchange_counts(self, sorted_ids: torch.Tensor, experts: int, mesh_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's pairs per expert ``(E,)``, and the rows each source rank sends this rank per
        local expert ``(n, E_l)`` (int64)."""
        n = self.comm.mesh.size(mesh_dim)
        with torch.no_grad():
            valid = bool(((sorted_ids >= 0) & (sorted_ids < experts)).all())
            # an id out of range is sent as counts of -1, so that every rank raises, not one alone
            # (the others would wait in the rows' all-to-all for it)
            counts = torch.bincount(sorted_ids, minlength=experts) if valid else \
                torch.full((experts,), -1, dtype=torch.int64, device=sorted_ids.device)
            self.comm.record_bytes("forward", ALL_TO_ALL, mesh_dim, counts.numel() * counts.element_size())
            self.comm.settle()
            received = fc.wait_tensor(fc.all_to_all_single(counts, None, None, (self.comm.mesh, mesh_dim)))
        if not valid or bool((received < 0).any()):
            raise ValueError(f"an expert id outside [0, {experts}) on some rank of mesh dim {mesh_dim}: the router "
                             "must choose among the layer's experts")
        return counts, received.view(n, experts // n)

    def _all_to_all(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    mesh_dim: int) -> torch.Tensor:
        """Rows to the ranks along ``mesh_dim`` (``input_splits[j]`` to rank j, ``output_splits[i]``
        from rank i), differentiable: the gradient goes back the same way, logged when it does."""
        self.comm.record_bytes("forward", ALL_TO_ALL, mesh_dim, DATA_DEPENDENT)
        self.comm.settle()
        out = fc.wait_tensor(fc.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits,
                                                           (self.comm.mesh, mesh_dim)))
        if out.requires_grad:
            out.register_hook(lambda grad: self._backward_all_to_all(mesh_dim))
        return out

    def _backward_all_to_all(self, mesh_dim: int) -> None:
        """Runs just before the rows' all-to-all in backward: logs it, and lets what is in flight finish first."""
        self.comm.record_bytes("backward", ALL_TO_ALL, mesh_dim, DATA_DEPENDENT)
        self.comm.settle()
