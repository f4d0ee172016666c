"""Llama 3 as torchtitan ran it for its published benchmarks (pytorch/torchtitan at 9dec370,
2024-12-26: ``torchtitan/models/llama/model.py``, ``torchtitan/models/norms.py``, ``train.py``),
written here op for op so that autopar prices the kernels that run measured: the eager RMSNorm
computes in fp32 (``x.float()``, ``pow``, ``mean``, ``rsqrt``, two multiplies, ``type_as``,
then the weight), rotary positions multiply complex numbers (``view_as_complex`` of the fp32
queries and keys by a complex64 table), grouped keys and values are expanded and copied to every
query head (``repeat_kv``), attention is SDPA's causal kernel, the feed-forward SwiGLU, and the
loss cross entropy over fp32 logits (``pred.float()``). ``examples/llama.py`` is the same math
with fused ``rms_norm`` and a real-valued rotary: fewer memory passes than the measured run made.

Shapes: torchtitan's ``llama3_configs`` (``ModelArgs``: ffn width from ``ffn_dim_multiplier`` and
``multiple_of``, vocabulary 128256 from the Llama 3 tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TitanConfig:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_multiplier: float
    multiple_of: int
    vocab: int = 128256
    seq: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    @property
    def ffn(self) -> int:
        """torchtitan's FeedForward width: 2/3 of 4 dim, times the multiplier, rounded up."""
        hidden = int(self.ffn_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


LLAMA3_8B = TitanConfig(dim=4096, layers=32, heads=32, kv_heads=8, ffn_multiplier=1.3, multiple_of=1024)
LLAMA3_70B = TitanConfig(dim=8192, layers=80, heads=64, kv_heads=8, ffn_multiplier=1.3, multiple_of=4096)
LLAMA3_405B = TitanConfig(dim=16384, layers=126, heads=128, kv_heads=8, ffn_multiplier=1.2, multiple_of=4096)


class RMSNorm(nn.Module):
    """Normalised in fp32, cast back, then scaled: four fp32 passes before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(cfg: TitanConfig) -> torch.Tensor:
    """Complex64 rotations, one per position and pair of head features."""
    head_dim = cfg.dim // cfg.heads
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Pairs of features as complex numbers, multiplied by their position's rotation."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(pairs * table.view(1, x.shape[1], 1, -1)).flatten(3)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = rotate(q, table), rotate(k, table)
        repeats = self.heads // self.kv_heads  # torchtitan's repeat_kv: an expanded copy per query head
        k = k[:, :, :, None, :].expand(b, s, self.kv_heads, repeats, self.head_dim).reshape(b, s, self.heads, -1)
        v = v[:, :, :, None, :].expand(b, s, self.kv_heads, repeats, self.head_dim).reshape(b, s, self.heads, -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.register_buffer("freqs_cis", rotary_table(cfg), persistent=False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        table = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, table)
        return self.output(self.norm(h))


def loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``loss_fn``: cross entropy of the fp32 logits."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def build(cfg: TitanConfig, batch: int) -> tuple[TitanLlama, torch.Tensor]:
    """The model on the meta device and a global batch of tokens (planning only)."""
    with torch.device("meta"):
        model = TitanLlama(cfg)
        tokens = torch.zeros(batch, cfg.seq, dtype=torch.long)
    return model, tokens
