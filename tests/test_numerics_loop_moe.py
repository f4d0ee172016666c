"""Mixture-of-experts as Mixtral's transformers 4 code wrote it train to the single-device numbers when
compiled: a loop over the experts, each taking the tokens routed to it (``torch.where``), so each
expert's batch has a data-dependent size (torch.export's unbacked size), kept symbolic in the per-rank
program and planned at its size on the example inputs (``capture.unbacked``). Loss, every gradient and
every parameter after 3 AdamW steps, on gloo ranks forked from this process (``numerics_harness``).

On "dp" the tokens are pinned split (``data_axes``): the routing needs them whole (a rank's
``torch.where`` over its own rows would give local indices), so they are gathered before it. On "tp"
the experts are wide MLPs that the planner splits Megatron-style (the first linear by columns, the
second by rows, the output Partial through ``index_add``), every rank routing all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from numerics_harness import Reference, reference, run_checked, run_compiled
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar


class LoopMoE(nn.Module):
    """Router, top-k, then a loop over the experts, each an MLP on the tokens routed to it."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden)) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            routed = x[token].reshape(token.shape[0], -1)  # a view sized by the routing: kept symbolic
            out = out.index_add(0, token, expert(routed) * weights[token, slot, None])
        return out


class MixtralBlockV4(LoopMoE):
    """transformers 4's ``MixtralSparseMoeBlock.forward``: the choices one-hot encoded and permuted to
    (experts, k, tokens), each expert's ``torch.where`` over its slice, rows flattened by ``reshape(-1, hidden)``
    and added in place (``index_add_``) in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        weights, chosen = torch.topk(self.router(x).softmax(-1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros((tokens, hidden), dtype=x.dtype, device=x.device)
        expert_mask = torch.nn.functional.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(expert_mask[e])
            state = x[None, token].reshape(-1, hidden)
            out.index_add_(0, token, (expert(state) * weights[token, slot, None]).to(x.dtype))
        return out


@dataclass(frozen=True)
class Case:
    axis: str
    top_k: int
    hf4: bool = False
    """transformers 4's Mixtral block (``MixtralBlockV4``) rather than ``LoopMoE``."""

    @property
    def id(self) -> str:
        return f"{self.axis}-top{self.top_k}" + ("-hf4" if self.hf4 else "")

    def build(self) -> Any:
        torch.manual_seed(0)
        hidden, ffn, tokens = (64, 1024, 512) if self.axis == "tp" else (8, 16, 32)
        model = (MixtralBlockV4 if self.hf4 else LoopMoE)(hidden, ffn, experts=4, top_k=self.top_k)
        x, target = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
        return model, (x,), lambda y, t: (y - t).square().mean(), (target,)


CASES = [Case("dp", 1), Case("dp", 2), Case("tp", 1), Case("tp", 2), Case("dp", 2, hf4=True), Case("tp", 2, hf4=True)]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(case.axis,))
    model, inputs, loss_fn, targets = case.build()
    data_axes = ("dp",) if case.axis == "dp" else ()
    # planned on other tokens than it runs on: each expert's batch size then differs from its planning
    # hint, so a size baked into the per-rank program would fail (or compute something else)
    other = (torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)),)
    pm = autopar.compile(model, mesh, other, loss_fn=loss_fn, example_targets=targets, data_axes=data_axes,
                         pipeline=False)
    return {**run_compiled(pm, (*inputs, *targets), ref), "fallbacks": [str(f) for f in pm.plan.fallbacks],
            "experts": {k: v for k, v in pm.plan.parameters.items() if k.startswith("experts.")},
            "sized_by_data": sum(c.data_dependent for c in pm.plan.collectives),
            "indices_reduced": [c.tensor for c in pm.plan.collectives if c.kind == "all_reduce" and c.phase == "forward"
                                and c.consumer.startswith("index")]}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_loop_moe_matches_single_device(case: Case) -> None:
    ref = reference(case.build)
    assert any("router" in k for k in ref.grads), "the router must get a gradient"
    results = run_checked(train_on_rank, (2,), case, ref)
    assert any(r["ran"] for r in results), "nothing ran split: the case checks nothing parallel"
    assert results[0]["fallbacks"] == [], results[0]["fallbacks"]
    if case.axis == "dp":  # rows routed to an expert move between ranks: planned at the hint, logged as data dependent
        assert results[0]["sized_by_data"] > 0
        # a where over the gathered mask gives whole indices: never pinned Partial and all-reduced again
        assert results[0]["indices_reduced"] == [], results[0]["indices_reduced"]
    if case.axis == "tp":  # the experts' MLPs split Megatron-style: the first linear's weight by rows, the second's
        # by columns
        experts = results[0]["experts"]
        assert experts["experts.0.0.weight"] == "S(0)" and experts["experts.0.2.weight"] == "S(1)", experts


def test_a_data_dependent_dim_is_never_split() -> None:
    """A rank's share of a ragged (data-dependent) dim is no contiguous shard: no strategy splits it,
    while its other dims still split (the experts' hidden dim, under tensor parallelism)."""
    from autopar.capture.graph import TensorMeta
    from autopar.rules.strategy import R, S, divides

    meta = TensorMeta((16, 8), torch.float32, frozenset({0}))
    assert not divides(meta, (S(0),), (2,)) and divides(meta, (S(1),), (2,)) and divides(meta, (R,), (2,))
    assert divides(meta, (S(0),), (1,)), "a mesh dim of one splits nothing"
