"""GPT as Megatron-LM ran it for arXiv 2104.04473 (2021), on ``examples/gpt.py``'s modules so that
its tensor-parallel plans apply: attention unfused, as Megatron's ``ParallelAttention`` then was
(the s x s scores written by a batched matmul, softmax, a second batched matmul), the output layer
tied to the word embeddings. Megatron fused the scale, causal mask and softmax into one kernel;
here the mask is its own pass over the scores (``masked_fill``), one pass more than it ran.

Megatron's dropouts (0.1 on the probabilities, the embeddings and after attention and the MLP:
``--attention-dropout``, ``--hidden-dropout``) are left out: autopar prices a dropout as its own
runtime draws it (``cost.draws``: Philox as eager int64 passes, or the global tensor on every rank),
many times the one fused cuRAND pass Megatron ran, so these models lack that pass instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from examples import gpt

class UnfusedAttention(gpt.CausalSelfAttention):
    """``gpt.CausalSelfAttention``'s weights, attention computed as Megatron computed it."""

    def __init__(self, cfg: gpt.GPTConfig) -> None:
        super().__init__(cfg)
        self.register_buffer("future", torch.ones(cfg.max_seq_len, cfg.max_seq_len, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q = q.view(b, s, self.heads, h // self.heads).transpose(1, 2) / math.sqrt(h // self.heads)  # scaled first
        k = k.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1))
        probs = F.softmax(scores.masked_fill(self.future[:s, :s], float("-inf")), dim=-1)
        y = torch.matmul(probs, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


def build(cfg: gpt.GPTConfig, batch: int) -> tuple[gpt.GPT, torch.Tensor]:
    """The model on the meta device at ``cfg``'s shape with Megatron's unfused attention and tied
    output layer, and a global batch of tokens (planning only)."""
    with torch.device("meta"):
        model = gpt.GPT(cfg)
        for block in model.blocks:
            block.attn = UnfusedAttention(cfg)
        model.lm_head.weight = model.wte.weight
        tokens = torch.zeros(batch, cfg.max_seq_len, dtype=torch.long)
    return model, tokens
