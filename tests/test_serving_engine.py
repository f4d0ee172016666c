"""The continuous-batching serving engine: the scheduler's policies (the simulator's), and on 4 forked
gloo ranks 2 replicas of tp=2, aggregated and disaggregated (KV caches sent point to point), giving
every request the single-device greedy tokens, with measured latencies that make sense."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autopar
from autopar.errors import InputError
from autopar.hardware import get_profile
from autopar.runtime import engine
from autopar.runtime.engine import ServeRequest, serve
from autopar.runtime.forked import run_ranks
from autopar.runtime.generate import generate
from autopar.runtime.scheduler import Scheduler
from autopar.serving import fit_step_times
from autopar.serving.planned import EXPERT_PARALLEL
from examples import moe, serve as example


def test_scheduler_batches_routes_and_hands_off_as_the_simulator() -> None:
    """Aggregated: arrivals go to the least loaded replica; a step decodes every running request and
    fills the token budget with chunks in admission order; each replica is planned when it is done.
    Disaggregated: the prefill replica sends a prefilled request's cache with its next plan (freeing the
    slot), and the decode replica receives it when it admits it, decoding it in the same step."""
    s = Scheduler([(0.0, 10, 3), (0.0, 4, 2), (0.5, 3, 1)], ["serve", "serve"], slots=2, max_len=16, token_budget=6)
    s.arrive(0.0)
    assert s.plan(0).prefill == [(0, 0, 0, 6)] and s.plan(1).prefill == [(1, 0, 0, 4)]
    s.done(1)
    assert s.plan(1).decode == [(1, 0, 4)], "request 1 decodes while replica 0 still runs its first step"
    s.done(1)
    assert not s.plan(1), "request 1 is done (2 tokens); the third has not arrived"
    s.done(0)
    assert s.plan(0).prefill == [(0, 0, 6, 4)]
    s.arrive(0.6)
    third = s.plan(1)
    assert third.prefill == [(2, 1, 0, 3)], "routed to replica 1 (less outstanding work), into its free slot"
    d = Scheduler([(0.0, 5, 3)], ["prefill", "decode"], slots=1, max_len=16, token_budget=8)
    d.arrive(0.0)
    assert d.plan(0).prefill == [(0, 0, 0, 5)] and not d.plan(1)
    d.done(0)
    send, receive = d.plan(0).send, d.plan(1)
    assert [(t.request, t.src, t.src_slot, t.dst, t.length) for t in send] == [(0, 0, 0, 1, 5)]
    assert [(t.request, t.dst_slot) for t in receive.receive] == [(0, 0)] and receive.decode == [(0, 0, 5)]
    d.done(0)
    d.done(1)
    assert d.plan(1).decode == [(0, 0, 6)] and d.replicas[0].free == [0]
    d.done(1)
    assert d.finished
    with pytest.raises(InputError, match="does not fit a cache slot"):
        Scheduler([(0.0, 15, 4)], ["serve"], slots=1, max_len=16, token_budget=8)


def test_fitted_step_times() -> None:
    """Means of the calls; the overhead is what a step takes beyond its calls, plus the gaps."""
    times = fit_step_times(decode_calls_s=[0.01, 0.03], prefill_calls_s=[0.02], gaps_s=[0.001, 0.003],
                           steps=[(2, 0, 0, 0.025), (0, 16, 3, 0.065)], transfers_s=[0.004], chunk=8,
                           capacity_tokens=64)
    assert times.overhead_s == pytest.approx(0.005 + 0.002)
    assert times.decode_s(3, 40) == pytest.approx(0.027)
    assert times.prefill_s(8, 36) == pytest.approx(0.007 + 0.02 * 1.5)
    assert times.mixed_s(8, 36, 1, 5) == pytest.approx(0.007 + 0.03 + 0.02)
    assert times.kv_transfer_s(10) == 0.004 and times.kv_capacity_tokens == 64


REQUESTS = [ServeRequest(prompt=[5, 7, 9, 11, 13, 2, 3, 4, 8, 100, 200], max_new_tokens=5, arrival_s=0.0),
            ServeRequest(prompt=[42, 17, 3], max_new_tokens=1, arrival_s=0.0),
            ServeRequest(prompt=list(range(1, 20)), max_new_tokens=4, arrival_s=0.01),
            ServeRequest(prompt=[8, 6, 4], max_new_tokens=6, arrival_s=0.3)]
"""Two chunks with padding, one token only, a prompt over the token budget, a late lone arrival (each
replica idles while the other works, disaggregated; rank 0 broadcasts empty plans while none has work)."""


def engine_on_rank(rank: int, world: int) -> dict[str, Any]:
    engine.IDLE_S = 0.05  # the late arrival's wait broadcasts empty plans too
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "tp"))
    errors = []
    try:
        autopar.compile_serving(example.serving_llama(), mesh, example._step(1, example.CHUNK),
                                example._step(example.SLOTS, 1), replica_axis="dp")
    except InputError as exc:
        errors.append(str(exc))
    serving = example.compile_replicas(mesh)
    out = example.serve_modes(serving, mesh, REQUESTS, list(example.MODES))
    try:
        serve(serving, [ServeRequest(prompt=[1] * 70, max_new_tokens=2, arrival_s=0.0)], mesh.mesh.tolist(),
              ["serve", "serve"], example.CONFIG)
    except InputError as exc:
        errors.append(str(exc))
    planned = Scheduler.plan
    Scheduler.plan = _fail  # type: ignore[method-assign]
    try:
        serve(serving, REQUESTS[:1], mesh.mesh.tolist(), ["prefill", "decode"], example.CONFIG)
    except RuntimeError as exc:
        errors.append(str(exc))
    finally:
        Scheduler.plan = planned  # type: ignore[method-assign]
    return {**out, "errors": errors}


def _fail(self: Scheduler, replica: int) -> None:
    raise ValueError(f"no plan for replica {replica}")


def test_engine_on_replicas_gives_the_single_device_tokens() -> None:
    """Aggregated (2 x tp=2) and disaggregated (prefill tp=2 -> decode tp=2): every request's tokens
    are the single-device greedy ones, on every rank that produced them; TTFT is at least a prefill
    call and TPOT positive; bad input (an unknown replica axis, a request over a slot) is refused on
    every rank, and a failing scheduler raises on every rank."""
    want = example.greedy(REQUESTS)
    results = run_ranks(engine_on_rank, 4, timeout_s=120)
    for mode in example.MODES:
        records = [result[mode] for result in results]
        tokens, times = example.delivered(records, mode)
        assert [tokens[i] for i in range(len(REQUESTS))] == want, mode
        for record in records:  # every rank of a replica has its tokens (a prefill replica: the first)
            prefill = example.MODES[mode][record["replica"]] == "prefill"
            assert all(t == (want[i][:1] if prefill else want[i]) for i, t in record["tokens"].items()), \
                (mode, record["replica"])
        ttft, tpot = example.latencies(REQUESTS, times)
        first_prefill = min(s for r in records for s in r["prefill_calls_s"])
        assert (ttft >= first_prefill).all(), (mode, ttft, first_prefill)
        assert all((tpot[i] > 0) == (r.max_new_tokens > 1) for i, r in enumerate(REQUESTS)), (mode, tpot)
        transfers = [t for r in records for t in r["transfers"]]
        assert sorted(n for n, _ in transfers) == ([] if mode == "aggregated" else [3, 3, 11, 19]), transfers
        (sim_ttft, _), _ = example.simulated(mode, records, REQUESTS)
        assert (sim_ttft > 0).all()
    for result in results:
        assert len(result["errors"]) == 3, result["errors"]
        assert "replica_axis 'dp'" in result["errors"][0] and "does not fit a cache slot" in result["errors"][1]
        assert "scheduler failed on rank 0: ValueError: no plan for replica 0" in result["errors"][2]



MOE = moe.MoEConfig(vocab_size=256, max_seq_len=example.MAX_LEN, hidden=64, heads=4, kv_heads=2, ffn_hidden=256,
                    layers=2, experts=4, top_k=2)
MOE_CONFIG = dataclasses.replace(example.CONFIG, cache_buffers=tuple(
    f"layers.{i}.attention.cache.{kv}" for i in range(MOE.layers) for kv in "kv"))
SLOW_MEMORY = dataclasses.replace(get_profile("h100"), name="h100-slow-memory",
                                  memory_bandwidth=get_profile("h100").memory_bandwidth / 1000)
"""Memory 1000x slower than an H100's: reading every expert per decode step costs more than the all-to-alls of
a few tokens, so the planner splits these tiny experts by expert (an H100 keeps them whole)."""


def _serving_moe() -> moe.MoETransformer:
    model, *_ = moe.build(MOE, batch=1)
    model.eval()
    model.setup_cache(slots=example.SLOTS, max_len=example.MAX_LEN)
    return model


def expert_parallel_engine_on_rank(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "ep"))
    serving = autopar.compile_serving(_serving_moe(), mesh, example._step(1, example.CHUNK),
                                      example._step(example.SLOTS, 1), hardware=SLOW_MEMORY, replica_axis="replica",
                                      decode_options=EXPERT_PARALLEL)
    records = {mode: dataclasses.asdict(serve(serving, REQUESTS, mesh.mesh.tolist(), roles, MOE_CONFIG))
               for mode, roles in example.MODES.items()}
    experts = {v for k, v in serving.placements.items() if ".moe.experts." in k}
    return {**records, "experts": experts}


def test_engine_serves_expert_parallel_replicas() -> None:
    """The layout ``plan_serving``'s ep pools run (``serving.planned.EXPERT_PARALLEL``), on 2 replicas of ep=2:
    the decode step's slots split on ep with the experts split by expert, aggregated and disaggregated (the
    whole cache sent between replicas), every request the single-device greedy tokens."""
    model = _serving_moe()
    with torch.no_grad():
        want = [generate(model, model, [r.prompt], r.max_new_tokens, chunk=example.CHUNK, slots=example.SLOTS,
                         max_len=example.MAX_LEN).tokens[0] for r in REQUESTS]
    results = run_ranks(expert_parallel_engine_on_rank, 4, timeout_s=120)
    assert results[0]["experts"] == {(Shard(0),)}
    for mode in example.MODES:
        tokens, _ = example.delivered([result[mode] for result in results], mode)
        assert [tokens[i] for i in range(len(REQUESTS))] == want, mode
