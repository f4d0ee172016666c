"""Analytic step times of a decoder-only transformer replica: the roofline stand-in.

``RooflineStepTimes`` prices a serving step from the model's shape and the hardware profile,
with the cost model's own functions (``autopar.cost.compute.roofline_time``,
``autopar.cost.collectives.collective_time`` and ``point_to_point_time``), so serving and
training price a FLOP, a byte and a collective alike. It stands in until decode-step capture
lands: then a replica's prefill and decode steps are captured with their KV-cache inputs and
outputs and priced by the intra-op ILP's plan (every op, its sharding and its collectives),
which replaces this class behind the same ``StepTimes`` protocol.

Formulas (per replica of ``tp`` devices, tensor parallel as Megatron-LM splits a layer: heads
and the MLP's hidden split, two all-reduces per layer):

- FLOPs: 2 x (matmul parameters of the layers) x (tokens in the step), the standard
  2-FLOPs-per-parameter-per-token of a forward pass (Kaplan et al. 2020, "Scaling Laws",
  Sec. 2.1); attention's QK^T and PV add 4 x head_dim x heads x layers per (query, key) pair,
  the pairs of causal prefill (``StepTimes``'s ``context``) and of decode (its context length);
  the LM head, 2 x hidden x vocab, only at positions that sample (one per decode, one per
  prefill step: vLLM computes logits for sampled positions only). All divided by ``tp``.
- Bytes read and written per device: the layers' and LM head's weights once per step / tp
  (the embedding table is only indexed), the KV cache read by decodes (context tokens x KV
  bytes per token / tp) and written for every new token. Activations are omitted: small next
  to the weights at decode, under the compute at prefill. Prefill's reads of earlier chunks' KV
  are omitted too (prefill is compute-bound).
- Time: ``roofline_time`` (the slower of FLOPs at the profile's peak x compute efficiency and
  bytes at bandwidth x memory efficiency), plus 2 x layers all-reduces of the step's
  activations (tokens x hidden, bf16) by alpha-beta over the replica's TP group, plus a fixed
  ``step_overhead_s`` (scheduling, sampling; 0 by default, as with CUDA graphs replaying the
  kernels; measure it for a given engine).
- KV capacity: the device's memory limit (the profile's, less its headroom) less the weights / tp
  and an activation reserve for a step of ``activation_tokens``, divided by the KV bytes per
  token per device.
- KV transfer: the request's KV bytes / tp per device (each prefill rank sends its heads to the
  decode rank holding them, all in parallel), one point-to-point send over NVLink or the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopar.cost.collectives import CollectiveCall, collective_time, point_to_point_time
from autopar.cost.compute import roofline_time
from autopar.cost.precision import PRECISIONS
from autopar.errors import InputError
from autopar.hardware import HardwareProfile, get_profile
from autopar.mesh import Mesh
from autopar.rules.redistribute import ALL_REDUCE


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The shape of a decoder-only transformer (Llama-style: GQA attention, gated MLP)."""

    layers: int
    """Decoder layers."""
    hidden: int
    """Model width."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention; = heads for multi-head)."""
    intermediate: int
    """MLP hidden width."""
    vocab: int
    """Vocabulary size."""
    head_dim: int = 0
    """Per-head width (0: hidden // heads)."""
    gated_mlp: bool = True
    """Three MLP matrices (gate, up, down: SwiGLU) rather than two."""
    tied_embeddings: bool = False
    """The LM head reuses the embedding table (no separate weights)."""
    weight_bytes: int = 2
    """Bytes per parameter as served (bf16: 2)."""
    kv_bytes: int = 2
    """Bytes per KV-cache element (bf16: 2; fp8 caches: 1)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "weight_bytes", "kv_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"TransformerShape.{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise InputError(f"TransformerShape: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if not self.head_dim:
            if self.hidden % self.heads:
                raise InputError(f"TransformerShape: hidden ({self.hidden}) is not a multiple of heads ({self.heads}); "
                                 "give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @classmethod
    def from_hf_config(cls, config: Any, **overrides: Any) -> "TransformerShape":
        """The shape a Hugging Face Llama-style config describes (``num_hidden_layers``, ``hidden_size``...)."""
        try:
            values = dict(layers=config.num_hidden_layers, hidden=config.hidden_size,
                          heads=config.num_attention_heads,
                          kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                          intermediate=config.intermediate_size, vocab=config.vocab_size,
                          head_dim=getattr(config, "head_dim", None) or 0,
                          tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
        except AttributeError as e:
            raise InputError(f"config lacks a field a decoder-only transformer shape needs: {e}") from None
        return cls(**{**values, **overrides})

    @property
    def layer_params(self) -> int:
        """Matmul parameters of one layer (attention projections and MLP; norms are negligible)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """All parameters: layers, norms, embedding and (untied) LM head."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (self.layer_params + 2 * self.hidden) + embeddings + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes over all layers (keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes


LLAMA3_8B = TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
"""Llama-3-8B (Meta's config.json): 8.03e9 parameters, 128 KiB of bf16 KV cache per token."""


@dataclass(frozen=True, kw_only=True)
class RooflineStepTimes:
    """``StepTimes`` of one tensor-parallel replica, priced analytically (see the module docstring).

    The analytic stand-in until decode-step capture: the intra-op-ILP-priced version replaces it."""

    model: TransformerShape
    """The served model's shape."""
    hardware: str | HardwareProfile
    """Device profile (a name of ``autopar.hardware.PROFILES`` or a profile)."""
    tp: int = 1
    """Tensor-parallel degree of one replica (inside one node)."""
    devices_per_node: int = 8
    """Devices per node: the TP group must fit in one."""
    transfer_intra_node: bool = False
    """KV transfers to the decode pool stay in a node (NVLink) rather than cross the network."""
    activation_tokens: int = 2048
    """Tokens of the largest step, for the activation reserve (the pool's token budget)."""
    step_overhead_s: float = 0.0
    """Fixed seconds per step besides the kernels (scheduler, sampling)."""
    profile: HardwareProfile = field(init=False, repr=False, compare=False)
    """``hardware`` resolved."""
    mesh: Mesh = field(init=False, repr=False, compare=False)
    """The replica's TP group as a planning mesh (its links price the all-reduces)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "profile", get_profile(self.hardware))
        m = self.model
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise InputError(f"RooflineStepTimes.tp must be a positive int, got {self.tp!r}")
        if self.tp > self.devices_per_node:
            raise InputError(f"tp={self.tp} spans more than a node of {self.devices_per_node} devices")
        if m.heads % self.tp or (m.kv_heads % self.tp and self.tp % m.kv_heads) or m.intermediate % self.tp:
            raise InputError(f"tp={self.tp} does not split {m.heads} heads / {m.kv_heads} KV heads / "
                             f"{m.intermediate} MLP width evenly")
        if self.step_overhead_s < 0 or self.activation_tokens < 1:
            raise InputError("RooflineStepTimes: step_overhead_s must be >= 0 and activation_tokens >= 1")
        object.__setattr__(self, "mesh", Mesh({"tp": self.tp}, self.profile, self.devices_per_node))

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        """A token's KV bytes on one device: its share of the KV heads (a KV head is copied on
        every device of its group when tp exceeds the KV heads)."""
        m = self.model
        return m.kv_bytes_per_token * max(m.kv_heads // self.tp, 1) / m.kv_heads

    @property
    def weight_bytes_per_device(self) -> float:
        return self.model.params * self.model.weight_bytes / self.tp

    @property
    def kv_capacity_tokens(self) -> int:
        m = self.model
        # Peak activations of one step per device: residual and norm (2 x hidden), q/k/v and the
        # MLP's gate and up (split by tp), bf16; fp32 logits of the sampled positions (one per token
        # at worst). vLLM measures this with a profiling step; this is its estimate.
        width = 2 * m.hidden + (m.heads + 2 * m.kv_heads) * m.head_dim / self.tp + 2 * m.intermediate / self.tp
        activations = self.activation_tokens * (width * m.weight_bytes + 4 * m.vocab / self.tp)
        free = self.profile.memory_limit() - self.weight_bytes_per_device - activations
        return max(int(free // self.kv_bytes_per_token_per_device), 0)

    def mixed_s(self, prefill_tokens: int, prefill_context: int, decode_batch: int,
                decode_context_tokens: int) -> float:
        m = self.model
        tokens = prefill_tokens + decode_batch
        if tokens == 0:
            return 0.0
        sampled = decode_batch + (1 if prefill_tokens else 0)
        flops = (2 * m.layer_params * m.layers * tokens
                 + 4 * m.head_dim * m.heads * m.layers * (prefill_context + decode_context_tokens)
                 + 2 * m.hidden * m.vocab * sampled) / self.tp
        weights = (m.layer_params * m.layers + m.hidden * m.vocab) * m.weight_bytes / self.tp
        kv = (decode_context_tokens + tokens) * self.kv_bytes_per_token_per_device
        compute = roofline_time(flops, weights + kv, self.mesh, PRECISIONS["bf16"])
        return compute + 2 * m.layers * self._all_reduce_s(tokens) + self.step_overhead_s

    def prefill_s(self, tokens_in_batch: int, context: int) -> float:
        return self.mixed_s(tokens_in_batch, context, 0, 0)

    def decode_s(self, batch_size: int, total_context_tokens: int) -> float:
        return self.mixed_s(0, 0, batch_size, total_context_tokens)

    def kv_transfer_s(self, tokens: int) -> float:
        nbytes = tokens * self.kv_bytes_per_token_per_device
        # A two-device mesh whose one axis is intra- or inter-node as asked: its link prices the send.
        pair = Mesh({"pd": 2}, self.profile, devices_per_node=2 if self.transfer_intra_node else 1)
        return point_to_point_time(nbytes, 0, pair)

    def _all_reduce_s(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        nbytes = tokens * self.model.hidden * PRECISIONS["bf16"].activation_bytes
        return collective_time(CollectiveCall(ALL_REDUCE, 0, nbytes), self.mesh)

    def describe(self) -> str:
        return f"tp={self.tp} ({self.profile.name}, KV {self.kv_capacity_tokens} tokens)"

