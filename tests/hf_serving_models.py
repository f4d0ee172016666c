"""Tiny random-weight HF causal LMs of the families people serve, and their single-device greedy tokens
(``model.generate(do_sample=False)``), for the serving tests."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

COMMON: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
                          "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": None, "pad_token_id": 0,  # no eos: every token generated
                          "attn_implementation": "sdpa"}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 16}),
    "mistral": ("Mistral", {"sliding_window": 8}),  # prompts and outputs run past the window
    "gemma": ("Gemma", {"head_dim": 16, "initializer_range": 0.2}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2Moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                               "shared_expert_intermediate_size": 64}),
}
"""Family -> (transformers class prefix, config fields beyond ``COMMON``)."""
MOE = {"mixtral", "qwen2_moe"}
PROMPTS = [[5, 7, 9, 11, 13, 2, 3, 4, 8, 100, 200], [42, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8]]
"""Three requests: over two chunks with padding, under one chunk, exactly two chunks."""
SLOTS, CHUNK, MAX_LEN, NEW = 4, 4, 32, 5
REFERENCE_NEW = 6
"""Tokens of each prompt's reference: with no eos, a request of fewer gets their prefix (greedy decoding's first
tokens do not depend on how many follow)."""


def build(family: str) -> nn.Module:
    """The family's ``*ForCausalLM`` from a tiny config, seeded (the same weights on every rank)."""
    import transformers

    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**COMMON, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).eval()


@functools.cache
def model(family: str) -> nn.Module:
    """The family's model, built once per test process, for references and forked ranks. Ranks forked after the
    parent built it serve their own copy of it (the fork's memory): compiling it there (the adapter's cache set
    on its attentions) leaves the parent's as it was. Serve a fresh ``build`` in the parent itself."""
    return build(family)


@functools.cache
def _reference(family: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(hf_greedy(model(family), [list(prompt)], REFERENCE_NEW)[0])


def reference(family: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    """``model.generate(do_sample=False)``'s first ``new`` tokens of each prompt on one device, computed once per
    family and prompt (and before forking: the ranks then find the family's model built)."""
    if new > REFERENCE_NEW:
        raise ValueError(f"references hold {REFERENCE_NEW} tokens a prompt, {new} asked")
    return [list(_reference(family, tuple(prompt))[:new]) for prompt in prompts]


def hf_greedy(model: nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """``model.generate(do_sample=False)``'s tokens of each prompt (one prompt a call: no padding)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new)
            out.append(got[0, len(prompt):].tolist())
    return out


def tp_plan(family: str) -> dict[str, ParallelStyle]:
    """Megatron TP of the served model's attention (and dense MLP), by the adapter's FQNs (``model.`` + HF's)."""
    names = [("self_attn.q_proj", ColwiseParallel()), ("self_attn.k_proj", ColwiseParallel()),
             ("self_attn.v_proj", ColwiseParallel()), ("self_attn.o_proj", RowwiseParallel())]
    if family not in MOE:
        names += [("mlp.gate_proj", ColwiseParallel()), ("mlp.up_proj", ColwiseParallel()),
                  ("mlp.down_proj", RowwiseParallel())]
    return {f"model.model.layers.*.{name}": style for name, style in names}


def step(batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Example (tokens, positions, slots) of a serving step."""
    zeros = torch.zeros(batch, steps, dtype=torch.long)
    return zeros, zeros.clone(), torch.arange(batch)
