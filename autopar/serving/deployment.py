"""A serving deployment as the simulator runs it: pools of identical replicas and their step times.

Aggregated: one pool whose replicas run prefill and decode together (continuous batching with
chunked prefill). Disaggregated (DistServe, Splitwise): a prefill pool and a decode pool; a
request's KV cache moves from the first to the second after its prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from autopar.errors import InputError, InputTypeError


@runtime_checkable
class StepTimes(Protocol):
    """Seconds one replica takes for one forward step, as a function of what the step holds.

    ``context`` of a prefill is counted in (query, key) pairs of causal attention: the sum,
    over the step's new tokens, of the positions each attends to (itself and those before it).
    A whole prompt of L tokens has L(L+1)/2; a chunk of c tokens after p already prefilled
    has c*p + c(c+1)/2. Pairs, not lengths, because attention's work is the pairs, whether a
    step holds one long prompt or many short chunks.
    """

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache one replica holds (after weights and activations)."""
        ...

    def prefill_s(self, tokens_in_batch: int, context: int) -> float:
        """A step of ``tokens_in_batch`` prompt tokens attending over ``context`` pairs."""
        ...

    def decode_s(self, batch_size: int, total_context_tokens: int) -> float:
        """A step generating one token for each of ``batch_size`` requests whose KV caches
        hold ``total_context_tokens`` tokens together."""
        ...

    def mixed_s(self, prefill_tokens: int, prefill_context: int, decode_batch: int,
                decode_context_tokens: int) -> float:
        """A step holding prefill chunks and decodes together (chunked prefill): one pass
        over the weights for both, so less than ``prefill_s + decode_s``."""
        ...

    def kv_transfer_s(self, tokens: int) -> float:
        """Moving one request's KV cache of ``tokens`` tokens from a prefill replica to a
        decode replica (disaggregated serving)."""
        ...


def _check_int(value: object, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{what} must be an int, got {value!r}")
    if value < minimum:
        raise InputError(f"{what} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True)
class Pool:
    """Identical replicas of one parallel configuration and one batching policy."""

    step_times: StepTimes
    """Step times and KV capacity of one replica."""
    replicas: int
    """Number of replicas, >= 1."""
    devices_per_replica: int = 1
    """Devices one replica runs on (its TP x PP degree): counts toward goodput per device."""
    max_batch: int = 256
    """Requests in flight per replica: admitted and holding KV cache (vLLM's ``max_num_seqs``)."""
    token_budget: int = 2048
    """Tokens one step processes at most: decode tokens plus prefill chunk tokens (vLLM's
    ``max_num_batched_tokens``). Without chunking a prompt longer than this still runs whole, alone."""
    chunked_prefill: bool = True
    """Split prompts into chunks that fill each step's budget left after the decodes (Sarathi-Serve's
    stall-free batching). False: a step prefills whole prompts and no decode runs in it (vLLM's
    original scheduler), so long prompts stall the decodes."""
    label: str = ""
    """Human-readable description of the replica (e.g. ``tp=2``), for reports."""

    def __post_init__(self) -> None:
        if not isinstance(self.step_times, StepTimes):
            raise InputTypeError(f"Pool.step_times must implement StepTimes, got {type(self.step_times).__name__}")
        _check_int(self.replicas, "Pool.replicas")
        _check_int(self.devices_per_replica, "Pool.devices_per_replica")
        _check_int(self.max_batch, "Pool.max_batch")
        _check_int(self.token_budget, "Pool.token_budget")
        if self.chunked_prefill and self.token_budget < self.max_batch:
            # Every decode of a full batch must fit one step's budget, or decodes would starve.
            raise InputError(f"Pool: token_budget ({self.token_budget}) must be >= max_batch ({self.max_batch}) "
                             "with chunked prefill, so a full batch's decodes fit one step")
        _check_int(self.step_times.kv_capacity_tokens, "Pool.step_times.kv_capacity_tokens", minimum=0)

    @property
    def devices(self) -> int:
        return self.replicas * self.devices_per_replica

    def describe(self) -> str:
        label = f"{self.label} " if self.label else ""
        return f"{self.replicas} x {label}({self.devices_per_replica} dev, batch<={self.max_batch}, " \
               f"budget {self.token_budget}{', chunked' if self.chunked_prefill else ''})"


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """One serving configuration: aggregated (``serve``) or disaggregated (``prefill`` and ``decode``)."""

    name: str
    """Short name for reports."""
    serve: Pool | None = None
    """The pool of an aggregated deployment: each replica prefills and decodes its requests."""
    prefill: Pool | None = None
    """The prefill pool of a disaggregated deployment."""
    decode: Pool | None = None
    """The decode pool of a disaggregated deployment."""

    def __post_init__(self) -> None:
        aggregated = self.serve is not None
        disaggregated = self.prefill is not None and self.decode is not None
        if aggregated == disaggregated or (not disaggregated and (self.prefill or self.decode)):
            raise InputError(f"Deployment {self.name!r}: give either serve (aggregated) or both prefill and decode "
                             "(disaggregated)")

    @property
    def disaggregated(self) -> bool:
        return self.serve is None

    @property
    def pools(self) -> tuple[Pool, ...]:
        return (self.serve,) if self.serve is not None else (self.prefill, self.decode)  # type: ignore[return-value]

    @property
    def devices(self) -> int:
        return sum(p.devices for p in self.pools)

    def describe(self) -> str:
        if self.serve is not None:
            return f"{self.name}: aggregated {self.serve.describe()}"
        assert self.prefill is not None and self.decode is not None
        return f"{self.name}: prefill {self.prefill.describe()} + decode {self.decode.describe()}"
