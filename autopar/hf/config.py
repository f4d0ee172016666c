"""Hugging Face models from their ``config.json``: built on the meta device, ready to plan.

``from_config(path_or_dict, batch=, seq=)`` builds the model a published config describes (the class of
its ``architectures[0]``, the head the checkpoint was published with; else ``AutoModelForCausalLM``
where the family has one, else ``AutoModel``) without weight memory, and an example step of
``batch`` sequences of ``seq`` tokens whose loss is the one the model computes from ``labels``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from autopar.errors import InputError, InputTypeError


class HFStep(NamedTuple):
    """A training step of an HF model: ``model(*example_inputs, **example_kwargs)`` returns its loss
    (``loss_fn`` None) where the model takes ``labels``; ``example_kwargs`` is empty otherwise."""

    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    loss_fn: None
    example_targets: tuple[()]
    example_kwargs: dict[str, torch.Tensor]


def load_config(source: str | Path | dict[str, Any]) -> Any:
    """A transformers config from a ``config.json`` path or its dict (``model_type`` names the family)."""
    from transformers import AutoConfig

    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise InputError(f"no such config file {source}")
        try:
            source = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(source, dict):
        raise InputTypeError(f"expected a config.json path or its dict, got {type(source).__name__}")
    fields = dict(source)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise InputError("the config has no \"model_type\" (transformers names the model family by it)")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as exc:
        raise InputError(f"transformers cannot build a {model_type!r} config: {exc}") from exc


def model_class(config: Any, causal: bool = False) -> type[nn.Module]:
    """The class a config's model is built as: its published head (``architectures[0]``) unless
    ``causal`` asks for the family's causal LM; a causal LM where the family has one; else the bare model."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = (getattr(config, "architectures", None) or [None])[0]
    if not causal and isinstance(named, str) and hasattr(transformers, named):
        return getattr(transformers, named)
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM._model_mapping[type(config)]
    if causal:
        raise InputError(f"transformers has no causal LM for model_type {config.model_type!r}: it cannot be served")
    return AutoModel._model_mapping[type(config)]


def max_positions(config: Any) -> int | None:
    """The positions a config's model embeds or rotates (``max_position_embeddings``, GPT-2's ``n_positions``)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def build(config: Any, cls: type[nn.Module], device: str | torch.device, dtype: torch.dtype | None) -> nn.Module:
    """``cls(config)`` on ``device`` (the meta device allocates nothing), seeded, with SDPA attention."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    return model.to(dtype) if dtype is not None else model


def from_config(source: str | Path | dict[str, Any], *, batch: int, seq: int, device: str | torch.device = "meta",
                dtype: torch.dtype | None = None) -> HFStep:
    """The model of a ``config.json`` (path or dict) and an example step of ``batch`` x ``seq`` tokens.

    The model is built on ``device`` (default meta: planning only), in fp32 unless ``dtype`` says
    (``autopar.plan``'s precision decides the compute dtype), without a KV cache (``use_cache`` off: a
    training step keeps none). Models taking ``labels`` return their own loss from them (a causal LM
    the next-token loss, shifting them by one; a masked LM the masked-token loss)."""
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive whole number, got {value!r}")
    config = load_config(source)
    limit = max_positions(config)
    if limit is not None and seq > limit:
        raise InputError(f"seq {seq} exceeds the {limit} positions this {config.model_type} config embeds")
    config.use_cache = False
    model = build(config, model_class(config), device, dtype)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    takes_labels = "labels" in inspect.signature(model.forward).parameters
    return HFStep(model, (ids,), None, (), {"labels": ids} if takes_labels else {})
