"""An HF causal LM as a servable model (``autopar/serving/servable.py``): a static, slot-indexed KV cache.

``servable(model)`` wraps a ``*ForCausalLM`` (Llama, Qwen2/3, Mistral, Gemma, Mixtral, Qwen-MoE, ...) so
that ``plan_serving`` and ``compile_serving`` take it: ``setup_cache(slots, max_len)`` gives each attention a
``SlotKV`` of buffers (slots, max_len, kv heads, head dim) (the example Llama's layout, its KV heads dim the one
TP splits), and ``forward(tokens, positions, slots)`` runs the model's own forward, its attention and rotary code
unchanged: positions go in as ``position_ids`` (per row), the cache as a transformers ``Cache`` whose layers
write each row's new keys and values at its (slot, position) pairs (``index_put_``, vLLM's slot mapping) and hand
attention the rows' whole slots, and the mask (each query sees its slot's positions up to its own, within the
sliding window on sliding layers) as the 4-D mask transformers passes through as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import InputError, InputTypeError


class SlotKV(nn.Module):
    """One attention's keys and values of every slot, (slots, max_len, kv heads, head dim), as buffers."""

    def __init__(self, slots: int, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (slots, max_len, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)


def _cache_classes() -> tuple[type, type]:
    """transformers' ``Cache`` with layers writing into ``SlotKV`` buffers (built on first use, so that
    importing autopar does not import transformers)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        is_sliding = False

        def __init__(self, kv: SlotKV, slots: torch.Tensor, positions: torch.Tensor) -> None:
            super().__init__()
            self.kv, self.slots, self.positions = kv, slots, positions
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            return None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            """Write (batch, kv heads, steps, head dim) at each row's (slot, positions); return the rows'
            whole slots as (batch, kv heads, max_len, head dim)."""
            at = (self.slots[:, None], self.positions)
            self.kv.k.index_put_(at, key_states.transpose(1, 2).to(self.kv.k.dtype))
            self.kv.v.index_put_(at, value_states.transpose(1, 2).to(self.kv.v.dtype))
            return self.kv.k[self.slots].transpose(1, 2), self.kv.v[self.slots].transpose(1, 2)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.kv.k.shape[1], 0

        def get_seq_length(self) -> int:
            return self.kv.k.shape[1]

        def get_max_length(self) -> int:
            return self.kv.k.shape[1]

    class SlotCache(Cache):
        def __init__(self, kvs: list[SlotKV], slots: torch.Tensor, positions: torch.Tensor) -> None:
            super().__init__(layers=[SlotLayer(kv, slots, positions) for kv in kvs])

    return SlotLayer, SlotCache


def attentions(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules in layer order (those holding a ``layer_idx`` and k/v projections)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
             and hasattr(m, "k_proj") and hasattr(m, "v_proj")]
    found.sort(key=lambda m: m.layer_idx)
    if not found or [m.layer_idx for m in found] != list(range(len(found))):
        raise InputError(f"{type(model).__name__}: no self-attention with k_proj/v_proj per layer was found "
                         "(the HF serving adapter covers decoders of the Llama kind)")
    return found


class ServableCausalLM(nn.Module):
    """An HF causal LM served from slot-indexed caches (module docstring); ``model`` is the HF model itself."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not is_hf_causal_lm(model):
            raise InputTypeError(f"{type(model).__name__} is not a Hugging Face causal LM (no config or LM head)")
        self.model = model
        self._attentions = attentions(model)
        self._cache_type = _cache_classes()[1]

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_positions(self) -> int:
        """Positions a serving step may reach: the config's ``max_position_embeddings``."""
        return int(self.config.max_position_embeddings)

    def setup_cache(self, slots: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> None:
        """Give every attention a ``SlotKV`` of ``slots`` x ``max_len`` (default: the model's positions), in
        ``dtype`` (default the LM head's) on the weights' device."""
        max_len = max_len or self.max_positions
        if max_len > self.max_positions:
            raise InputError(f"max_len {max_len} exceeds the model's {self.max_positions} positions")
        cfg, head = self.config, self.model.get_output_embeddings().weight
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        for attention in self._attentions:
            with torch.device(head.device):
                attention.slot_kv = SlotKV(slots, max_len, kv_heads, head_dim, dtype or head.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Logits (batch, steps, vocab): row b continues cache slot ``slots[b]`` at ``positions[b]``."""
        kvs = [getattr(a, "slot_kv", None) for a in self._attentions]
        if any(kv is None for kv in kvs):
            raise InputError("call setup_cache(slots, max_len) before a serving step")
        cache = self._cache_type(kvs, slots, positions)
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=self._masks(positions, kvs[0]),
                         cache=cache, use_cache=True)
        return out.logits

    def _masks(self, positions: torch.Tensor, kv: SlotKV) -> torch.Tensor | dict[str, torch.Tensor]:
        """(batch, 1, steps, max_len) of the cache positions each query sees: up to its own, and within the
        window on sliding layers (by layer type where the config has them, else Mistral's one window)."""
        cfg = self.config
        keys = torch.arange(kv.k.shape[1], device=positions.device)
        full = (keys <= positions[..., None])[:, None]
        window = getattr(cfg, "sliding_window", None)
        sliding = None if not window else (full & (keys > positions[..., None] - window)[:, None])
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return {"full_attention": full, **({"sliding_attention": sliding} if sliding is not None
                                               and "sliding_attention" in layer_types else {})}
        return sliding if sliding is not None and getattr(cfg, "use_sliding_window", True) else full


def is_hf_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a transformers model that generates (a ``PreTrainedModel`` and ``GenerationMixin``
    with an LM head). transformers is looked up, not imported: an HF model has imported it already."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return False
    return isinstance(model, transformers.GenerationMixin) and model.get_output_embeddings() is not None


def servable(source: nn.Module | str | Path | dict[str, Any], dtype: torch.dtype | None = None) -> ServableCausalLM:
    """``source`` served: an HF causal LM (wrapped, its weights its own), or a ``config.json`` path or dict
    (its causal LM built on the meta device, in ``dtype``, default the config's or bf16: planning only)."""
    if isinstance(source, ServableCausalLM):
        return source
    if isinstance(source, nn.Module):
        return ServableCausalLM(source)
    from autopar.hf.config import build, load_config, model_class

    config = load_config(source)
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    named = getattr(torch, named) if isinstance(named, str) else named
    model = build(config, model_class(config, causal=True), "meta", dtype or named or torch.bfloat16)
    return ServableCausalLM(model.eval())


def as_servable(model: Any) -> Any:
    """``model`` itself, or an HF causal LM wrapped by :func:`servable` (what planning and compiling serve)."""
    return servable(model) if is_hf_causal_lm(model) else model
