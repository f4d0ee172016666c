"""``passes.localize_embedding``: a lookup in a table split by its rows (the vocabulary) becomes a
``self.vocab_embedding`` call: each rank looks up the ids its rows hold and gives zero rows for the
others (``runtime.vocab.VocabEmbedding``), a Partial that sums to the whole lookup."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from autopar.passes.localize_embedding import localize_embedding
from autopar.runtime.vocab import VocabEmbedding

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

aten = torch.ops.aten
TABLE, IDS = torch.randn(10, 3), torch.tensor([[0, 4, 5, 9], [2, 7, 1, 5]])


def _lookup(**modules: torch.nn.Module) -> torch.fx.GraphModule:
    """embedding(w (10, 3), ids (2, 4)), as export writes ``nn.Embedding``."""
    graph = torch.fx.Graph()
    w, ids = graph.placeholder("w"), graph.placeholder("ids")
    graph.output(op(graph, "embedding", aten.embedding.default, w, ids))
    return propagate(graph_module(graph, **modules), TABLE, IDS)


def test_a_lookup_in_a_row_split_table_becomes_a_vocab_embedding_call() -> None:
    """Table rows split over 2 ranks, ids whole: the call names the table's placements and every
    schema argument (defaults filled in). Rank 0 and rank 1, each with its 5 rows, sum to the
    lookup in the whole table."""
    chosen = {"w": strategy("S(0)"), "ids": strategy("R"), "embedding": strategy("P", "S(0)", "R")}
    outputs = []
    for rank in (0, 1):
        gm = _lookup(vocab_embedding=VocabEmbedding((2,), (rank,)))
        localize_embedding(gm, pin(gm, chosen, {"tp": 2}, params={"w": "wte.weight"}))
        outputs.append(gm(TABLE.chunk(2)[rank], IDS))
    check(gm, """
        CHECK:      def forward(self, w, ids):
        CHECK-NEXT: vocab_embedding = self.vocab_embedding('S(0)', w, ids, -1, False, False)
        CHECK-NEXT: return vocab_embedding
        CHECK-NOT:  aten.embedding
    """)
    torch.testing.assert_close(outputs[0] + outputs[1], F.embedding(IDS, TABLE))


def test_on_a_two_dim_mesh_the_call_names_both_dims() -> None:
    """Rows split on tp, replicated on dp: 'RS(0)' tells the runtime which mesh dim cuts the rows."""
    gm = _lookup()
    chosen = {"w": strategy("RS(0)"), "ids": strategy("S(0)R"), "embedding": strategy("S(0)P", "RS(0)", "S(0)R")}
    localize_embedding(gm, pin(gm, chosen, {"dp": 2, "tp": 2}, params={"w": "wte.weight"}))
    check(gm, "CHECK: vocab_embedding = self.vocab_embedding('RS(0)', w, ids, -1, False, False)")


@pytest.mark.parametrize("table", ["R", "S(1)"])
def test_a_table_not_split_by_rows_is_looked_up_as_captured(table: str) -> None:
    """A replicated table, or one split by its columns (each rank looks up its features of every
    row): every id is on every rank, nothing to rewrite."""
    gm = _lookup()
    out = "R" if table == "R" else "S(2)"
    chosen = {"w": strategy(table), "ids": strategy("R"), "embedding": strategy(out, table, "R")}
    before = gm.code
    localize_embedding(gm, pin(gm, chosen, {"tp": 2}, params={"w": "wte.weight"}))
    assert gm.code == before
