"""plan_serving: step times fitted through ILP-planned serving steps, and the deployment chosen with them.

Planning only (meta-device models, no weights): the example Llama's serving step (KV cache as buffers).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

import autopar
from autopar.cli.main import main
from autopar.hardware import get_profile
from autopar.mesh import Mesh
from autopar.serving import Uniform
from autopar.serving.deployment import Pool
from autopar.serving.limits import Means, Pins, budget_within, decode_batch_within, pool_moves
from autopar.serving.planned import PlannedStepTimes, plan_point, plan_step_times
from autopar.serving.servable import StepShape
from examples import moe
from examples.llama import Llama, LlamaConfig, build_serving, build_small_serving

pytestmark = pytest.mark.slow

H100 = get_profile("h100")
WORKLOAD = autopar.Workload(prompt_tokens=Uniform(low=256, high=1024), output_tokens=Uniform(low=64, high=256),
                            arrival_rate=10)
SLO = autopar.SLO(ttft_s=0.1, tpot_s=0.01)
FAST = {"max_batch": 16, "token_budget": 1024, "rel_tol": 0.05}
"""Small batches keep the goodput (and so the simulated requests) low: the tests stay fast."""


@pytest.fixture(scope="module")
def small() -> Llama:
    return build_small_serving()


@pytest.fixture(scope="module")
def few_kv_heads() -> Llama:
    """The small model with 2 KV heads: 2 KiB of cache a token, so that its weights (209 MiB) decide what fits."""
    return build_serving(LlamaConfig(vocab_size=32000, max_seq_len=2048, hidden=1024, heads=16, kv_heads=2,
                                     ffn_hidden=2816, layers=4))


TIGHT = dataclasses.replace(H100, name="h100-400MB", memory_bytes=400e6, memory_headroom=0.0, allocator=None)
"""A device too small for the model's decode steps at tp=1 (weights and a batch of 128's cache: 528 MiB)."""


@pytest.fixture(scope="module")
def wide() -> Llama:
    """Two layers of Llama-3-8B's width: wide enough that the ILP splits decode steps by heads under TP."""
    return build_serving(LlamaConfig(vocab_size=128256, max_seq_len=4096, hidden=4096, heads=32, kv_heads=8,
                                     ffn_hidden=14336, layers=2))


def test_plan_is_consistent(small: Llama) -> None:
    plan = autopar.plan_serving(small, autopar.Cluster(devices=4), WORKLOAD, SLO, **FAST)
    assert plan.kind in ("aggregated", "disaggregated") and plan.goodput_rps > 0 and not plan.reason
    assert sum(p.replicas * p.tp * p.pp for p in plan.pools) <= 4
    assert plan.best_aggregated_rps > 0 and plan.best_disaggregated_rps > 0
    assert plan.goodput_rps == max(plan.best_aggregated_rps, plan.best_disaggregated_rps)
    assert plan.ttft_p_s is not None and plan.ttft_p_s <= SLO.ttft_s and plan.tpot_p_s <= SLO.tpot_s
    for pool in plan.pools:
        assert pool.kv_capacity_tokens > 0 and pool.slots > 0 and pool.parameters
    assert json.loads(json.dumps(plan.to_json()))["goodput_rps"] == plan.goodput_rps
    text = str(plan)
    assert "goodput" in text and plan.deployment in text


def test_impossible_slo_has_goodput_zero_and_a_reason(small: Llama) -> None:
    plan = autopar.plan_serving(small, autopar.Cluster(devices=2), WORKLOAD,
                                autopar.SLO(ttft_s=0.1, tpot_s=1e-5), **FAST)
    assert plan.goodput_rps == 0 and plan.kind == "none"
    assert "TPOT target" in plan.reason


def test_more_devices_never_lower_goodput(small: Llama) -> None:
    goodputs = [autopar.plan_serving(small, autopar.Cluster(devices=n, devices_per_node=4), WORKLOAD, SLO,
                                     **FAST).goodput_rps for n in (2, 4, 8)]
    assert goodputs[0] <= goodputs[1] <= goodputs[2]


def test_interpolation_matches_a_held_out_planned_step(wide: Llama) -> None:
    times = plan_step_times(wide, H100, 8, 2, max_context=2048, token_budget=2048, max_positions=4096,
                            transfer_intra_node=True)
    limit = H100.memory_limit()
    # between the planned batches (32, 128) and contexts (512, 2048)
    decode = StepShape(batch=64, steps=1, max_len=1024)
    prefill = StepShape(batch=1, steps=1024, max_len=1024)  # between the planned chunks (256, 2048)
    direct_decode = plan_point(wide, H100, 8, 2, decode, limit, times.state).step_time_s  # the replica's layout
    direct_prefill = plan_point(wide, H100, 8, 2, prefill, limit, times.state).step_time_s
    assert times.decode_s(decode.batch, decode.context_tokens) == pytest.approx(direct_decode, rel=0.05)
    assert times.prefill_s(prefill.tokens, prefill.pairs) == pytest.approx(direct_prefill, rel=0.05)


def test_decode_step_grows_with_context_and_batch(wide: Llama) -> None:
    times = plan_step_times(wide, H100, 8, 2, max_context=2048, token_budget=2048, max_positions=4096,
                            transfer_intra_node=True)
    assert times.decode_s(32, 32 * 256) < times.decode_s(32, 32 * 2048)
    assert times.decode_s(32, 32 * 512) < times.decode_s(128, 128 * 512)
    assert times.kv_transfer_s(1024) > times.kv_transfer_s(128) > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_bytes_per_token_are_the_cache_heads_share(wide: Llama, tp: int) -> None:
    times = plan_step_times(wide, H100, 8, tp, max_context=2048, token_budget=2048, max_positions=4096,
                            transfer_intra_node=True)
    layers, kv_heads, head_dim, nbytes = 2, 8, 128, 2
    whole = 2 * layers * kv_heads * head_dim * nbytes  # keys and values of every layer
    assert times.decode_points[0].kv_bytes_per_token == whole
    assert times.kv_bytes_per_token_device == whole / tp  # split by KV heads (8 >= tp)


def test_cli_serve_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve-plan", "examples/llama.py:build_small_serving", "--devices", "2", "--prompt", "256-1024",
                 "--output", "64-256", "--rate", "10", "--ttft", "0.1", "--tpot", "0.01", "--max-batch", "16",
                 "--token-budget", "1024", "--no-disaggregated", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["goodput_rps"] > 0 and out["kind"] == "aggregated" and out["pools"][0]["role"] == "serve"


def test_not_servable_models_are_refused() -> None:
    with pytest.raises(autopar.InputError, match="setup_cache"):
        autopar.plan_serving(nn.Linear(4, 4), autopar.Cluster(devices=2), WORKLOAD, SLO)
    with pytest.raises(autopar.InputError, match="positions"):
        with torch.device("meta"):
            short = Llama(LlamaConfig(max_seq_len=64))
        autopar.plan_serving(short, autopar.Cluster(devices=2), WORKLOAD, SLO)


def test_a_replicas_steps_share_one_weight_layout(wide: Llama) -> None:
    """A replica holds one copy of its weights: every planned step of a layout places them alike."""
    for layout in ("decode", "prefill"):
        times = plan_step_times(wide, H100, 8, 2, max_context=2048, token_budget=2048, max_positions=4096,
                                transfer_intra_node=True, layout=layout)
        own = times.decode_points if layout == "decode" else times.prefill_points
        assert all(p.state == times.state for p in own)
    decode = plan_step_times(wide, H100, 8, 2, max_context=2048, token_budget=2048, max_positions=4096,
                             transfer_intra_node=True)
    assert all(p.state == decode.state for p in decode.prefill_points)  # an aggregated replica's prefills too


def test_a_model_too_big_for_one_device_gets_a_replica_that_fits(few_kv_heads: Llama) -> None:
    """tp=1 does not fit: with TP allowed the plan may pick tp=2 or tp=1 x pp=2; with tp=1 only, a pipeline."""
    cluster = autopar.Cluster(devices=2, hardware=TIGHT)
    for degrees in (None, (1,)):
        plan = autopar.plan_serving(few_kv_heads, cluster, WORKLOAD, SLO, tp_degrees=degrees, **FAST)
        assert "tp=1" in plan.skipped and "memory" in plan.skipped["tp=1"]
        assert plan.goodput_rps > 0
        for pool in plan.pools:
            assert (pool.tp, pool.pp) != (1, 1)
            held = pool.weight_bytes_device + pool.kv_capacity_tokens * pool.kv_bytes_per_token_device / pool.pp
            assert held <= TIGHT.memory_limit()
    assert [(p.tp, p.pp) for p in plan.pools] == [(1, 2)]  # tp=1 only: the pipeline
    assert plan.pools[0].kv_bytes_per_token_device == 2 * 4 * 2 * 64 * 2 / 2  # each stage holds 2 of 4 layers' caches
    assert plan.to_json()["pools"][0]["pp"] == 2
    assert "pp=2" in str(plan)


def test_a_model_no_node_holds_is_pipelined_across_nodes(few_kv_heads: Llama) -> None:
    """One device per node, too small for the model: the replica spans two nodes (tp=1 x pp=2), and so does the unit."""
    plan = autopar.plan_serving(few_kv_heads, autopar.Cluster(devices=4, devices_per_node=1, hardware=TIGHT),
                                WORKLOAD, SLO, **FAST)
    assert plan.goodput_rps > 0 and plan.unit_devices == 2 and plan.units == 2
    assert {(p.tp, p.pp) for p in plan.pools} == {(1, 2)}


def test_a_pipelined_replicas_fit_matches_a_held_out_planned_step(small: Llama) -> None:
    """A tp=1 x pp=2 replica's decode line against its directly planned pipelined step (its weights and cut)."""
    times = plan_step_times(small, H100, 8, 1, max_context=1280, token_budget=1024, max_positions=2048,
                            transfer_intra_node=True, pp=2)
    held_out = StepShape(batch=64, steps=1, max_len=640)  # between the planned batches (32, 128) and contexts
    direct = plan_point(small, H100, 8, 1, held_out, H100.memory_limit(), times.state, pp=2,
                        cut=times.decode_points[2].cut)
    assert times.decode_s(held_out.batch, held_out.context_tokens) == pytest.approx(direct.step_time_s, rel=0.05)
    assert all(p.cut == times.decode_points[2].cut for p in times.decode_points + times.prefill_points)
    whole = plan_step_times(small, H100, 8, 1, max_context=1280, token_budget=1024, max_positions=2048,
                            transfer_intra_node=True)
    # Two stages hold half the layers' caches each; the simulator's virtual replicas hold half the replica's.
    assert times.kv_bytes_per_token_device == whole.kv_bytes_per_token_device / 2
    assert times.kv_capacity_tokens * 2 > whole.kv_capacity_tokens


def test_cli_serve_plan_shows_the_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve-plan", "examples/llama.py:build_small_serving", "--devices", "2", "--prompt", "256-1024",
                 "--output", "64-256", "--rate", "10", "--ttft", "0.1", "--tpot", "0.01", "--no-disaggregated",
                 "--tp", "1", "--pp", "2", "--width", "200"])
    assert code == 0
    out = capsys.readouterr().out
    assert "agg tp=1 pp=2 x1" in out and "pp=2 (2 batches in flight)" in out
    assert "token budget" in out and "chosen per pool by goodput" in out  # --max-batch, --token-budget left open


def test_a_servable_mixture_of_experts_splits_its_experts_within_a_replica() -> None:
    """``examples/moe.py``'s model served (its own KV cache, as the Llama's): on devices too small for it
    whole (812 MiB at tp=1, 406 at tp=2, 572 MB usable), a tp=2 replica, the ILP splitting the stacked
    expert weights over tp (by expert, as expert parallelism with the all-gather dispatcher, or inside
    the experts: here w1 and w3 by their hidden dim)."""
    cfg = moe.MoEConfig(vocab_size=32000, max_seq_len=2048, hidden=1024, heads=16, kv_heads=2, ffn_hidden=1024,
                        layers=2, experts=16, top_k=2)
    with torch.device("meta"):
        model = moe.MoETransformer(cfg)
    small_device = dataclasses.replace(H100, name="h100-600MB", memory_bytes=600e6, memory_headroom=0.0, allocator=None)
    plan = autopar.plan_serving(model, autopar.Cluster(devices=2, hardware=small_device), WORKLOAD, SLO,
                                tp_degrees=(1, 2),
                                pp_degrees=(1,), disaggregated=False, **FAST)
    assert "tp=1" in plan.skipped and plan.goodput_rps > 0
    (pool,) = plan.pools
    assert (pool.tp, pool.pp) == (2, 1)
    experts = {k: v for k, v in pool.parameters.items() if ".moe.experts." in k}
    assert experts and any(v.startswith("S(") for v in experts.values()), experts  # not every rank holds them whole


TIGHT_TPOT = autopar.SLO(ttft_s=0.15, tpot_s=0.002)
"""The small model's decode step at its full batch (256) takes ~2.8 ms at the mean context: 2 ms binds the batch,
and 150 ms of TTFT leaves room to queue for admission (and keeps the simulated runs short)."""


def test_open_limits_pick_a_smaller_decode_batch_under_a_tight_tpot(small: Llama) -> None:
    """Searched limits beat vLLM's 256 pinned, with a smaller batch; and never do worse than the defaults, which
    they include (here also at a loose SLO, where the defaults stay). The gain is ~4%: a limit is kept when it
    beats the search's precision, so it runs at 2%."""
    # The gain sits where the decode step crosses the TPOT, so the test keeps the flat figures it was
    # written against (before issue 31's measured curves: one compute and memory efficiency, no
    # measured bus bandwidth or allocator margin); with the measured ones no smaller batch helps here.
    flat = dataclasses.replace(H100, memory_efficiency=0.8, matmul_efficiency=(), attention_efficiency=(),
                               bus_bandwidth=(), allocator=None, intra_node_latency=5e-6)
    cluster = autopar.Cluster(devices=2, hardware=flat)
    pinned = autopar.plan_serving(small, cluster, WORKLOAD, TIGHT_TPOT, tp_degrees=(1,), rel_tol=0.02,
                                  max_batch=256, token_budget=2048)
    open_ = autopar.plan_serving(small, cluster, WORKLOAD, TIGHT_TPOT, tp_degrees=(1,), rel_tol=0.02)
    assert open_.goodput_rps > pinned.goodput_rps > 0
    assert open_.best_disaggregated_rps > pinned.best_disaggregated_rps > 0
    assert all(p.max_batch < 256 for p in open_.pools if p.role != "prefill")
    decode_limits = [c["limits"][1] for c in open_.candidates if c["name"].startswith("disagg")]
    assert decode_limits[0][0] < 256 and [256, 2048] in decode_limits  # the best's batch; the default was tried
    assert all(c["limits"] == [[256, 2048]] * len(c["limits"]) for c in pinned.candidates)
    assert open_.pinned == {"max_batch": None, "token_budget": None} and "chosen per pool" in str(open_)
    assert open_.to_json()["pools"][0]["max_batch"] == open_.pools[0].max_batch
    one = autopar.Cluster(devices=1)
    default = autopar.plan_serving(small, one, WORKLOAD, SLO, rel_tol=0.05, max_batch=256, token_budget=2048)
    assert autopar.plan_serving(small, one, WORKLOAD, SLO, rel_tol=0.05).goodput_rps >= default.goodput_rps


def test_pinned_limits_hold_for_every_pool(small: Llama) -> None:
    cluster = autopar.Cluster(devices=2)
    for pins in ({"max_batch": 32}, {"token_budget": 512}):
        plan = autopar.plan_serving(small, cluster, WORKLOAD, TIGHT_TPOT, tp_degrees=(1,), rel_tol=0.05, **pins)
        key, value = next(iter(pins.items()))
        index = 0 if key == "max_batch" else 1
        assert all(getattr(p, key) == value for p in plan.pools) and plan.pinned[key] == value
        assert all(limits[index] == value for c in plan.candidates for limits in c["limits"])
        assert f"{key}={value} pinned" in str(plan)
    for bad in (0, 2.5, True):
        with pytest.raises(autopar.InputError, match="max_batch"):
            autopar.plan_serving(small, cluster, WORKLOAD, SLO, max_batch=bad)


def test_limits_derived_from_the_step_lines_by_hand() -> None:
    """Decode step = w + beta B + gamma B L: at w 1 ms, beta 2 us, gamma 10 ns and L = 600 + 400 / 2 = 800 cached
    tokens, a request adds 2 + 8 = 10 us, so under a 2.055 ms TPOT B <= 1.055 / 0.010 = 105.5: 105. A prefill step
    of T tokens is max(w, a + b T + c T (600 + 1) / 2) = max(1 ms, 0.1 ms + 1.3005 us T): within half a 2.4 ms TTFT,
    T <= 1.1 / 1.3005e-3 = 845.8: 845. The ladders' rungs around them: batches 64 and 128 (up to the cache's
    slots), budgets 512 and 1024."""
    times = PlannedStepTimes(tp=1, decode_line=(1e-3, 2e-6, 1e-8), prefill_line=(1e-4, 1e-6, 1e-9),
                             kv_capacity_tokens=1_000_000, kv_bytes_per_token_device=1.0,
                             transfer_mesh=Mesh({"pd": 2}, H100, devices_per_node=2), state=(), prefill_points=(),
                             decode_points=())
    means, slo = Means(prompt=600, output=400), autopar.SLO(ttft_s=2.4e-3, tpot_s=2.055e-3)
    assert decode_batch_within(times, slo.tpot_s, means.context, 256) == 105
    assert decode_batch_within(times, slo.tpot_s, means.context, 100) == 100
    assert decode_batch_within(times, 0.9e-3, means.context, 256) == 0  # not even one request's step fits
    assert budget_within(times, slo.ttft_s / 2, means, 0, 2048) == 845
    open_ = Pins(max_batch=None, token_budget=None)
    assert pool_moves(Pool(step_times=times, replicas=1), "decode", means, slo, open_) == [("max_batch", 64),
                                                                                            ("max_batch", 128)]
    few_slots = dataclasses.replace(times, kv_capacity_tokens=100_000)  # 100 requests of 1000 tokens
    assert pool_moves(Pool(step_times=few_slots, replicas=1), "decode", means, slo, open_) == [("max_batch", 64)]
    assert pool_moves(Pool(step_times=times, replicas=1), "prefill", means, slo, open_) == [("token_budget", 512),
                                                                                             ("token_budget", 1024)]
    assert pool_moves(Pool(step_times=times, replicas=1), "decode", means, slo,
                      Pins(max_batch=32, token_budget=None)) == []
