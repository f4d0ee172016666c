"""Goodput: the highest request rate a deployment serves within its SLO, and the best deployment.

DistServe (Zhong et al., OSDI 2024, Sec. 2 and 4) defines a deployment's goodput as the largest
arrival rate at which the fraction of requests meeting both the TTFT and the TPOT targets is at
least the SLO's percentile, and compares configurations by goodput per device (per GPU). Both
are found here by simulation: a bracketing search over the rate (doubling or halving from the
workload's rate until attainment changes side), then bisection on the log of the rate.

A run spans at least ``duration_s`` of arrivals and leaves its first ``warmup`` fraction of
requests uncounted: it starts with empty replicas, and a short run hides an overload (its
backlog grows by (rate - capacity) x time, so a rate a fraction d above what the deployment
sustains only fails a TTFT slack s once d x duration exceeds s; 30 x the TTFT target bounds d
to a few percent).

Every rate simulates the same requests (``Workload.sample`` draws with the workload's seed and
scales unit-rate gaps by the rate), so attainment moves with the rate, not with the noise of
new draws, and the search is deterministic. The bracket is grown from below: the goodput found
is the first crossing above the starting rate's side, a conservative answer where attainment is
not monotone in the rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from autopar.errors import InputError
from autopar.serving.deployment import Deployment
from autopar.errors import KVCapacityError
from autopar.serving.simulator import ServingReport, simulate
from autopar.serving.workload import SLO, Requests, Workload

_MAX_STEPS = 40
"""Doublings or halvings of the rate before the bracket search gives up: 2^40 spans any real range."""


@dataclass(frozen=True, kw_only=True)
class GoodputResult:
    """One deployment's goodput under one workload and SLO."""

    deployment: Deployment
    """The deployment searched."""
    goodput_rps: float
    """Largest arrival rate found whose SLO attainment reaches the percentile (0: none does, or the
    requests do not fit its caches)."""
    report: ServingReport | None
    """The run at ``goodput_rps`` (None when goodput is 0)."""
    simulations: int
    """Simulated runs the search took."""
    reason: str = ""
    """Why goodput is 0, when it is."""

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.deployment.devices

    def describe(self) -> str:
        if not self.goodput_rps:
            return f"{self.deployment.describe()}: goodput 0 ({self.reason})"
        r = self.report
        assert r is not None
        return (f"{self.deployment.describe()}: goodput {self.goodput_rps:.3g} req/s "
                f"({self.goodput_per_device:.3g} per device); at it TTFT p90 {r.ttft_s[90] * 1e3:.0f} ms, "
                f"TPOT p90 {r.tpot_s[90] * 1e3:.1f} ms, attainment {r.attainment:.3f}")


def requests_needed(slo: SLO, tail: int = 50, minimum: int = 200) -> int:
    """Requests a run needs for its attainment to resolve the percentile: ``tail`` requests
    expected beyond it (the binomial error of the attained fraction is then about
    sqrt(tail) / n), at least ``minimum``."""
    if slo.percentile >= 1:
        return max(minimum, 20 * tail)
    return max(minimum, math.ceil(tail / (1 - slo.percentile) - 1e-9))  # 50 / 0.1 is 500.0000000001


def find_goodput(deployment: Deployment, workload: Workload | Requests, slo: SLO, *, requests: int | None = None,
                 duration_s: float | None = None, warmup: float = 0.1, rel_tol: float = 0.02) -> GoodputResult:
    """``deployment``'s goodput: the search described in the module docstring, to within ``rel_tol``
    of the rate. A run at rate r simulates max(``requests``, r x ``duration_s``) requests
    (defaults ``requests_needed(slo)`` and 30 x the TTFT target) and counts all but the first
    ``warmup`` fraction. ``workload`` may be recorded ``Requests`` (``read_trace``): each run
    replays all of them, the time axis scaled to the rate (``requests`` and ``duration_s`` unused)."""
    if not 0 < rel_tol < 1:
        raise InputError(f"rel_tol must be in (0, 1), got {rel_tol}")
    sample, start = _sampler(workload, slo, requests, duration_s)
    runs: dict[float, ServingReport] = {}

    def meets(rate: float) -> bool:
        if rate not in runs:
            runs[rate] = simulate(deployment, sample(rate)).report(slo, warmup)
        return runs[rate].attainment >= slo.percentile

    try:
        lo, hi = _bracket(meets, start)
        while lo and hi / lo > 1 + rel_tol:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    except KVCapacityError as e:  # a candidate whose caches cannot hold the requests serves none of them
        return GoodputResult(deployment=deployment, goodput_rps=0.0, report=None, simulations=len(runs), reason=str(e))
    if lo == 0.0:
        return GoodputResult(deployment=deployment, goodput_rps=0.0, report=None, simulations=len(runs),
                             reason=f"attainment stays below {slo.percentile} even at "
                                    f"{start / 2 ** _MAX_STEPS:.3g} req/s (the SLO is too tight)")
    return GoodputResult(deployment=deployment, goodput_rps=lo, report=runs[lo], simulations=len(runs))


def meets_slo(deployment: Deployment, workload: Workload | Requests, slo: SLO, rate: float, *,
              requests: int | None = None, duration_s: float | None = None, warmup: float = 0.1) -> bool:
    """Whether ``deployment`` serves ``workload`` at ``rate`` within ``slo``: one run of ``find_goodput``'s
    search (the same requests and arguments), a cheap test of whether its goodput reaches ``rate``."""
    sample, _ = _sampler(workload, slo, requests, duration_s)
    try:
        return simulate(deployment, sample(rate)).report(slo, warmup).attainment >= slo.percentile
    except KVCapacityError:
        return False


def _sampler(workload: Workload | Requests, slo: SLO, requests: int | None, duration_s: float | None
             ) -> tuple[Callable[[float], Requests], float]:
    """The requests of a run at a given rate (``find_goodput``'s defaults for ``requests`` and ``duration_s``),
    and the rate the search starts at."""
    minimum = requests_needed(slo) if requests is None else requests
    duration = 30 * slo.ttft_s if duration_s is None else duration_s
    if minimum < 1 or not duration >= 0:
        raise InputError(f"requests must be >= 1 and duration_s >= 0, got {minimum} and {duration}")
    if isinstance(workload, Requests):
        trace = workload
        return trace.at_rate, trace.rate
    return (lambda rate: workload.sample(max(minimum, math.ceil(rate * duration)), rate)), workload.arrival_rate


def _bracket(meets: Callable[[float], bool], start: float) -> tuple[float, float]:
    """Rates ``lo`` < ``hi`` with ``meets(lo)`` and not ``meets(hi)``, a factor 2 apart; ``lo`` 0
    when no rate down to ``start / 2^40`` meets the SLO."""
    rate = start
    if meets(rate):
        for _ in range(_MAX_STEPS):
            if not meets(rate * 2):
                return rate, rate * 2
            rate *= 2
        raise InputError(f"attainment still meets the SLO at {rate:.3g} req/s: the step times or SLO are degenerate")
    for _ in range(_MAX_STEPS):
        rate /= 2
        if meets(rate):
            return rate, rate * 2
    return 0.0, rate


def best_deployment(candidates: Iterable[Deployment], workload: Workload | Requests, slo: SLO, *,
                    requests: int | None = None, duration_s: float | None = None, warmup: float = 0.1,
                    rel_tol: float = 0.02) -> list[GoodputResult]:
    """Every candidate's goodput (``find_goodput``'s arguments), best goodput per device first
    (DistServe's criterion); ties go to the higher goodput, then to the earlier candidate."""
    results = [find_goodput(d, workload, slo, requests=requests, duration_s=duration_s, warmup=warmup,
                            rel_tol=rel_tol) for d in candidates]
    if not results:
        raise InputError("best_deployment needs at least one candidate deployment")
    order = sorted(range(len(results)),
                   key=lambda i: (-results[i].goodput_per_device, -results[i].goodput_rps, i))
    return [results[i] for i in order]
