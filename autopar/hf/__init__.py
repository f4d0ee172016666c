"""Hugging Face models as they are: planned from a ``config.json`` (``from_config``) and served
(``servable``: a slot-indexed KV cache around an HF causal LM's own attention)."""

from autopar.hf.config import HFStep, from_config, load_config
from autopar.hf.servable import ServableCausalLM, as_servable, servable

__all__ = ["HFStep", "from_config", "load_config", "ServableCausalLM", "servable", "as_servable"]
