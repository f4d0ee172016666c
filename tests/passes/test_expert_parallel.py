"""``passes.expert_parallel``: a dropless expert layer (``autopar::moe_experts``) whose experts the
plan splits becomes ``self.moe_dispatch_combine(x, ids, weights, gate_up, down, grouped_mm,
mesh_dim)``: the rank holds only its experts, so its (token, expert) pairs travel to their
experts' ranks and back (``runtime.moe``, all-to-alls: not run here). Any other placement runs
the op as captured."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from autopar.capture.moe import MOE_EXPERTS
from autopar.errors import InputError
from autopar.passes.expert_parallel import expert_parallel
from autopar.rules.strategy import Strategy

from .filecheck import check
from .pinned import graph_module, op, pin, propagate, strategy

GROUPED_MM = "aten::_grouped_mm"


def _experts() -> torch.fx.GraphModule:
    """moe_experts over 4 tokens (hidden 8), top-2 of 4 experts (F = 4), as capture collapses
    Hugging Face's sorted expert region."""
    graph = torch.fx.Graph()
    x, ids, weights, gate_up, down = (graph.placeholder(n) for n in ("x", "ids", "weights", "gate_up", "down"))
    graph.output(op(graph, "moe", MOE_EXPERTS, x, ids, weights, gate_up, down, GROUPED_MM))
    return propagate(graph_module(graph), torch.randn(4, 8), torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]]),
                     torch.rand(4, 2), torch.randn(4, 8, 8), torch.randn(4, 8, 4))


def _placed(tokens: str, gate_up: str, down: str, out: str) -> dict[str, Strategy]:
    """Tokens (x, ids, weights) placed ``tokens``, the expert weights as given."""
    return {"x": strategy(tokens), "ids": strategy(tokens), "weights": strategy(tokens), "gate_up": strategy(gate_up),
            "down": strategy(down), "moe": strategy(out, tokens, tokens, tokens, gate_up, down)}


def _params() -> dict[str, str]:
    return {"gate_up": "experts.gate_up_proj", "down": "experts.down_proj"}


def test_experts_split_on_a_mesh_dim_dispatch_their_pairs() -> None:
    """Tokens and experts split on ep: the call moves to the runtime with every schema
    argument and the mesh dim its all-to-alls run on."""
    gm = _experts()
    expert_parallel(gm, pin(gm, _placed("S(0)", "S(0)", "S(0)", "S(0)"), {"ep": 2}, params=_params()))
    check(gm, f"""
        CHECK:      def forward(self, x, ids, weights, gate_up, down):
        CHECK-NEXT: moe_dispatch_combine = self.moe_dispatch_combine(x, ids, weights, gate_up, down, '{GROUPED_MM}', 0)
        CHECK-NEXT: return moe_dispatch_combine
        CHECK-NOT:  autopar.moe_experts
    """)


def test_the_call_names_the_expert_axis_of_a_two_dim_mesh() -> None:
    """Experts split on ep, mesh dim 1 of dp x ep."""
    gm = _experts()
    expert_parallel(gm, pin(gm, _placed("S(0)S(0)", "RS(0)", "RS(0)", "S(0)S(0)"), {"dp": 2, "ep": 2},
                            params=_params()))
    check(gm, f"CHECK: self.moe_dispatch_combine(x, ids, weights, gate_up, down, '{GROUPED_MM}', 1)")


@pytest.mark.parametrize("tokens, gate_up, down, out, mesh", [
    ("S(0)", "R", "R", "S(0)", {"dp": 2}),  # every expert on every rank, tokens split
    ("R", "S(1)", "S(2)", "P", {"tp": 2}),  # F split inside each expert: a Partial sum
    ("RS(0)", "S(0)R", "S(0)R", "RS(0)", {"ep": 1, "dp": 2}),  # experts split on a mesh dim of one device
])
def test_experts_every_rank_holds_run_as_captured(tokens: str, gate_up: str, down: str, out: str,
                                                  mesh: dict[str, int]) -> None:
    """Where the rank holds every expert (whole, or its slice of each) its pairs stay on it."""
    gm = _experts()
    before = gm.code
    expert_parallel(gm, pin(gm, _placed(tokens, gate_up, down, out), mesh, params=_params()))
    assert gm.code == before


def test_experts_split_on_two_mesh_axes_are_refused() -> None:
    """Expert parallelism runs its all-to-alls on one axis (the rule marks it exclusive, so a plan
    never asks for two): a hand-made plan that does is refused, naming the axes."""
    gm = _experts()
    pc = pin(gm, _placed("S(0)S(0)", "S(0)S(0)", "S(0)S(0)", "S(0)S(0)"), {"dp": 2, "ep": 2}, params=_params())
    with pytest.raises(InputError, match=r"experts split on mesh axes \['dp', 'ep'\]"):
        expert_parallel(gm, pc)
