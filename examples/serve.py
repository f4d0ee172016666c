"""Serve a batch of requests with continuous batching on 4 forked gloo ranks, two ways, and compare
the measured latencies with the simulator's: ``python examples/serve.py``.

(a) aggregated: 2 replicas of the example Llama at tp=2, requests routed to the replica with the least
    outstanding work; (b) disaggregated: a prefill replica (ranks 0, 1) and a decode replica (ranks 2,
    3), each request's KV cache sent point to point after its prefill. Both must give every request
    exactly the single-device greedy tokens. The simulator's step times are fitted to this run's
    measured calls (``autopar.serving.fit_step_times``), so the table checks its batching and queueing
    against the real loop's, not its step-time model.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.runtime.engine import EngineConfig, ServeRequest, serve  # noqa: E402
from autopar.runtime.forked import run_ranks  # noqa: E402
from autopar.runtime.generate import generate  # noqa: E402
from autopar.serving import Deployment, Pool, Requests, fit_step_times, simulate  # noqa: E402
from examples import llama  # noqa: E402

SLOTS, CHUNK, MAX_LEN, BUDGET = 4, 8, 64, 16
CACHE = tuple(f"layers.{i}.attention.cache.{kv}" for i in range(llama.LlamaConfig().layers) for kv in "kv")
CONFIG = EngineConfig(slots=SLOTS, chunk=CHUNK, max_len=MAX_LEN, token_budget=BUDGET, cache_buffers=CACHE)
MODES = {"aggregated": ["serve", "serve"], "disaggregated": ["prefill", "decode"]}
"""Each run's replica roles (replica 0 on ranks 0, 1; replica 1 on ranks 2, 3)."""


def make_requests(n: int = 10, rate: float = 25.0, seed: int = 0) -> list[ServeRequest]:
    """``n`` requests arriving as a Poisson process of ``rate`` per s, prompts of 3-30 tokens, 1-16 new."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n)) - 1 / rate
    vocab = llama.LlamaConfig().vocab_size
    return [ServeRequest(prompt=rng.integers(1, vocab, int(rng.integers(3, 31))).tolist(),
                         max_new_tokens=int(rng.integers(1, 17)), arrival_s=max(float(a), 0.0)) for a in arrivals]


def serving_llama() -> llama.Llama:
    model, *_ = llama.build()
    model.eval()
    model.setup_cache(slots=SLOTS, max_len=MAX_LEN)
    return model


def greedy(requests: list[ServeRequest]) -> list[list[int]]:
    """Single-device greedy tokens of each request (``generate`` on the plain model, one at a time)."""
    model = serving_llama()
    with torch.no_grad():
        return [generate(model, model, [r.prompt], r.max_new_tokens, chunk=CHUNK, slots=SLOTS, max_len=MAX_LEN
                         ).tokens[0] for r in requests]


def _step(batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    zeros = torch.zeros(batch, steps, dtype=torch.long)
    return zeros, zeros.clone(), torch.arange(batch)


def compile_replicas(mesh: Any) -> autopar.ServingModule:
    """This rank's replica of the Llama's serving steps, Megatron TP pinned: one plan for every replica
    (``replica_axis``), each rank's module on its replica's tp sub-mesh."""
    return autopar.compile_serving(serving_llama(), mesh, _step(1, CHUNK), _step(SLOTS, 1),
                                   constraints=llama.TP_PLAN, replica_axis="replica")


def serve_modes(serving: autopar.ServingModule, mesh: Any, requests: list[ServeRequest], modes: list[str]
                ) -> dict[str, Any]:
    """Warm the replicas up (first calls of each kind and the first transfers are slower), then serve
    ``requests`` in each mode: this rank's records."""
    replicas = mesh.mesh.tolist()
    warmup = [ServeRequest(prompt=[1] * (CHUNK + 1), max_new_tokens=3, arrival_s=0.0)] * 2
    for roles in MODES.values():
        serve(serving, warmup, replicas, roles, CONFIG)
    return {mode: dataclasses.asdict(serve(serving, requests, replicas, MODES[mode], CONFIG)) for mode in modes}


def serve_on_rank(rank: int, world: int, requests: list[ServeRequest], modes: list[str]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replica", "tp"))
    return serve_modes(compile_replicas(mesh), mesh, requests, modes)


def delivered(records: list[dict[str, Any]], mode: str) -> tuple[dict[int, list[int]], dict[int, list[float]]]:
    """Each request's tokens and their times where the user gets them: its serving replica's first rank
    (the decode replica's, disaggregated), from the ranks' records in rank order."""
    roles = MODES[mode]
    tokens: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    for record in records:
        if roles[record["replica"]] != "prefill" and record["token_s"]:
            tokens.update(record["tokens"])
            times.update(record["token_s"])
    return tokens, times


def latencies(requests: list[ServeRequest], times: dict[int, list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Measured TTFT and TPOT of each request (TPOT 0 for a single token, as the simulator counts)."""
    ttft = np.array([times[i][0] - r.arrival_s for i, r in enumerate(requests)])
    tpot = np.array([(times[i][-1] - times[i][0]) / (len(times[i]) - 1) if len(times[i]) > 1 else 0.0
                     for i in range(len(requests))])
    return ttft, tpot


def simulated(mode: str, records: list[dict[str, Any]], requests: list[ServeRequest]) -> tuple[Any, Any]:
    """The simulator's TTFT and TPOT for the same arrivals and lengths, its step times fitted to the
    calls measured by this run's replicas' first ranks (and its transfers); and the fitted times."""
    leaders = [r for r in records if r["steps"]]
    times = fit_step_times(decode_calls_s=[s for r in leaders for s in r["decode_calls_s"]],
                           prefill_calls_s=[s for r in leaders for s in r["prefill_calls_s"]],
                           steps=[tuple(s) for r in leaders for s in r["steps"]],
                           gaps_s=[s for r in leaders for s in r["gaps_s"]],
                           transfers_s=[s for r in records for _, s in r["transfers"]], chunk=CHUNK,
                           capacity_tokens=SLOTS * MAX_LEN)

    def pool(replicas: int) -> Pool:
        return Pool(step_times=times, replicas=replicas, devices_per_replica=2, max_batch=SLOTS, token_budget=BUDGET)
    deployment = Deployment(name=mode, serve=pool(2)) if mode == "aggregated" else \
        Deployment(name=mode, prefill=pool(1), decode=pool(1))
    run = simulate(deployment, Requests(arrival_s=[r.arrival_s for r in requests],
                                        prompt_tokens=[len(r.prompt) for r in requests],
                                        output_tokens=[r.max_new_tokens for r in requests]))
    return (run.ttft_s, run.tpot_s), times


def _ms(values: np.ndarray, p: int) -> str:
    return f"{1e3 * float(np.percentile(values, p)):7.1f}"


def main() -> None:
    torch.set_num_threads(1)  # before any op: forked ranks cannot use the parent's OpenMP pool
    requests = make_requests()
    want = greedy(requests)
    results = run_ranks(serve_on_rank, 4, requests, list(MODES), timeout_s=120)
    print(f"{len(requests)} requests, prompts {min(len(r.prompt) for r in requests)}-"
          f"{max(len(r.prompt) for r in requests)} tokens, outputs {min(r.max_new_tokens for r in requests)}-"
          f"{max(r.max_new_tokens for r in requests)}, Poisson arrivals over {requests[-1].arrival_s:.3f} s; "
          f"{SLOTS} slots, chunk {CHUNK}, token budget {BUDGET} per replica")
    print(f"{'':15}{'TTFT p50':>18}{'TTFT p90':>18}{'TPOT p50':>18}{'TPOT p90':>18}   (ms, measured / simulated)")
    for mode in MODES:
        records = [result[mode] for result in results]
        tokens, times = delivered(records, mode)
        got = [tokens[i] for i in range(len(requests))]
        assert got == want, f"{mode}: tokens differ from single-device greedy: {got} vs {want}"
        (ttft, tpot), ((sim_ttft, sim_tpot), fitted) = latencies(requests, times), simulated(mode, records, requests)
        cells = [f"{_ms(m, p)} / {_ms(s, p)}" for m, s in ((ttft, sim_ttft), (tpot, sim_tpot)) for p in (50, 90)]
        print(f"{mode:15}" + "".join(f"{c:>18}" for c in cells))
        print(f"{'':15}fitted: decode call {1e3 * fitted.decode_call_s:.2f} ms, prefill call "
              f"{1e3 * fitted.prefill_call_s:.2f} ms, step overhead {1e3 * fitted.overhead_s:.2f} ms, "
              f"KV transfer {1e3 * fitted.transfer_s:.2f} ms")
    print("tokens: aggregated == disaggregated == single-device greedy for every request")


if __name__ == "__main__":
    main()
