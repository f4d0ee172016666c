"""What a serving deployment is planned for: the cluster, the requests and the latency SLO.

``Cluster`` names the devices (a hardware profile of ``autopar.hardware``), ``Workload`` the
requests (prompt and output lengths, fixed or drawn from a distribution, and a Poisson arrival
rate), ``SLO`` the latency targets a request must meet. ``read_trace`` reads recorded requests
from a CSV file instead. Sampling is seeded: the same workload and seed give the same requests.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from autopar.errors import InputError, InputTypeError
from autopar.hardware import HardwareProfile, get_profile


@runtime_checkable
class TokenDistribution(Protocol):
    """A distribution of token counts (positive ints)."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` draws as an int64 array, every value >= 1."""
        ...

    @property
    def mean(self) -> float:
        """Expected value (of the draws as returned, after rounding and clipping)."""
        ...


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise InputError(f"{what} must be >= 1, got {value}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class Fixed:
    """Every request has the same count."""

    value: int
    """The token count, >= 1."""

    def __post_init__(self) -> None:
        _positive_int(self.value, "Fixed.value")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)

    @property
    def mean(self) -> float:
        return float(self.value)


@dataclass(frozen=True, kw_only=True)
class Uniform:
    """Counts drawn uniformly from the integers ``low..high`` (both included)."""

    low: int
    """Smallest count, >= 1."""
    high: int
    """Largest count, >= low."""

    def __post_init__(self) -> None:
        _positive_int(self.low, "Uniform.low")
        _positive_int(self.high, "Uniform.high")
        if self.high < self.low:
            raise InputError(f"Uniform needs low <= high, got low={self.low}, high={self.high}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass(frozen=True, kw_only=True)
class LogNormal:
    """Counts whose logarithm is normal, rounded to ints and clipped to ``low..high``: the
    long-tailed shape of chat prompt and answer lengths (e.g. ShareGPT's, which DistServe and
    vLLM's benchmarks draw from)."""

    median: float
    """Median count (exp of the normal's mean), > 0."""
    sigma: float
    """Standard deviation of the log count, >= 0."""
    low: int = 1
    """Smallest count kept (draws below are raised to it), >= 1."""
    high: int = 1 << 20
    """Largest count kept (draws above are lowered to it): bounds the tail, which a KV cache must hold."""

    def __post_init__(self) -> None:
        if not self.median > 0 or not math.isfinite(self.median):
            raise InputError(f"LogNormal.median must be a positive number, got {self.median!r}")
        if not self.sigma >= 0 or not math.isfinite(self.sigma):
            raise InputError(f"LogNormal.sigma must be >= 0, got {self.sigma!r}")
        _positive_int(self.low, "LogNormal.low")
        _positive_int(self.high, "LogNormal.high")
        if self.high < self.low:
            raise InputError(f"LogNormal needs low <= high, got low={self.low}, high={self.high}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        draws = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(draws), self.low, self.high).astype(np.int64)

    @property
    def mean(self) -> float:
        # Of the clipped, rounded draws: estimated from a fixed-seed sample, since clipping has
        # no short closed form; deterministic.
        return float(self.sample(np.random.default_rng(0), 100_000).mean())


@dataclass(frozen=True, kw_only=True)
class Empirical:
    """Counts drawn with replacement from recorded ones (e.g. a dataset's prompt lengths)."""

    samples: tuple[int, ...]
    """The recorded counts, each >= 1; at least one."""

    def __post_init__(self) -> None:
        if not isinstance(self.samples, tuple):
            object.__setattr__(self, "samples", tuple(self.samples))
        if not self.samples:
            raise InputError("Empirical needs at least one sample")
        for s in self.samples:
            _positive_int(s, "Empirical sample")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.samples, dtype=np.int64), size=n, replace=True)

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples))


def as_distribution(value: int | TokenDistribution, what: str) -> TokenDistribution:
    """``value`` as a distribution: an int is ``Fixed``; a distribution is kept."""
    if isinstance(value, TokenDistribution):
        return value
    return Fixed(value=_positive_int(value, what))


@dataclass(frozen=True, kw_only=True)
class Requests:
    """Requests of one serving run, ordered by arrival."""

    arrival_s: np.ndarray
    """Arrival times, seconds from the start, non-decreasing (float64)."""
    prompt_tokens: np.ndarray
    """Prompt length of each request (int64, >= 1)."""
    output_tokens: np.ndarray
    """Tokens each request generates, the first one by its prefill (int64, >= 1)."""

    def __post_init__(self) -> None:
        # Lists are welcome; the simulator and the reports want arrays.
        object.__setattr__(self, "arrival_s", np.asarray(self.arrival_s, dtype=np.float64))
        for name in ("prompt_tokens", "output_tokens"):
            values = np.asarray(getattr(self, name))
            if values.size and not np.issubdtype(values.dtype, np.integer):
                raise InputTypeError(f"Requests.{name} must be ints, got {values.dtype}")
            object.__setattr__(self, name, values.astype(np.int64))
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise InputError("Requests: arrival_s, prompt_tokens and output_tokens differ in length")
        if n and (np.any(np.diff(self.arrival_s) < 0) or self.arrival_s[0] < 0 or
                  not np.all(np.isfinite(self.arrival_s))):
            raise InputError("Requests: arrival times must be finite, >= 0 and non-decreasing")
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise InputError("Requests: prompt and output token counts must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests/s: arrivals after the first over the span they cover."""
        span = float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0
        if span <= 0:
            raise InputError("Requests: a rate needs at least two distinct arrival times")
        return (len(self) - 1) / span

    def at_rate(self, rate: float) -> "Requests":
        """The same requests with the time axis scaled to a mean arrival rate of ``rate`` (a trace
        replayed faster or slower keeps its burstiness), starting at 0."""
        if not rate > 0 or not math.isfinite(rate):
            raise InputError(f"arrival rate must be a positive number of requests/s, got {rate}")
        arrival = (self.arrival_s - self.arrival_s[0]) * (self.rate / rate)
        return Requests(arrival_s=arrival, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Requests arriving as a Poisson process, with prompt and output lengths drawn independently."""

    prompt_tokens: int | TokenDistribution
    """Prompt length: a fixed int or a distribution (``Fixed``, ``Uniform``, ``LogNormal``, ``Empirical``)."""
    output_tokens: int | TokenDistribution
    """Tokens generated per request (including the first, which prefill produces): int or distribution."""
    arrival_rate: float
    """Mean requests per second (Poisson arrivals); the goodput search starts its bracket here."""
    seed: int = 0
    """Seed of every draw: the same workload, seed and count give the same requests."""
    prompt: TokenDistribution = field(init=False, repr=False, compare=False)
    """``prompt_tokens`` as a distribution."""
    output: TokenDistribution = field(init=False, repr=False, compare=False)
    """``output_tokens`` as a distribution."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", as_distribution(self.prompt_tokens, "Workload.prompt_tokens"))
        object.__setattr__(self, "output", as_distribution(self.output_tokens, "Workload.output_tokens"))
        if isinstance(self.arrival_rate, bool) or not isinstance(self.arrival_rate, (int, float)):
            raise InputTypeError(f"Workload.arrival_rate must be a number, got {self.arrival_rate!r}")
        if not self.arrival_rate > 0 or not math.isfinite(self.arrival_rate):
            raise InputError(f"Workload.arrival_rate must be a positive number of requests/s, got {self.arrival_rate}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InputTypeError(f"Workload.seed must be an int, got {self.seed!r}")

    def sample(self, n: int, rate: float | None = None) -> Requests:
        """``n`` requests at ``rate`` requests/s (default ``arrival_rate``).

        The draws depend on the seed and ``n`` only, not on the rate: the rate scales the same
        unit-rate inter-arrival gaps, so runs at different rates see the same requests, closer
        or further apart (common random numbers: the goodput search compares rates, not noise).
        Gaps, prompts and outputs come from three streams of the seed, so the first k of ``n``
        requests are the ``k`` requests of a shorter run: runs of different lengths agree on
        their common prefix."""
        n = _positive_int(n, "number of requests")
        rate = self.arrival_rate if rate is None else rate
        if not rate > 0 or not math.isfinite(rate):
            raise InputError(f"arrival rate must be a positive number of requests/s, got {rate}")
        gap_rng, prompt_rng, output_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(self.seed).spawn(3))
        gaps = gap_rng.exponential(1.0, size=n)
        prompt = self.prompt.sample(prompt_rng, n)
        output = self.output.sample(output_rng, n)
        return Requests(arrival_s=np.cumsum(gaps) / rate, prompt_tokens=prompt, output_tokens=output)


@dataclass(frozen=True, kw_only=True)
class SLO:
    """Latency targets; a request meets the SLO when it meets both."""

    ttft_s: float
    """Time to first token: first token's time less the request's arrival, seconds (> 0)."""
    tpot_s: float
    """Time per output token after the first: (finish - first token) / (output tokens - 1), seconds (> 0)."""
    percentile: float = 0.9
    """Fraction of requests that must meet both targets, in (0, 1]."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "percentile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"SLO.{name} must be a finite number, got {value!r}")
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise InputError(f"SLO latencies must be > 0, got ttft_s={self.ttft_s}, tpot_s={self.tpot_s}")
        if not 0 < self.percentile <= 1:
            raise InputError(f"SLO.percentile is a fraction in (0, 1], got {self.percentile}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The devices a deployment may use."""

    devices: int
    """Number of devices, >= 1."""
    hardware: str | HardwareProfile = "h100"
    """Profile of every device: a name of ``autopar.hardware.PROFILES`` or a profile."""
    devices_per_node: int = 8
    """Devices sharing one fast interconnect (NVLink domain)."""
    profile: HardwareProfile = field(init=False, repr=False, compare=False)
    """``hardware`` resolved to its profile."""

    def __post_init__(self) -> None:
        _positive_int(self.devices, "Cluster.devices")
        _positive_int(self.devices_per_node, "Cluster.devices_per_node")
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise InputError(f"Cluster: {self.devices} devices do not fill whole nodes of {self.devices_per_node}")
        object.__setattr__(self, "profile", get_profile(self.hardware))


TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


def read_trace(path: str | Path) -> Requests:
    """Requests recorded in a CSV file with a header naming the columns ``arrival_s``,
    ``prompt_tokens``, ``output_tokens`` (others are ignored). Rows are sorted by arrival
    (stably); a bad row is an ``InputError`` naming its line."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise InputError(f"{path}: trace needs columns {', '.join(TRACE_COLUMNS)}; "
                                 f"missing {', '.join(missing)}")
            rows = [_trace_row(row, path, line) for line, row in enumerate(reader, start=2)]
    except OSError as e:
        raise InputError(f"cannot read trace {path}: {e}") from None
    if not rows:
        raise InputError(f"{path}: trace has no requests")
    rows.sort(key=lambda r: r[0])
    arrival, prompt, output = zip(*rows)
    return Requests(arrival_s=np.array(arrival, dtype=np.float64), prompt_tokens=np.array(prompt, dtype=np.int64),
                    output_tokens=np.array(output, dtype=np.int64))


def _trace_row(row: dict[str, str], path: Path, line: int) -> tuple[float, int, int]:
    try:
        arrival = float(row["arrival_s"])
        prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
    except (TypeError, ValueError):
        raise InputError(f"{path}:{line}: expected a number and two ints, got {row}") from None
    if not math.isfinite(arrival) or arrival < 0 or prompt < 1 or output < 1:
        raise InputError(f"{path}:{line}: need arrival_s >= 0 and token counts >= 1, got {row}")
    return arrival, prompt, output
