"""``passes.localize_losses``: a batch-split 'mean' loss becomes local sum / global count.

``self.partial_mean_loss(op, count_dims, count, *args)`` (``runtime.ops.PartialMeanLoss``): each
rank's value is its share of the global mean, so the ranks' values sum to it. The count is a
constant where shapes fix it, counted on the whole targets where every rank received them, else
summed over the split mesh dims."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from autopar.passes.localize_losses import localize_losses
from autopar.runtime.losses import PartialMeanLoss
from autopar.runtime.ops import Comm

from .filecheck import check
from .pinned import SliceRows, graph_module, op, pin, propagate, strategy

aten = torch.ops.aten
NO_COMM = cast(Comm, None)
"""A PartialMeanLoss given no count dims never touches its communicator."""


def _loss(target: object, x: torch.Tensor, t: torch.Tensor, resharded: bool = False, **modules: torch.nn.Module
          ) -> torch.fx.GraphModule:
    """``loss = target(x, t)``; ``resharded``: x and t sliced to the rank's rows first, as
    insert_reshards writes it for inputs every rank receives whole."""
    graph = torch.fx.Graph()
    xs, ts = graph.placeholder("x"), graph.placeholder("t")
    if resharded:
        xs, ts = (graph.call_module("reshard", (a, "R", "S(0)")) for a in (xs, ts))
    graph.output(op(graph, "loss", target, xs, ts))
    return propagate(graph_module(graph, **modules), x, t)


SPLIT = {"x": strategy("S(0)"), "t": strategy("S(0)"), "loss": strategy("P", "S(0)", "S(0)")}
"""The loss computed on the rank's rows: a Partial of the global loss."""


def test_a_loss_whose_count_the_shapes_fix_divides_by_a_constant() -> None:
    """mse over x (8, 4): the count is 32 on every rank, whatever its rows; the two ranks'
    values sum to the global mean."""
    x, t = torch.randn(8, 4), torch.randn(8, 4)
    gm = _loss(aten.mse_loss.default, x, t, partial_mean_loss=PartialMeanLoss(NO_COMM))
    localize_losses(gm, pin(gm, SPLIT, {"dp": 2}, input_sharded=True))
    check(gm, """
        CHECK:      def forward(self, x, t):
        CHECK-NEXT: partial_mean_loss = self.partial_mean_loss('aten.mse_loss.default', (), 32.0, x, t, 1)
        CHECK-NEXT: return partial_mean_loss
        CHECK-NOT:  aten.mse_loss
    """)
    torch.testing.assert_close(gm(x[:4], t[:4]) + gm(x[4:], t[4:]), F.mse_loss(x, t))


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (8, 5) and class ids with 3 of rank 0's 4 rows ignored: the ranks' counts differ."""
    return torch.randn(8, 5), torch.tensor([-100, -100, -100, 1, 2, 3, 4, 0])


def test_a_count_the_data_decides_is_taken_on_the_whole_targets() -> None:
    """Cross entropy on class ids counts the ids not ignored: every rank received all targets,
    so it counts them there (no collective) while its loss reads its own rows. Run as rank 0 and
    rank 1 (each slicing the whole inputs), the two values sum to the global mean."""
    x, t = _ids()
    values = []
    for rank in (0, 1):
        gm = _loss(aten.cross_entropy_loss.default, x, t, resharded=True,
                   partial_mean_loss=PartialMeanLoss(NO_COMM), reshard=SliceRows(rank, 2))
        localize_losses(gm, pin(gm, SPLIT, {"dp": 2}))
        values.append(gm(x, t))
    check(gm, """
        CHECK:      reshard_1 = self.reshard(t, 'R', 'S(0)')
        CHECK-NEXT: partial_mean_loss = self.partial_mean_loss('aten.cross_entropy_loss.default', (), t, reshard, reshard_1, None, 1, -100, 0.0)
    """)
    torch.testing.assert_close(values[0] + values[1], F.cross_entropy(x, t))


def test_a_count_of_split_targets_is_summed_over_the_split_mesh_dims() -> None:
    """Inputs that arrive split (no whole targets anywhere), on a dp x tp mesh with the loss
    Partial on dp only: the local counts are summed over mesh dim 0."""
    x, t = _ids()
    gm = _loss(aten.cross_entropy_loss.default, x, t)
    chosen = {"x": strategy("S(0)R"), "t": strategy("S(0)R"), "loss": strategy("PR", "S(0)R", "S(0)R")}
    localize_losses(gm, pin(gm, chosen, {"dp": 2, "tp": 2}, input_sharded=True))
    check(gm, "CHECK: self.partial_mean_loss('aten.cross_entropy_loss.default', (0,), None, x, t, None, 1, -100, 0.0)")


@pytest.mark.parametrize("target, reduction", [(aten.mse_loss.default, 1), (aten.mse_loss.default, 2),
                                               (aten.cross_entropy_loss.default, 1)])
def test_a_replicated_loss_or_a_sum_is_left_as_captured(target: object, reduction: int) -> None:
    """A loss every rank computes whole is the global mean already; a Partial 'sum' (reduction 2)
    sums as it is. Neither is rewritten."""
    x, t = (torch.randn(8, 4), torch.randn(8, 4)) if target is aten.mse_loss.default else _ids()
    gm = _loss(target, x, t)
    loss = next(n for n in gm.graph.nodes if n.name == "loss")
    loss.args = (*loss.args, None, reduction) if target is aten.cross_entropy_loss.default else (*loss.args, reduction)
    gm.recompile()
    placed = SPLIT if reduction == 2 else {"x": strategy("R"), "t": strategy("R"), "loss": strategy("R", "R", "R")}
    before = gm.code
    localize_losses(gm, pin(gm, placed, {"dp": 2}, input_sharded=True))
    assert gm.code == before


def test_micro_batches_weigh_a_replicated_loss_by_its_data_decided_count() -> None:
    """With micro-batches, a replicated cross entropy on class ids also runs through
    ``partial_mean_loss`` (no dims, its whole targets counted): the same value, and the runtime
    reads the count to weigh the micro-batch. mse's count is fixed: left as captured."""
    x, t = _ids()
    gm = _loss(aten.cross_entropy_loss.default, x, t, partial_mean_loss=PartialMeanLoss(NO_COMM))
    replicated = {"x": strategy("R"), "t": strategy("R"), "loss": strategy("R", "R", "R")}
    localize_losses(gm, pin(gm, replicated, {"dp": 2}, input_sharded=True, micro_batches=2))
    check(gm, "CHECK: self.partial_mean_loss('aten.cross_entropy_loss.default', (), None, x, t, None, 1, -100, 0.0)")
    torch.testing.assert_close(gm(x, t), F.cross_entropy(x, t))
    assert gm.get_submodule("partial_mean_loss").last_count == 5

    gm = _loss(aten.mse_loss.default, torch.randn(8, 4), torch.randn(8, 4))
    before = gm.code
    localize_losses(gm, pin(gm, replicated, {"dp": 2}, input_sharded=True, micro_batches=2))
    assert gm.code == before
