"""Attention on 3-D ``(batch, seq, dim)`` and 4-D ``(batch, heads, seq, head_dim)`` inputs
trains to the single-device numbers when compiled: loss, every gradient (whole tensors)
and every parameter after 3 AdamW steps, on gloo ranks forked from this process.

A 3-D call has one leading (batch) dim: its dim 1 is the sequence, and splitting the keys
there would make each rank attend to its own keys only. A ``SequenceParallel`` pin on the
norm before the attention puts sequence-split activations right next to it, so the
planner is tempted to keep that split through the attention (as it once did).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from numerics_harness import Reference, reference, run_compiled, run_checked
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import autopar

VOCAB, DIM, HEADS, BATCH, SEQ = 32, 16, 4, 4, 8


class TinyAttentionLM(nn.Module):
    """Embedding, a pre-norm attention block, a head. ``heads=None`` runs SDPA on the 3-D
    ``(batch, seq, dim)`` projections; otherwise on 4-D ``(batch, heads, seq, head_dim)``.
    With ``masked`` keys at padding tokens (id 0) are masked out on top of a causal mask
    (an explicit boolean mask); without, the attention is ``is_causal=True``. With ``causal=False``
    the same without the causal part (bidirectional: the padding mask alone, or no mask)."""

    def __init__(self, heads: int | None, masked: bool, causal: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.masked = masked
        self.causal = causal
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril() if self.causal else True
        keep = tokens != 0
        is_causal = self.causal and not self.masked
        if self.heads is None:
            mask = keep[:, None, :] & causal if self.masked else None  # (b, s, s), or (b, 1, s) non-causal
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        else:
            q, k, v = (t.view(b, s, self.heads, DIM // self.heads).transpose(1, 2) for t in (q, k, v))
            mask = keep[:, None, None, :] & causal if self.masked else None  # (b, 1, s, s), or (b, 1, 1, s)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
            y = y.transpose(1, 2).reshape(b, s, DIM)
        return self.head(x + self.proj(y))


def build(heads: int | None, masked: bool = True
          ) -> tuple[nn.Module, tuple[torch.Tensor], Callable[..., torch.Tensor], tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyAttentionLM(heads, masked)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    tokens[:, 0] = 1  # every query keeps at least its first key
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)

    def loss_fn(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), t.flatten())

    return model, (tokens,), loss_fn, (targets,)


SEQ_PIN = {"norm": SequenceParallel()}
TP_PIN = {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}


@dataclass(frozen=True)
class Case:
    heads: int | None
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    pins: str = "free"
    """'free', 'seq' (SequenceParallel on the norm) or 'tp' (Megatron qkv / proj)."""
    axis: str = "tp"
    masked: bool = True

    @property
    def id(self) -> str:
        return (f"{'3d' if self.heads is None else '4d'}-{'mask' if self.masked else 'causal'}-"
                f"{'x'.join(map(str, self.mesh))}-{self.pins}-{self.axis}")

    def compile_kwargs(self) -> dict[str, Any]:
        if self.pins == "free":
            return {}
        return {"constraints": SEQ_PIN if self.pins == "seq" else TP_PIN, "constraint_axis": self.axis}


CASES = [
    Case(None, (2,), ("dp",)), Case(None, (2,), ("dp",), "seq", "dp"),
    Case(None, (2,), ("dp",), "seq", "dp", masked=False), Case(None, (2, 2), ("dp", "tp"), masked=False),
    Case(None, (2, 2), ("dp", "tp")), Case(None, (2, 2), ("dp", "tp"), "seq"),
    Case(HEADS, (2,), ("dp",)), Case(HEADS, (2, 2), ("dp", "tp")), Case(HEADS, (2, 2), ("dp", "tp"), "seq"),
    Case(HEADS, (2, 2), ("dp", "tp"), "tp"),
]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = build(case.heads, case.masked)
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **case.compile_kwargs(),
                         pipeline=False)
    sdpa = [n for n in pm.plan.nodes if n.op == "aten.scaled_dot_product_attention.default"]
    return {**run_compiled(pm, (*inputs, *targets), ref), "sdpa_inputs": [n.inputs for n in sdpa]}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_attention_matches_single_device(case: Case) -> None:
    ref = reference(lambda: build(case.heads, case.masked))
    results = run_checked(train_on_rank, case.mesh, case, ref)
    assert len(results[0]["sdpa_inputs"]) == 1


@pytest.mark.parametrize("masked", [True, False])
def test_3d_attention_never_splits_the_sequence(masked: bool) -> None:
    """Planning alone: with sequence-split activations pinned next to it, the 3-D attention
    still takes k and v whole along dim 1 (the sequence) on every mesh axis (q may come
    split there: context parallelism, ``test_numerics_context``)."""
    model, inputs, loss_fn, targets = build(None, masked)
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, "cpu"), inputs, loss_fn=loss_fn,
                        example_targets=targets, constraints=SEQ_PIN)
    (sdpa,) = [n for n in plan.nodes if n.op == "aten.scaled_dot_product_attention.default"]
    assert all("S(1)" not in placements for placements in sdpa.inputs[1:3]), sdpa.inputs
