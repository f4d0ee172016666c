"""A Mixtral-style mixture-of-experts decoder: Llama's attention, and a routed SwiGLU MoE in place of its MLP.

``build()`` is what ``autopar plan examples/moe.py:build`` calls; ``build_wide()`` is a wider one, on the
meta device, whose experts pay to split across ranks (expert parallelism: ``autopar plan
examples/moe.py:build_wide --mesh ep=4 --data-axes ep --expert-axes ep``). Two dispatch styles, chosen by
``MoEConfig.capacity_factor``:

* ``None`` (dropless, Mixtral / Qwen-MoE style): every (token, expert) pair of a sequence is
  sorted by expert (``argsort``), the tokens gathered into per-expert slots (``scatter``), the
  experts run as one batched matmul over all ``experts x seq`` slots, and the outputs gathered
  back, weighted and summed per token (``scatter_add``).
* a float (GShard / Switch style): each expert takes at most ``capacity`` tokens per sequence
  (``ceil(capacity_factor * seq * top_k / experts)``, first choices first), the rest are
  dropped (their expert output is zero), and dispatch and combine are one-hot tensors
  applied with ``einsum``.

Every shape is fixed by the config and the input's shape, never by the routing: the dropless
path gives each expert ``seq`` slots per sequence (top-k picks distinct experts, so no expert
gets more), so it computes ``experts / top_k`` times the routed FLOPs; a data-dependent
split (``counts.tolist()``) would make sizes torch.export can only carry as unbacked symbols,
which the planner's shape arithmetic does not take (notes/moe-design.md). Routing runs per
sequence (GShard's groups), so the batch dim stays free to split across data-parallel ranks.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.llama import (Attention, FeedForward, LlamaConfig, RMSNorm, hf_config, rotary_tables, setup_caches,
                            step_tables)


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
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
    ffn_hidden: int = 128
    """Width of each expert's SwiGLU layer (and of the shared expert's)."""
    layers: int = 2
    """Transformer blocks."""
    experts: int = 4
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts each token is sent to. With ``top_k > 1`` the chosen probabilities are renormalized
    to sum to one (Mixtral); top-1 keeps the raw probability (Switch), so the router still learns."""
    capacity_factor: float | None = None
    """``None``: dropless dispatch. A float: each expert takes at most
    ``ceil(capacity_factor * seq * top_k / experts)`` tokens per sequence, the rest are dropped."""
    shared_expert: bool = False
    """Add a dense SwiGLU expert every token goes through (DeepSeek-MoE's shared expert)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss (summed over layers) added to the LM loss."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in 1..experts ({self.experts}), got {self.top_k}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None, got {self.capacity_factor}")

    def attention_config(self) -> LlamaConfig:
        """The Llama config of the pieces reused from ``examples/llama.py`` (attention, shared expert)."""
        return LlamaConfig(vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, hidden=self.hidden,
                           heads=self.heads, kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden, layers=self.layers,
                           rope_theta=self.rope_theta, norm_eps=self.norm_eps)

    def capacity(self, seq: int) -> int:
        """Slots per expert per sequence: ``seq`` when dropless (no expert can get more)."""
        if self.capacity_factor is None:
            return seq
        return min(seq, math.ceil(self.capacity_factor * seq * self.top_k / self.experts))


class Experts(nn.Module):
    """``experts`` SwiGLU layers as stacked weights, run on ``(experts, tokens, hidden)`` slots."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, h, f = cfg.experts, cfg.hidden, cfg.ffn_hidden
        self.w1 = nn.Parameter(torch.randn(e, h, f) / math.sqrt(h))
        self.w3 = nn.Parameter(torch.randn(e, h, f) / math.sqrt(h))
        self.w2 = nn.Parameter(torch.randn(e, f, h) / math.sqrt(f))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(slots, self.w1)) * torch.bmm(slots, self.w3), self.w2)


@dataclass(frozen=True)
class Routing:
    """A layer's routing of ``(batch, seq)`` tokens: top-k experts and their combine weights."""

    probs: torch.Tensor
    """``(batch, seq, experts)`` router probabilities."""
    experts: torch.Tensor
    """``(batch, seq, top_k)`` chosen expert ids."""
    weights: torch.Tensor
    """``(batch, seq, top_k)`` combine weights of the chosen experts."""


def route(router: nn.Linear, x: torch.Tensor, top_k: int) -> Routing:
    probs = router(x).softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(probs, experts, weights)


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss: ``experts * sum_e f_e * P_e``, where ``f_e`` is the share
    of (token, choice) pairs sent to expert ``e`` and ``P_e`` its mean router probability."""
    chosen = (routing.experts[..., None] == torch.arange(num_experts, device=routing.experts.device)).float()
    share = chosen.sum(dim=2).mean(dim=(0, 1)) / routing.experts.shape[-1]
    return num_experts * (share * routing.probs.mean(dim=(0, 1))).sum()


def dispatch_sorted(x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    """Dropless: each sequence's (token, choice) pairs sorted by expert into ``experts x seq`` slots."""
    b, s, h = x.shape
    e, k = experts.w1.shape[0], routing.experts.shape[-1]
    flat = routing.experts.reshape(b, s * k)  # pair j of a sequence is token j // k's choice j % k
    order = flat.argsort(dim=-1, stable=True)
    by_expert = flat.gather(1, order)
    counts = (flat[..., None] == torch.arange(e, device=x.device)).sum(dim=1)  # (b, e)
    starts = counts.cumsum(dim=-1) - counts
    rank_in_expert = torch.arange(s * k, device=x.device) - starts.gather(1, by_expert)
    slot = (by_expert * s + rank_in_expert)[..., None].expand(b, s * k, h)
    token = torch.div(order, k, rounding_mode="floor")[..., None].expand(b, s * k, h)
    slots = x.new_zeros(b, e * s, h).scatter(1, slot, x.gather(1, token))
    out = experts(slots.view(b, e, s, h).transpose(0, 1).reshape(e, b * s, h))
    out = out.view(e, b, s, h).transpose(0, 1).reshape(b, e * s, h)
    weights = routing.weights.reshape(b, s * k).gather(1, order)[..., None]
    return x.new_zeros(b, s, h).scatter_add(1, token, out.gather(1, slot) * weights)


def dispatch_capacity(x: torch.Tensor, routing: Routing, experts: Experts, capacity: int) -> torch.Tensor:
    """GShard / Switch: one-hot dispatch into ``capacity`` slots per expert, overflow dropped."""
    b, s, h = x.shape
    e, k = experts.w1.shape[0], routing.experts.shape[-1]
    # (b, k*s, e): all first choices queue before any second choice, as GShard orders them
    chosen = (routing.experts.transpose(1, 2).reshape(b, k * s, 1) == torch.arange(e, device=x.device)).float()
    position = ((chosen.cumsum(dim=1) - 1) * chosen).sum(dim=-1)  # place in its expert's queue
    kept = chosen * (position < capacity).float()[..., None]
    in_slot = (position[..., None] == torch.arange(capacity, device=x.device)).float()  # (b, k*s, c)
    dispatch = (kept[..., None] * in_slot[:, :, None, :]).view(b, k, s, e, capacity)
    combine = (dispatch * routing.weights.transpose(1, 2)[..., None, None]).sum(dim=1)
    # the routing counts in fp32 (exact to 2^24); the tokens are dispatched and combined in their own dtype
    slots = torch.einsum("bsec,bsh->ebch", dispatch.sum(dim=1).to(x.dtype), x)
    out = experts(slots.reshape(e, b * capacity, h)).view(e, b, capacity, h)
    return torch.einsum("bsec,ebch->bsh", combine.to(out.dtype), out)


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = FeedForward(cfg.attention_config()) if cfg.shared_expert else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and its load-balancing loss."""
        routing = route(self.router, x, self.cfg.top_k)
        if self.cfg.capacity_factor is None:
            y = dispatch_sorted(x, routing, self.experts)
        else:
            y = dispatch_capacity(x, routing, self.experts, self.cfg.capacity(x.shape[1]))
        if self.shared is not None:
            y = y + self.shared(x)
        return y, load_balancing_loss(routing, self.cfg.experts)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg.attention_config())
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x), cos, sin, cached)
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class MoETransformer(nn.Module):
    """Returns ``(logits, aux_loss)``: the load-balancing losses of all layers, weighted by ``aux_loss_coef``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.attention_config())
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def max_positions(self) -> int:
        """Positions a serving step may reach (``plan_serving`` reads it)."""
        return self.cfg.max_seq_len

    def setup_cache(self, slots: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> None:
        """KV caches for serving steps ``model(tokens, positions, slots)``, as ``examples.llama.Llama``'s."""
        setup_caches(self.cfg.attention_config(), [layer.attention for layer in self.layers], slots, max_len,
                     dtype or self.output.weight.dtype, self.output.weight.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: ``(logits, aux)`` over whole sequences; a serving step (``positions`` and ``slots``, after
        ``setup_cache``, as ``examples.llama.Llama.forward``) continues each row's cache slot."""
        cos, sin, cached = step_tables(self.rope_cos, self.rope_sin, tokens, positions, slots,
                                       self.layers[0].attention)
        x = self.tok_embeddings(tokens)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, layer_aux = layer(x, cos, sin, cached)
            aux = aux + layer_aux
        return self.output(self.norm(x)), self.cfg.aux_loss_coef * aux


def moe_loss(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy plus the model's weighted load-balancing loss."""
    logits, aux = output
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)) + aux


def build(cfg: MoEConfig | None = None, batch: int = 8, device: str = "cpu"
          ) -> tuple[MoETransformer, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """(model, example_inputs, loss_fn, example_targets) for ``autopar plan``."""
    cfg = cfg or MoEConfig()
    torch.manual_seed(0)
    with torch.device(device):
        model = MoETransformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), device=device)
    targets = torch.roll(tokens, -1, dims=1)
    return model, (tokens,), moe_loss, (targets,)


WIDE = MoEConfig(vocab_size=32000, max_seq_len=256, hidden=1024, heads=8, kv_heads=8, ffn_hidden=2048, layers=4,
                 experts=16, top_k=2, capacity_factor=1.25)
"""Sixteen wide experts per layer, few tokens each: their weights' gradient all-reduce outweighs the
all-to-alls that send the tokens to split experts (on H100s)."""


def build_wide(batch: int = 8, device: str = "meta"
               ) -> tuple[MoETransformer, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """``build(WIDE)`` on the meta device: for planning (``autopar.plan``), no weights allocated."""
    return build(WIDE, batch=batch, device=device)


def from_hf_config(name: str | Path, **overrides: Any) -> MoEConfig:
    """This model at the shape of a published HF Mixtral config (``examples/configs/``; ``overrides``: e.g.
    fewer ``layers`` or a ``capacity_factor``)."""
    c = hf_config(name)
    return dataclasses.replace(MoEConfig(
        vocab_size=c["vocab_size"], max_seq_len=c["max_position_embeddings"], hidden=c["hidden_size"],
        heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], ffn_hidden=c["intermediate_size"],
        layers=c["num_hidden_layers"], experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
        aux_loss_coef=c["router_aux_loss_coef"], rope_theta=float(c["rope_theta"]), norm_eps=c["rms_norm_eps"]),
        **overrides)
