"""Compiled plans train to the single-device numbers: loss, every gradient, and every
parameter after 3 AdamW steps (``numerics_harness``), on gloo ranks forked from this
process; and the collectives a step runs are exactly those the plan lists."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autopar
from examples import gpt, hf_models, llama
from numerics_harness import Reference, reference, run_compiled, run_checked

HF_LLAMA_TP = hf_models.LLAMA_TP_PLAN


def _hf(builder: Callable[..., Any]) -> Callable[[], Any]:
    def build() -> Any:
        model, inputs, loss_fn, targets = builder()
        model.eval()  # dropout off here; training-mode dropout: test_numerics_random.py
        return model, inputs, loss_fn, targets
    return build


class ViewQKVAttention(gpt.CausalSelfAttention):
    """The example's attention written as timm's ViT does: ``qkv(x).reshape(b, s, 3, heads,
    head_dim).permute(2, 0, 3, 1, 4).unbind(0)`` (same parameters, same math)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)))


def _gpt_view_qkv() -> Any:
    model, inputs, loss_fn, targets = gpt.build()
    for block in model.blocks:
        block.attn.__class__ = ViewQKVAttention
    return model, inputs, loss_fn, targets


def _gpt_bf16() -> Any:
    """The example GPT with bf16 parameters and activations (planned with precision='bf16')."""
    model, inputs, loss_fn, targets = gpt.build()
    return model.to(torch.bfloat16), inputs, loss_fn, targets


def _regression() -> Any:
    """An MLP with F.mse_loss, which broadcasts its input and target (broadcast_tensors)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    gen = torch.Generator().manual_seed(2)
    return model, (torch.randn(32, 16, generator=gen),), torch.nn.functional.mse_loss, (torch.randn(32, 16, generator=gen),)


def _gpt_tied() -> Any:
    """GPT-2's weight tying: the output head is the token table (one parameter, two uses)."""
    model, inputs, loss_fn, targets = gpt.build()
    model.lm_head.weight = model.wte.weight
    return model, inputs, loss_fn, targets


class FrozenParts(torch.nn.Module):
    """LoRA-style fine-tuning around the example GPT: its embeddings and first MLP frozen, a
    parameter the step never uses, and one it reads only detached (none of these three kinds
    gets a gradient, so none may wait in a gradient bucket or be trained)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.unused = torch.nn.Parameter(torch.ones(4))
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens) / self.temperature.detach()


def _gpt_frozen() -> Any:
    model, inputs, loss_fn, targets = gpt.build()
    for p in (model.wte.weight, model.wpe.weight, *model.blocks[0].mlp.parameters()):
        p.requires_grad_(False)
    return FrozenParts(model), inputs, loss_fn, targets


MODELS: dict[str, Callable[[], Any]] = {
    "gpt": gpt.build, "llama": llama.build, "gpt_view_qkv": _gpt_view_qkv, "gpt_tied": _gpt_tied,
    "gpt_frozen": _gpt_frozen, "gpt_bf16": _gpt_bf16, "regression": _regression,
    # batch 8 and 16: at batch 4 the cpu profile rightly prices plain replication cheapest (no collectives)
    "hf_gpt2": _hf(lambda: hf_models.build_gpt2_step(batch=8)),
    "hf_llama": _hf(lambda: hf_models.build_llama_step(batch=16)),
}
# gpt_tied: the tied table is used colwise by the head and as an embedding: its gradient
# comes back from two consumers in different placements (one gradient sync for both).
TP_PLANS = {"gpt": (gpt.TP_PLAN, gpt.TP_SP_PLAN), "llama": (llama.TP_PLAN, llama.TP_SP_PLAN),
            "gpt_view_qkv": (gpt.TP_PLAN, gpt.TP_SP_PLAN),
            "gpt_tied": ({**gpt.TP_PLAN, "lm_head": ColwiseParallel()}, gpt.TP_SP_PLAN),
            "gpt_bf16": (gpt.TP_PLAN, gpt.TP_SP_PLAN),
            "hf_llama": (HF_LLAMA_TP, HF_LLAMA_TP)}


VOCAB = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate())}
VOCAB_SP = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}
"""torchtitan's Llama plan for the token table: split by vocabulary (each rank looks up the ids its rows
hold, zero rows for the others, summed by an all-reduce, or reduce-scattered onto the sequence with SP)."""


@dataclass(frozen=True)
class Case:
    model: str
    mesh: tuple[int, ...]
    names: tuple[str, ...]
    plan: str
    """'free', 'dp', 'tp', 'tp_sp' or 'dp_tp'; 'tp_vocab' and 'tp_sp_vocab': with the token table split by
    vocabulary (``VOCAB``, ``VOCAB_SP``)."""
    kwargs: dict = field(default_factory=dict, hash=False)

    @property
    def id(self) -> str:
        extra = "".join(f"-{k}={v}" for k, v in self.kwargs.items() if k != "data_axes")
        return f"{self.model}-{'x'.join(map(str, self.mesh))}-{self.plan}{extra}"

    def compile_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.plan in ("tp", "tp_sp", "dp_tp", "tp_vocab", "tp_sp_vocab"):
            tp, tp_sp = TP_PLANS[self.model]
            kw["constraints"] = tp_sp if self.plan.startswith("tp_sp") else tp
            if self.plan.endswith("_vocab"):
                kw["constraints"] = {**kw["constraints"], **(VOCAB_SP if self.plan == "tp_sp_vocab" else VOCAB)}
        if self.plan in ("dp", "dp_tp"):
            kw["data_axes"] = ("dp",)
        return {**kw, **self.kwargs}


CASES = [
    Case("gpt", (2,), ("dp",), "free"), Case("gpt", (2,), ("dp",), "dp"), Case("gpt", (4,), ("tp",), "tp"),
    Case("gpt", (4,), ("tp",), "tp_sp"), Case("gpt", (2, 2), ("dp", "tp"), "dp_tp"),
    Case("gpt", (2, 2), ("dp", "tp"), "free"), Case("gpt", (2, 4), ("dp", "tp"), "dp_tp"),
    Case("gpt_view_qkv", (2, 2), ("dp", "tp"), "dp_tp"),
    Case("gpt", (2, 4), ("dp", "tp"), "free"),
    Case("llama", (2,), ("dp",), "dp"), Case("llama", (4,), ("tp",), "tp"), Case("llama", (4,), ("tp",), "free"),
    Case("llama", (2, 2), ("dp", "tp"), "tp_sp"), Case("llama", (2, 2), ("dp", "tp"), "free"),
    Case("llama", (2, 4), ("dp", "tp"), "dp_tp"),
    Case("llama", (2,), ("tp",), "tp_vocab"), Case("llama", (2, 2), ("dp", "tp"), "tp_sp_vocab"),
    Case("hf_gpt2", (2,), ("dp",), "dp"), Case("hf_gpt2", (2, 2), ("dp", "tp"), "free"),
    Case("hf_llama", (2,), ("dp",), "free"), Case("hf_llama", (2, 2), ("dp", "tp"), "free"),
    Case("hf_llama", (2, 2), ("dp", "tp"), "dp_tp"),
    Case("gpt_tied", (2, 2), ("dp", "tp"), "dp_tp"), Case("gpt_frozen", (2,), ("dp",), "dp"),
    Case("gpt_frozen", (2, 2), ("dp", "tp"), "free"),
    # 64 KiB buckets: 15 on dp (13 gradients straddle two) and, for the sequence-parallel
    # LayerNorms' weights, one on tp after dp
    Case("gpt", (2, 2), ("dp", "tp"), "tp_sp", {"data_axes": ("dp",), "bucket_bytes": 65536}),
    Case("gpt_bf16", (2, 2), ("dp", "tp"), "tp_sp", {"data_axes": ("dp",), "precision": "bf16"}),
    Case("regression", (2,), ("dp",), "dp"), Case("regression", (2, 2), ("dp", "tp"), "dp"),
    Case("gpt", (1, 2), ("dp", "tp"), "dp_tp"),  # a mesh dim of one rank: nothing runs on it
]


def train_on_rank(rank: int, world: int, case: Case, ref: Reference) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=case.names)
    model, inputs, loss_fn, targets = MODELS[case.model]()
    pm = autopar.compile(model, mesh, inputs, loss_fn=loss_fn, example_targets=targets, **case.compile_kwargs(),
                         pipeline=False)
    return {**run_compiled(pm, (*inputs, *targets), ref),
            "strided": sorted(k for k, v in pm.plan.parameters.items() if "/" in v),
            "table": pm.plan.parameters.get("tok_embeddings.weight")}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_step_matches_single_device(case: Case) -> None:
    ref = reference(MODELS[case.model])
    results = run_checked(train_on_rank, case.mesh, case, ref)
    assert any(r["ran"] for r in results) or case.mesh == (1,)
    model = MODELS[case.model]()[0]
    assert results[0]["frozen"] == sorted(k for k, p in model.named_parameters() if not p.requires_grad)
    if case.model.startswith("gpt") and case.plan != "free" and "tp" in case.names:
        # ColwiseParallel on the fused qkv runs as interleaved qkv (strided shards).
        assert "blocks.0.attn.qkv.weight" in results[0]["strided"], results[0]["strided"]
    if case.plan.endswith("_vocab"):  # the token table split by vocabulary on tp, whole on dp
        assert results[0]["table"] == ("R" if "dp" in case.names else "") + "S(0)", results[0]["table"]
