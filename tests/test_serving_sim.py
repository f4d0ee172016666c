"""The serving simulator and goodput search (issue 12): closed forms and properties."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from autopar.errors import InputError
from autopar.serving.deployment import Deployment, Pool
from autopar.serving.goodput import best_deployment, find_goodput, requests_needed
from autopar.serving.candidates import candidate_deployments
from autopar.serving.roofline import LLAMA3_8B, RooflineStepTimes, TransformerShape
from autopar.errors import KVCapacityError
from autopar.serving.simulator import simulate
from autopar.serving.workload import SLO, Cluster, Fixed, Requests, Uniform, Workload


@dataclass(frozen=True, kw_only=True)
class LinearTimes:
    """Step times linear in the step's tokens and context: a synthetic replica with known answers."""

    base: float = 0.0
    per_token: float = 0.0
    per_pair: float = 0.0
    per_decode: float = 0.0
    per_context: float = 0.0
    transfer_per_token: float = 0.0
    kv_capacity_tokens: int = 10**9

    def mixed_s(self, prefill_tokens: int, prefill_context: int, decode_batch: int,
                decode_context_tokens: int) -> float:
        return (self.base + self.per_token * prefill_tokens + self.per_pair * prefill_context
                + self.per_decode * decode_batch + self.per_context * decode_context_tokens)

    def prefill_s(self, tokens_in_batch: int, context: int) -> float:
        return self.mixed_s(tokens_in_batch, context, 0, 0)

    def decode_s(self, batch_size: int, total_context_tokens: int) -> float:
        return self.mixed_s(0, 0, batch_size, total_context_tokens)

    def kv_transfer_s(self, tokens: int) -> float:
        return self.transfer_per_token * tokens


def aggregated(times: LinearTimes, replicas: int = 1, **pool: object) -> Deployment:
    return Deployment(name=f"agg x{replicas}", serve=Pool(step_times=times, replicas=replicas, **pool))


def one_request(prompt: int, output: int) -> Requests:
    return Requests(arrival_s=np.array([0.0]), prompt_tokens=np.array([prompt]), output_tokens=np.array([output]))


# A replica whose steps cost what a small model's would: a fixed part, prefill per token, decode
# per request and per context token. Used by the property tests (fast: short requests).
SMALL = LinearTimes(base=2e-3, per_token=5e-5, per_pair=1e-8, per_decode=5e-5, per_context=1e-7,
                    transfer_per_token=2e-6, kv_capacity_tokens=20_000)
SMALL_LOAD = Workload(prompt_tokens=Uniform(low=50, high=400), output_tokens=Uniform(low=4, high=24), arrival_rate=20.0)


@pytest.mark.parametrize("rho, tol", [(0.5, 0.03), (0.8, 0.06)])
def test_md1_waiting_time_matches_pollaczek_khinchine(rho: float, tol: float) -> None:
    """One replica, no batching, a fixed service time D, Poisson arrivals: an M/D/1 queue, whose mean
    wait is rho D / (2 (1 - rho)) (Pollaczek-Khinchine with zero service variance)."""
    service = 0.01
    deployment = aggregated(LinearTimes(base=service), max_batch=1, token_budget=1)
    requests = Workload(prompt_tokens=1, output_tokens=1, arrival_rate=rho / service, seed=0).sample(40_000)
    result = simulate(deployment, requests)
    wait = float(np.mean(result.ttft_s - service))
    assert wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=tol)
    assert np.all(result.finish_s == result.first_token_s)  # one output token: done at prefill


def test_lone_request_latencies_are_its_steps() -> None:
    times = LinearTimes(base=1e-3, per_token=1e-5, per_decode=1e-4, per_context=1e-6)
    result = simulate(aggregated(times, token_budget=4096), one_request(1000, 11))
    assert result.ttft_s[0] == pytest.approx(times.prefill_s(1000, 1000 * 1001 // 2))
    # Decode steps at contexts 1001..1010 (the prompt and the tokens generated so far).
    decode = sum(times.decode_s(1, 1000 + g) for g in range(1, 11))
    assert result.tpot_s[0] == pytest.approx(decode / 10)


def test_chunked_prefill_splits_a_long_prompt_by_the_budget() -> None:
    times = LinearTimes(base=1e-3, per_token=1e-5, per_pair=1e-9)
    result = simulate(aggregated(times, token_budget=256, max_batch=8), one_request(1000, 1))
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]
    expected = sum(times.prefill_s(c, c * p + c * (c + 1) // 2) for c, p in chunks)
    assert result.ttft_s[0] == pytest.approx(expected)


def test_disaggregated_ttft_includes_the_kv_transfer() -> None:
    prefill = LinearTimes(base=1e-3, per_token=1e-5, transfer_per_token=1e-6)
    decode = LinearTimes(base=2e-3, per_decode=1e-4)
    deployment = Deployment(name="pd", prefill=Pool(step_times=prefill, replicas=1),
                            decode=Pool(step_times=decode, replicas=1))
    result = simulate(deployment, one_request(500, 5))
    transfer = decode.kv_transfer_s(500)  # the decode side pulls: its StepTimes prices the transfer
    assert result.ttft_s[0] == pytest.approx(prefill.prefill_s(500, 500 * 501 // 2) + transfer)
    assert result.tpot_s[0] == pytest.approx(decode.decode_s(1, 0))
    # Under load too, every request's TTFT is at least its own prefill and transfer.
    requests = SMALL_LOAD.sample(300)
    result = simulate(deployment, requests)
    floor = [prefill.prefill_s(p, p * (p + 1) // 2) + decode.kv_transfer_s(p) for p in requests.prompt_tokens]
    assert np.all(result.ttft_s >= np.array(floor) - 1e-12)
    assert np.all(result.finish_s >= result.first_token_s)


def test_a_request_longer_than_the_kv_cache_is_refused() -> None:
    times = LinearTimes(base=1e-3, kv_capacity_tokens=1000)
    with pytest.raises(KVCapacityError, match="needs 1001 tokens of KV cache.*holds \\(1000\\)"):
        simulate(aggregated(times), one_request(900, 101))
    simulate(aggregated(times), one_request(900, 100))  # exactly full fits


def test_bad_step_times_are_reported() -> None:
    with pytest.raises(InputError, match="steps must take a finite time"):
        simulate(aggregated(LinearTimes(base=-1.0)), one_request(10, 2))


def test_kv_capacity_serializes_requests_that_do_not_fit_together() -> None:
    times = LinearTimes(base=1e-3, per_token=1e-5, per_decode=1e-4, kv_capacity_tokens=1500)
    requests = Requests(arrival_s=np.zeros(2), prompt_tokens=np.array([1000, 1000]), output_tokens=np.array([10, 10]))
    result = simulate(aggregated(times), requests)
    assert result.first_token_s[1] > result.finish_s[0]  # the second waits for the first's cache
    roomy = simulate(aggregated(LinearTimes(base=1e-3, per_token=1e-5, per_decode=1e-4)), requests)
    assert roomy.first_token_s[1] < roomy.finish_s[0]


def test_chunked_prefill_bounds_tpot_under_long_prompts() -> None:
    times = RooflineStepTimes(model=LLAMA3_8B, hardware="h100", tp=1)
    workload = Workload(prompt_tokens=Uniform(low=4000, high=8000), output_tokens=Fixed(value=64), arrival_rate=4.0)
    requests = workload.sample(120)

    def run(chunked: bool) -> np.ndarray:
        pool = Pool(step_times=times, replicas=1, max_batch=64, token_budget=512, chunked_prefill=chunked)
        return simulate(Deployment(name="d", serve=pool), requests).tpot_s

    chunked, whole = run(True), run(False)
    # A chunked step holds at most the budget's tokens, so no decode waits longer than such a step.
    longest_step = times.mixed_s(512, 512 * 8000, 64, 64 * 8064)
    assert chunked.max() <= longest_step
    assert np.percentile(chunked, 99) < 0.5 * np.percentile(whole, 99)


def per_token(pool: Pool, requests: Requests) -> tuple[list[float], list[float]]:
    """One aggregated replica run step by step, every request's tokens counted one by one: the
    simulator's policies written plainly, as a reference for its exact times."""
    times, cap, chunked = pool.step_times, pool.step_times.kv_capacity_tokens, pool.chunked_prefill
    arrival, prompt, output = (requests.arrival_s.tolist(), requests.prompt_tokens.tolist(),
                               requests.output_tokens.tolist())
    n = len(arrival)
    first, finish, prefilled, generated = [math.nan] * n, [math.nan] * n, [0] * n, [0] * n
    queue: list[int] = []
    running: list[int] = []
    arrived, now = 0, 0.0
    while arrived < n or running or queue:
        if not running and not queue:  # idle: the next arrival starts a step alone, at once
            now, arrived = arrival[arrived], arrived + 1
            queue.append(arrived - 1)
        while queue and len(running) < pool.max_batch and \
                sum(prompt[i] + output[i] for i in running + queue[:1]) <= cap:
            running.append(queue.pop(0))
        decodes = [i for i in running if prefilled[i] == prompt[i]]
        waiting = [i for i in running if prefilled[i] < prompt[i]]
        decodes = decodes if chunked or not waiting else []
        budget, chunks = pool.token_budget - len(decodes), []
        for i in waiting:
            chunk = min(prompt[i] - prefilled[i], budget) if chunked else prompt[i] - prefilled[i]
            if chunk <= 0 or (not chunked and chunks and chunk > budget):
                break
            chunks.append((i, chunk))
            budget -= chunk
        now += times.mixed_s(sum(c for _, c in chunks), sum(c * prefilled[i] + c * (c + 1) // 2 for i, c in chunks),
                             len(decodes), sum(prompt[i] + generated[i] for i in decodes))
        for i in decodes:
            generated[i] += 1
        for i, c in chunks:
            prefilled[i] += c
            if prefilled[i] == prompt[i]:
                first[i], generated[i] = now, 1
        for i in [i for i in running if generated[i] == output[i]]:
            finish[i] = now
            running.remove(i)
        while arrived < n and arrival[arrived] <= now:
            queue.append(arrived)
            arrived += 1
    return first, finish


@pytest.mark.parametrize("chunked", [True, False])
def test_simulated_times_are_those_of_a_per_token_run(chunked: bool) -> None:
    """Exact times (the same floats) of a small, busy replica: batches and caches full, prompts chunked
    or whole, decodes stalled by whole prompts, one-token outputs; every step priced by its context."""
    times = LinearTimes(base=1e-3, per_token=3e-5, per_pair=1e-8, per_decode=7e-5, per_context=3e-7,
                        kv_capacity_tokens=160)
    pool = Pool(step_times=times, replicas=1, max_batch=4, token_budget=24, chunked_prefill=chunked)
    workload = Workload(prompt_tokens=Uniform(low=1, high=60), output_tokens=Uniform(low=1, high=30),
                        arrival_rate=60.0, seed=3)
    requests = workload.sample(60)
    result = simulate(Deployment(name="d", serve=pool), requests)
    first, finish = per_token(pool, requests)
    assert np.any(result.first_token_s == result.finish_s) and np.all(np.isfinite(result.finish_s))
    assert result.first_token_s.tolist() == first and result.finish_s.tolist() == finish


def test_simulation_is_deterministic_for_a_seed() -> None:
    deployment = aggregated(SMALL, replicas=2, max_batch=32, token_budget=512)
    first = simulate(deployment, SMALL_LOAD.sample(400))
    again = simulate(deployment, SMALL_LOAD.sample(400))
    assert np.array_equal(first.first_token_s, again.first_token_s)
    assert np.array_equal(first.finish_s, again.finish_s)
    other = Workload(prompt_tokens=SMALL_LOAD.prompt_tokens, output_tokens=SMALL_LOAD.output_tokens,
                     arrival_rate=SMALL_LOAD.arrival_rate, seed=1).sample(400)
    assert not np.array_equal(other.prompt_tokens, SMALL_LOAD.sample(400).prompt_tokens)


def test_sampling_shares_requests_across_rates_and_lengths() -> None:
    """Common random numbers: a rate only rescales arrival times, a longer run extends a shorter one."""
    slow, fast, long = SMALL_LOAD.sample(100, rate=1.0), SMALL_LOAD.sample(100, rate=4.0), SMALL_LOAD.sample(300)
    assert np.array_equal(slow.prompt_tokens, fast.prompt_tokens)
    assert np.allclose(slow.arrival_s, 4 * fast.arrival_s)
    assert np.array_equal(long.output_tokens[:100], slow.output_tokens)
    assert np.allclose(long.arrival_s[:100] * SMALL_LOAD.arrival_rate, slow.arrival_s)


SEARCH = dict(requests=300, duration_s=3.0, rel_tol=0.05)
"""Small but meaningful runs for the property tests: 30 requests beyond the 90th percentile."""


def test_more_replicas_never_lower_goodput() -> None:
    slo = SLO(ttft_s=0.1, tpot_s=0.01, percentile=0.9)
    goodputs = [find_goodput(aggregated(SMALL, replicas=k, max_batch=32, token_budget=512), SMALL_LOAD, slo,
                             **SEARCH).goodput_rps for k in (1, 2, 3, 4)]
    assert goodputs[0] > 0
    assert all(b >= a for a, b in zip(goodputs, goodputs[1:])), goodputs
    assert goodputs[3] > 2.5 * goodputs[0]  # roughly linear: replicas share nothing


@pytest.mark.slow
def test_more_devices_never_lower_the_best_goodput() -> None:
    """The issue's property, over every candidate (aggregated TP degrees, disaggregated splits) of a
    1B-parameter model priced by the roofline, on 1, 2 and 4 devices."""
    model = TransformerShape(layers=16, hidden=2048, heads=16, kv_heads=4, intermediate=8192, vocab=32000)
    workload = Workload(prompt_tokens=Uniform(low=64, high=512), output_tokens=Uniform(low=8, high=32),
                        arrival_rate=50.0)
    slo = SLO(ttft_s=0.05, tpot_s=0.006)
    best = []
    for devices in (1, 2, 4):
        candidates = candidate_deployments(Cluster(devices=devices, devices_per_node=4), model, max_batch=64,
                                           token_budget=512)
        ranked = best_deployment(candidates, workload, slo, requests=300, duration_s=0.5, rel_tol=0.05)
        best.append(max(r.goodput_rps for r in ranked))
    assert best[0] > 0 and all(b >= a for a, b in zip(best, best[1:])), best


def test_a_looser_slo_never_lowers_goodput() -> None:
    deployment = aggregated(SMALL, replicas=2, max_batch=32, token_budget=512)
    slos = [SLO(ttft_s=t, tpot_s=p, percentile=0.9) for t, p in ((0.05, 0.006), (0.1, 0.006), (0.1, 0.01), (0.3, 0.02))]
    goodputs = [find_goodput(deployment, SMALL_LOAD, slo, **SEARCH).goodput_rps for slo in slos]
    assert all(b >= a for a, b in zip(goodputs, goodputs[1:])), goodputs
    lax = find_goodput(deployment, SMALL_LOAD, SLO(ttft_s=0.3, tpot_s=0.02, percentile=0.5), **SEARCH)
    assert lax.goodput_rps >= goodputs[-1]


def test_goodput_is_zero_when_the_slo_is_unreachable_or_requests_do_not_fit() -> None:
    deployment = aggregated(SMALL)
    tight = find_goodput(deployment, SMALL_LOAD, SLO(ttft_s=1e-4, tpot_s=1.0), **SEARCH)
    assert tight.goodput_rps == 0 and "too tight" in tight.reason
    small_cache = aggregated(LinearTimes(base=1e-3, kv_capacity_tokens=100))
    refused = find_goodput(small_cache, SMALL_LOAD, SLO(ttft_s=1.0, tpot_s=1.0), **SEARCH)
    assert refused.goodput_rps == 0 and "KV cache" in refused.reason and refused.simulations == 0


def test_best_deployment_ranks_by_goodput_per_device() -> None:
    slo = SLO(ttft_s=0.1, tpot_s=0.01)
    one = aggregated(SMALL, replicas=1, max_batch=32, token_budget=512)
    # Twice the devices per replica for the same step times: half the goodput per device.
    wasteful = Deployment(name="wasteful", serve=Pool(step_times=SMALL, replicas=1, devices_per_replica=2,
                                                      max_batch=32, token_budget=512))
    ranked = best_deployment([wasteful, one], SMALL_LOAD, slo, **SEARCH)
    assert [r.deployment.name for r in ranked] == ["agg x1", "wasteful"]
    assert ranked[0].goodput_rps == pytest.approx(ranked[1].goodput_rps)
    assert ranked[0].goodput_per_device == pytest.approx(2 * ranked[1].goodput_per_device)


def test_goodput_of_a_trace_replays_it_at_scaled_rates() -> None:
    trace = SMALL_LOAD.sample(400)
    assert trace.rate == pytest.approx(SMALL_LOAD.arrival_rate, rel=0.1)
    fast = trace.at_rate(2 * trace.rate)
    assert fast.rate == pytest.approx(2 * trace.rate) and np.array_equal(fast.prompt_tokens, trace.prompt_tokens)
    deployment = aggregated(SMALL, replicas=2, max_batch=32, token_budget=512)
    slo = SLO(ttft_s=0.1, tpot_s=0.01)
    result = find_goodput(deployment, trace, slo, rel_tol=0.05)
    assert result.goodput_rps > 0 and result.report is not None and result.report.requests == 360
    sampled = find_goodput(deployment, SMALL_LOAD, slo, **SEARCH)
    assert result.goodput_rps == pytest.approx(sampled.goodput_rps, rel=0.3)  # the same load, replayed


def test_requests_needed_resolves_the_percentile() -> None:
    assert requests_needed(SLO(ttft_s=1, tpot_s=1, percentile=0.9)) == 500
    assert requests_needed(SLO(ttft_s=1, tpot_s=1, percentile=0.99)) == 5000
