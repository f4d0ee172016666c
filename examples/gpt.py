"""A GPT-2-style decoder (learned positions, LayerNorm, GELU MLP, fused qkv).

``build()`` is what ``autopar plan examples/gpt.py:build`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 512
    """Tokens in the vocabulary."""
    max_seq_len: int = 64
    """Longest sequence (rows of the position table)."""
    hidden: int = 128
    """Model width."""
    heads: int = 4
    """Attention heads; ``hidden`` must divide by it."""
    layers: int = 2
    """Transformer blocks."""
    dropout: float = 0.0
    """Dropout probability on the embeddings and after attention and MLP."""
    attn_dropout: float = 0.0
    """Dropout probability on the attention probabilities (training only)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)
        self.attn_dropout = cfg.attn_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q = q.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k = k.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, s, h)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# Hand tensor-parallel plans (torch's parallelize_module vocabulary, as torchtitan writes
# them), for pinning with ``constraints=`` on the "tp" axis: Megatron TP, and TP with
# sequence-parallel LayerNorms (the residual stream split on the sequence dim).
TP_PLAN = {"blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.proj": RowwiseParallel(),
           "blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel()}
TP_SP_PLAN = {"blocks.*.attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
              "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
              "blocks.*.mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
              "blocks.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
              "blocks.*.ln_1": SequenceParallel(), "blocks.*.ln_2": SequenceParallel()}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; ``targets`` are the tokens shifted by one."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def build(cfg: GPTConfig | None = None, batch: int = 8, device: str = "cpu"
          ) -> tuple[GPT, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """(model, example_inputs, loss_fn, example_targets) for ``autopar plan``."""
    cfg = cfg or GPTConfig()
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    return model, (tokens,), lm_loss, (targets,)
