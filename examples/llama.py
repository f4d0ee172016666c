"""A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU).

``build()`` is what ``autopar plan examples/llama.py:build`` calls.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 512
    """Tokens in the vocabulary."""
    max_seq_len: int = 64
    """Sequence length the rotary table covers."""
    hidden: int = 128
    """Model width."""
    heads: int = 4
    """Query heads; ``hidden`` must divide by it."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); ``heads`` must divide by it."""
    ffn_hidden: int = 256
    """Width of the SwiGLU feed-forward layer."""
    layers: int = 2
    """Transformer blocks."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.hidden // cfg.heads
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)
        self.cache: KVCache | None = None  # serving only (Llama.setup_cache)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``cached``: (slots, positions, mask) of a serving step (see ``Llama.forward``)."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        gqa = self.kv_heads != self.heads
        if cached is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            assert self.cache is not None, "call Llama.setup_cache first"
            slots, positions, mask = cached
            k, v = self.cache.update(slots, positions, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class KVCache(nn.Module):
    """Keys and values of every sequence slot (a request being served), (slots, max_len, kv heads,
    head dim), written in place at each step's (slot, position) pairs, as vLLM's slot mapping."""

    def __init__(self, slots: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (slots, max_len, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (batch, kv heads, steps, head dim) of each row's slot at its positions (batch,
        steps); return the rows' whole caches as (batch, kv heads, max_len, head dim)."""
        at = (slots[:, None], positions)
        self.k.index_put_(at, k.transpose(1, 2))
        self.v.index_put_(at, v.transpose(1, 2))
        return self.k[slots].transpose(1, 2), self.v[slots].transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cached)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def max_positions(self) -> int:
        """Positions a serving step may reach (the rotary table's length): ``plan_serving`` reads it."""
        return self.cfg.max_seq_len

    def setup_cache(self, slots: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Give every attention a KV cache of ``slots`` sequences of up to ``max_len`` tokens (default:
        the rotary table's length) for serving steps: ``model(tokens, positions, slots)``."""
        setup_caches(self.cfg, [layer.attention for layer in self.layers], slots, max_len,
                     dtype or self.output.weight.dtype, self.output.weight.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens`` (batch, steps). Training: causal over the whole sequence. Serving
        (after ``setup_cache``): row b continues cache slot ``slots[b]`` at ``positions[b]`` (batch,
        steps), its keys written there and its queries attending to the slot's positions up to
        their own: a prefill (chunk) of one request or a decode step of many, the same program."""
        cos, sin, cached = step_tables(self.rope_cos, self.rope_sin, tokens, positions, slots,
                                       self.layers[0].attention)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, cached)
        return self.output(self.norm(x))


def setup_caches(cfg: LlamaConfig, attentions: list[Attention], slots: int, max_len: int | None,
                 dtype: torch.dtype, device: torch.device) -> None:
    """A ``KVCache`` of ``slots`` x ``max_len`` (default: the rotary table's length) for each attention."""
    max_len = max_len or cfg.max_seq_len
    if max_len > cfg.max_seq_len:
        raise ValueError(f"max_len {max_len} exceeds the rotary table's {cfg.max_seq_len} positions")
    for attention in attentions:
        with torch.device(device):
            attention.cache = KVCache(slots, max_len, cfg.kv_heads, cfg.hidden // cfg.heads, dtype)


def step_tables(rope_cos: torch.Tensor, rope_sin: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None,
                slots: torch.Tensor | None, attention: Attention
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """The rotary tables of a step's positions, and for a serving step (``positions`` given) what each
    attention needs of its cache: (slots, positions, mask of the cache positions each query sees)."""
    if positions is None:
        s = tokens.shape[1]
        return rope_cos[:s], rope_sin[:s], None
    assert slots is not None and attention.cache is not None, "a serving step names each row's slot of the cache"
    cos, sin = rope_cos[positions][:, None], rope_sin[positions][:, None]
    mask = torch.arange(attention.cache.k.shape[1], device=tokens.device) <= positions[..., None]
    return cos, sin, (slots, positions, mask[:, None])


# Hand tensor-parallel plans for pinning with ``constraints=`` on the "tp" axis.
TP_PLAN = {f"layers.*.{name}": style for name, style in [
    ("attention.wq", ColwiseParallel()), ("attention.wk", ColwiseParallel()), ("attention.wv", ColwiseParallel()),
    ("attention.wo", RowwiseParallel()), ("feed_forward.w1", ColwiseParallel()),
    ("feed_forward.w3", ColwiseParallel()), ("feed_forward.w2", RowwiseParallel())]}
TP_SP_PLAN = {**{k: ColwiseParallel(input_layouts=Shard(1)) for k, v in TP_PLAN.items()
                 if isinstance(v, ColwiseParallel)},
              "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
              "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
              "layers.*.attention_norm": SequenceParallel(), "layers.*.ffn_norm": SequenceParallel()}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; ``targets`` are the tokens shifted by one."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def build(cfg: LlamaConfig | None = None, batch: int = 8, device: str = "cpu"
          ) -> tuple[Llama, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """(model, example_inputs, loss_fn, example_targets) for ``autopar plan``."""
    cfg = cfg or LlamaConfig()
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    return model, (tokens,), lm_loss, (targets,)


def build_7b(batch: int = 8) -> tuple[Llama, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """A Llama-2-7B-sized model on the meta device (planning only: no weights are allocated)."""
    cfg = LlamaConfig(vocab_size=32000, max_seq_len=4096, hidden=4096, heads=32, kv_heads=32,
                      ffn_hidden=11008, layers=32)
    with torch.device("meta"):
        model = Llama(cfg)
    tokens = torch.zeros(batch, cfg.max_seq_len, dtype=torch.long, device="meta")
    return model, (tokens,), lm_loss, (tokens,)


CONFIGS = Path(__file__).resolve().parent / "configs"
"""Published Hugging Face ``config.json`` files (``configs/README.md`` names their sources)."""


def hf_config(name: str | Path) -> dict[str, Any]:
    """The fields of ``configs/NAME.json`` (or of a config.json path)."""
    path = Path(name) if str(name).endswith(".json") else CONFIGS / f"{name}.json"
    return json.loads(path.read_text())


def from_hf_config(name: str | Path, **overrides: Any) -> LlamaConfig:
    """This Llama at the shape of a published HF Llama config (``overrides``: e.g. a shorter ``max_seq_len``)."""
    c = hf_config(name)
    return dataclasses.replace(LlamaConfig(
        vocab_size=c["vocab_size"], max_seq_len=c["max_position_embeddings"], hidden=c["hidden_size"],
        heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], ffn_hidden=c["intermediate_size"],
        layers=c["num_hidden_layers"], rope_theta=float(c["rope_theta"]), norm_eps=c["rms_norm_eps"]), **overrides)


LLAMA3_8B = from_hf_config("llama-3-8b")
"""Llama-3-8B's shape (``configs/llama-3-8b.json``, Meta's config.json)."""
LLAMA3_70B = from_hf_config("llama-3-70b")
"""Llama-3-70B's shape (``configs/llama-3-70b.json``)."""


def build_serving(cfg: LlamaConfig) -> Llama:
    """A bf16 model of ``cfg`` on the meta device, for ``autopar serve-plan`` (planning only: no weights
    are allocated; ``plan_serving`` gives it its KV cache through ``setup_cache``)."""
    with torch.device("meta"):
        model = Llama(cfg)
    return model.to(torch.bfloat16).eval()


def build_8b_serving() -> Llama:
    """Llama-3-8B's shape for ``autopar serve-plan examples/llama.py:build_8b_serving``."""
    return build_serving(LLAMA3_8B)


def build_70b_serving() -> Llama:
    """Llama-3-70B's shape for ``autopar serve-plan examples/llama.py:build_70b_serving``."""
    return build_serving(LLAMA3_70B)


def build_small_serving() -> Llama:
    """A 4-layer, 1024-wide Llama on the meta device: plans in seconds (tests, ``autopar serve-plan`` demos)."""
    return build_serving(LlamaConfig(vocab_size=32000, max_seq_len=2048, hidden=1024, heads=16, kv_heads=8,
                                     ffn_hidden=2816, layers=4))
