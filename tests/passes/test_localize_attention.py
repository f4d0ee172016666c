"""``passes.localize_attention``: a causal attention whose queries are split on the sequence runs
on its rows' global positions (``self.context_attention``), one planned as ring attention (keys
split on the sequence too) as ``self.ring_attention``; every other attention as captured."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from autopar.passes.localize_attention import localize_attention
from autopar.rules.strategy import Strategy
from autopar.runtime.attention import ContextAttention

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

aten = torch.ops.aten
SDPA = "'aten.scaled_dot_product_attention.default'"
Q, K, V = (torch.randn(1, 2, 8, 4) for _ in range(3))  # (batch, heads, sequence, head dim)


def _attention(causal: bool = True, by_name: bool = False, **modules: torch.nn.Module) -> torch.fx.GraphModule:
    """sdpa(q, k, v) as export writes it: ``(q, k, v, None, 0.0, is_causal)``, or ``is_causal`` by name."""
    graph = torch.fx.Graph()
    q, k, v = graph.placeholder("q"), graph.placeholder("k"), graph.placeholder("v")
    if by_name:
        sdpa = op(graph, "sdpa", aten.scaled_dot_product_attention.default, q, k, v, is_causal=causal)
    else:
        sdpa = op(graph, "sdpa", aten.scaled_dot_product_attention.default, q, k, v, None, 0.0, causal)
    graph.output(sdpa)
    return propagate(graph_module(graph, **modules), Q, K, V)


def _placed(q: str, kv: str, out: str | None = None) -> dict[str, Strategy]:
    return {"q": strategy(q), "k": strategy(kv), "v": strategy(kv), "sdpa": strategy(out or q, q, kv, kv)}


def test_a_causal_attention_split_on_its_queries_runs_their_causal_rows() -> None:
    """q split on the sequence over 2 ranks, keys whole: ``is_causal`` alone would align the
    rank's first row with the first key, so the call goes to the runtime with q's placements.
    Rank 0's and rank 1's rows, put together, are the whole causal attention."""
    rows = []
    for rank in (0, 1):
        gm = _attention(context_attention=ContextAttention((2,), (rank,)))
        localize_attention(gm, pin(gm, _placed("S(2)", "R"), {"cp": 2}))
        rows.append(gm(Q.chunk(2, dim=2)[rank], K, V))
    check(gm, f"""
        CHECK:      def forward(self, q, k, v):
        CHECK-NEXT: context_attention = self.context_attention({SDPA}, 'S(2)', q, k, v, None, 0.0, True)
        CHECK-NEXT: return context_attention
        CHECK-NOT:  aten.scaled_dot_product_attention
    """)
    torch.testing.assert_close(torch.cat(rows, dim=2), F.scaled_dot_product_attention(Q, K, V, is_causal=True))


def test_is_causal_by_name_stays_a_keyword() -> None:
    """The call keeps the captured call's keywords: the runtime calls the op with them."""
    gm = _attention(by_name=True)
    localize_attention(gm, pin(gm, _placed("S(2)", "R"), {"cp": 2}))
    check(gm, f"CHECK: context_attention = self.context_attention({SDPA}, 'S(2)', q, k, v, is_causal = True)")


@pytest.mark.parametrize("causal, q, mesh", [
    (False, "S(2)", {"cp": 2}),  # no mask: a rank's rows need nothing of their positions
    (True, "S(0)", {"dp": 2}),  # split on batch
    (True, "S(1)", {"tp": 2}),  # split on heads
    (True, "RS(2)", {"dp": 2, "cp": 1}),  # split on a mesh dim of one device: every rank has all rows
])
def test_other_attention_calls_run_as_captured(causal: bool, q: str, mesh: dict[str, int]) -> None:
    """Non-causal, batch- or head-split, or split on the sequence by a mesh dim of size 1."""
    gm = _attention(causal)
    kv = q if "S(2)" not in q else "R" * len(mesh)  # keys split as q on batch or heads, whole on a sequence split
    before = gm.code
    localize_attention(gm, pin(gm, _placed(q, kv), mesh))
    assert gm.code == before


@pytest.mark.parametrize("causal", [True, False])
def test_keys_split_on_the_sequence_run_ring_attention(causal: bool) -> None:
    """Keys and values split on the sequence as well: ring attention, causal or not, its call
    naming q's and the keys' placements and the mesh dim the ring runs on."""
    gm = _attention(causal)
    localize_attention(gm, pin(gm, _placed("RS(2)", "RS(2)"), {"dp": 2, "cp": 2}))
    check(gm, f"""
        CHECK:      ring_attention = self.ring_attention({SDPA}, 'RS(2)', 'RS(2)', 1, q, k, v, None, 0.0, {causal})
        CHECK-NOT:  context_attention
    """)
