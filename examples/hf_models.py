"""Hugging Face ``GPT2LMHeadModel``, ``LlamaForCausalLM`` and ``MixtralForCausalLM`` from tiny configs,
randomly initialised.

Nothing is downloaded (no ``from_pretrained``). ``transformers`` is imported inside the
builders, so importing this file stays cheap. Two ways in, per model:

``build_gpt2()`` / ``build_llama()`` give the HF model as is, letting it compute its own loss
from ``labels`` (HF shifts them by one); the result is ``(model, example_inputs, loss_fn=None,
example_targets=(), example_kwargs={"labels": ids})``::

    model, inputs, loss_fn, targets, kwargs = build_gpt2()
    captured = capture(model, inputs, loss_fn=loss_fn, example_targets=targets, example_kwargs=kwargs)

``build_gpt2_step()`` / ``build_llama_step()`` have ``examples/gpt.py:build``'s shape,
``(model, example_inputs, loss_fn, example_targets)``, for ``autopar plan
examples/hf_models.py:build_gpt2_step``: the same HF model with no wrapper around it (so
plan FQNs are the HF names), called on ``input_ids`` alone, and ``causal_lm_loss`` computing
HF's loss from ``output.logits`` and the already shifted ``targets``.

Both set ``use_cache=False`` in the config: a training step has no KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

IGNORE_INDEX = -100
"""Target value cross entropy skips (HF's convention); the last position has no next token."""

LLAMA_TP_PLAN: dict[str, ParallelStyle] = {f"model.layers.*.{name}": style for name, style in [
    ("self_attn.q_proj", ColwiseParallel()), ("self_attn.k_proj", ColwiseParallel()),
    ("self_attn.v_proj", ColwiseParallel()), ("self_attn.o_proj", RowwiseParallel()),
    ("mlp.gate_proj", ColwiseParallel()), ("mlp.up_proj", ColwiseParallel()), ("mlp.down_proj", RowwiseParallel())]}
"""Megatron tensor parallelism for ``LlamaForCausalLM``'s blocks, in torchtitan's form (``constraints=``)."""


def _example(model: nn.Module, vocab: int, seq: int, batch: int, device: str
             ) -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    model.loss_type = "ForCausalLM"  # what HF would pick anyway, minus its warning
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, (ids,), None, (), {"labels": ids}


def build_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
               batch: int = 4, device: str = "cpu", attn_implementation: str = "sdpa"
               ) -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    """A ``GPT2LMHeadModel`` (``lm_head`` tied to ``transformer.wte``) that returns its own loss.

    Returns ``(model, (ids,), None, (), {"labels": ids})``. ``seq`` is also ``n_positions``;
    ``device="meta"`` builds it without weight memory. Dropout stays at HF's defaults (0.1).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1, use_cache=False,
                     attn_implementation=attn_implementation)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    return _example(model, vocab, seq, batch, device)


def build_llama(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
                batch: int = 4, device: str = "cpu", kv_heads: int = 2, intermediate: int = 128,
                attn_implementation: str = "sdpa"
                ) -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    """A ``LlamaForCausalLM`` (untied ``lm_head``, grouped-query attention) that returns its own loss.

    Returns ``(model, (ids,), None, (), {"labels": ids})``. ``seq`` is also
    ``max_position_embeddings``; ``device="meta"`` builds it without weight memory.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                      max_position_embeddings=seq, bos_token_id=1, eos_token_id=2, use_cache=False,
                      attn_implementation=attn_implementation)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return _example(model, vocab, seq, batch, device)


def build_mixtral(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
                  batch: int = 4, device: str = "cpu", kv_heads: int = 2, intermediate: int = 128, experts: int = 4,
                  top_k: int = 2, attn_implementation: str = "sdpa", experts_implementation: str | None = None
                  ) -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    """A ``MixtralForCausalLM`` (``experts`` routed SwiGLU experts, ``top_k`` per token) that returns its own loss.

    Returns ``(model, (ids,), None, (), {"labels": ids})``. ``experts_implementation=None`` keeps
    transformers' default (``"grouped_mm"``: under torch.export its opaque
    ``transformers::grouped_mm_fallback`` op); ``"batched_mm"`` indexes the weights per token and
    runs ``bmm``. HF adds no router loss unless ``output_router_logits`` is set (it is not here).
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    options = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                        max_position_embeddings=seq, num_local_experts=experts, num_experts_per_tok=top_k,
                        bos_token_id=1, eos_token_id=2, use_cache=False, attn_implementation=attn_implementation,
                        **options)
    torch.manual_seed(0)
    with torch.device(device):
        model = MixtralForCausalLM(cfg)
    return _example(model, vocab, seq, batch, device)


def build_qwen2_moe(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
                    batch: int = 4, device: str = "cpu", kv_heads: int = 2, intermediate: int = 128, experts: int = 4,
                    top_k: int = 2, shared_intermediate: int = 64
                    ) -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    """A ``Qwen2MoeForCausalLM``: softmax-then-top-k routing without renormalizing the chosen weights, the
    routed experts in transformers' default (grouped_mm) implementation, and a shared SwiGLU expert of
    ``shared_intermediate`` scaled by its own sigmoid gate; as :func:`build_mixtral` it returns its own loss."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         moe_intermediate_size=intermediate, shared_expert_intermediate_size=shared_intermediate,
                         vocab_size=vocab, max_position_embeddings=seq, num_experts=experts,
                         num_experts_per_tok=top_k, decoder_sparse_step=1, bos_token_id=1, eos_token_id=2,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2MoeForCausalLM(cfg)
    return _example(model, vocab, seq, batch, device)


def build_qwen2_moe_step(batch: int = 4, device: str = "cpu", **sizes: Any
                         ) -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """(model, example_inputs, loss_fn, example_targets); ``sizes`` as :func:`build_qwen2_moe`."""
    return _as_step(build_qwen2_moe(batch=batch, device=device, **sizes))


def shift_labels(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets as HF makes them from ``labels``: ``ids`` moved left by one, ``-100`` last."""
    return F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss from a model output with ``.logits`` and :func:`shift_labels` targets."""
    logits = output.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def _as_step(example: tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]
             ) -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    model, (ids,), _, _, _ = example
    return model, (ids,), causal_lm_loss, (shift_labels(ids),)


def build_gpt2_step(batch: int = 4, device: str = "cpu", **sizes: Any
                    ) -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """(model, example_inputs, loss_fn, example_targets) for ``autopar plan``; ``sizes`` as :func:`build_gpt2`."""
    return _as_step(build_gpt2(batch=batch, device=device, **sizes))


def build_llama_step(batch: int = 4, device: str = "cpu", **sizes: Any
                     ) -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """(model, example_inputs, loss_fn, example_targets) for ``autopar plan``; ``sizes`` as :func:`build_llama`."""
    return _as_step(build_llama(batch=batch, device=device, **sizes))


def build_mixtral_step(batch: int = 4, device: str = "cpu", **sizes: Any
                       ) -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    """(model, example_inputs, loss_fn, example_targets) for ``autopar plan``; ``sizes`` as :func:`build_mixtral`."""
    return _as_step(build_mixtral(batch=batch, device=device, **sizes))


def build_deepseek_v3(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
                      batch: int = 4, device: str = "cpu", intermediate: int = 128, experts: int = 4, top_k: int = 2,
                      moe_intermediate: int = 64) -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    """A ``DeepseekV3ForCausalLM``: multi-head latent attention (low-rank queries and keys/values,
    the rotary part of each key expanded into a ``new_empty`` buffer by slice copies), a dense first
    layer, then ``experts`` routed experts (sigmoid scores, ``top_k`` per token) beside a shared one;
    as :func:`build_mixtral` it returns its own loss."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           num_key_value_heads=heads, intermediate_size=intermediate,
                           moe_intermediate_size=moe_intermediate, vocab_size=vocab, max_position_embeddings=seq,
                           n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1, n_group=1,
                           topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, bos_token_id=1, eos_token_id=2,
                           use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg)
    return _example(model, vocab, seq, batch, device)


def build_llama4(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256, seq: int = 32,
                 batch: int = 4, device: str = "cpu", kv_heads: int = 2, intermediate: int = 64, experts: int = 4
                 ) -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    """A text-only ``Llama4ForCausalLM``: complex rotary embeddings (``torch.polar``,
    ``view_as_complex``), every layer a top-1 mixture of ``experts`` beside a shared expert; as
    :func:`build_mixtral` it returns its own loss."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    cfg = Llama4TextConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
                           intermediate_size_mlp=2 * intermediate, vocab_size=vocab, max_position_embeddings=seq,
                           num_local_experts=experts, num_experts_per_tok=1, interleave_moe_layer_step=1,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=False,
                           attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama4ForCausalLM(cfg)
    return _example(model, vocab, seq, batch, device)


def build_rwkv(layers: int = 2, hidden: int = 32, vocab: int = 256, seq: int = 32, batch: int = 4,
               device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor], None, tuple[()], dict[str, Any]]:
    """A ``RwkvForCausalLM``: its time mixing a recurrent scan over the sequence, each step's
    output written into a ``zeros_like`` buffer; as :func:`build_mixtral` it returns its own loss."""
    from transformers import RwkvConfig, RwkvForCausalLM

    cfg = RwkvConfig(num_hidden_layers=layers, hidden_size=hidden, attention_hidden_size=hidden,
                     intermediate_size=2 * hidden, vocab_size=vocab, context_length=seq, bos_token_id=1,
                     eos_token_id=2, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = RwkvForCausalLM(cfg)
    return _example(model, vocab, seq, batch, device)
